-- reaper migration 27: archived rows also keep their record's text form (issue 40: restore exact
-- for every column type). `row_data` (to_jsonb) names the columns, which restore compares with the
-- table's; but a json value's duplicate keys and key order, an array's lower bound and other
-- details do not survive jsonb. `row_text` is `t::text`, read back through the table's own row
-- type (each column's input function), so a restore into an unchanged table is exact. Rows
-- archived before this migration have none and are restored from row_data, as before.
ALTER TABLE cleanup_archive ADD COLUMN IF NOT EXISTS row_text text;
