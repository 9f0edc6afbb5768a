-- reaper migration 28: each hold of a run by the brake gets a number (issue 40). `reaper approve
-- --expect <count>@<hold>` approves only that hold: a later hold that happens to have the same
-- count is a new decision, never approved by an answer to an earlier one.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS hold_count integer NOT NULL DEFAULT 0;
