-- reaper migration 30: `reaper restore --partition` (issue 44 review).
-- 1. A restored partition stays attached until the operator releases it: state 'restored' is
--    classified blocked (nothing retires it again), `reaper partitions <policy> --release
--    <schema.name>` moves it to 'released', after which a run may retire it anew (a new row).
ALTER TABLE cleanup_partitions DROP CONSTRAINT IF EXISTS cleanup_partitions_state_check;
ALTER TABLE cleanup_partitions ADD CONSTRAINT cleanup_partitions_state_check
  CHECK (state IN ('detaching', 'quarantined', 'kept', 'dropped', 'restored', 'released'));
CREATE INDEX IF NOT EXISTS cleanup_partitions_restored ON cleanup_partitions (parent_table) WHERE state = 'restored';

-- 2. A partition's restore is logged in the restore log like a row restore: one row, with the
--    retirement it undid, the partition (key 'partition:reaper_retired.<name>'), its bound, the rows
--    it brought back and the operator. Such a row has no archived row: archive_id becomes nullable
--    (the primary key becomes a unique index on the same columns; NULLs are distinct there).
ALTER TABLE cleanup_restores ADD COLUMN IF NOT EXISTS retirement_id bigint;
ALTER TABLE cleanup_restores ADD COLUMN IF NOT EXISTS row_count bigint;
ALTER TABLE cleanup_restores ADD COLUMN IF NOT EXISTS partition_bound text;
ALTER TABLE cleanup_restores DROP CONSTRAINT IF EXISTS cleanup_restores_pkey;
CREATE UNIQUE INDEX IF NOT EXISTS cleanup_restores_once ON cleanup_restores (restore_id, archive_id);
ALTER TABLE cleanup_restores ALTER COLUMN archive_id DROP NOT NULL;
ALTER TABLE cleanup_restores ALTER COLUMN run_id DROP NOT NULL;
ALTER TABLE cleanup_restores DROP CONSTRAINT IF EXISTS cleanup_restores_row_or_partition;
ALTER TABLE cleanup_restores ADD CONSTRAINT cleanup_restores_row_or_partition
  CHECK ((archive_id IS NULL) = (retirement_id IS NOT NULL) AND (archive_id IS NULL OR run_id IS NOT NULL));
