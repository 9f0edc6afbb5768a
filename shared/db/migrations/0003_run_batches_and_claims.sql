-- reaper migration 3: exact run completion, whatever crashed.
-- The ids of the batches a run checkpointed as confirmed by the broker. A run is complete when
-- every one of them has a receipt; receipts of batches a dead scheduler published after its last
-- checkpoint still count in the totals (they deleted rows) but are not waited for.
CREATE TABLE IF NOT EXISTS cleanup_run_batches (
  batch_id text PRIMARY KEY,
  run_id   uuid NOT NULL REFERENCES cleanup_runs (run_id)
);
CREATE INDEX IF NOT EXISTS cleanup_run_batches_by_run ON cleanup_run_batches (run_id);

-- How many times the run was claimed; part of batch ids after a takeover.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS claim_count integer NOT NULL DEFAULT 0;

-- Published runs are checked for completion several times a second.
CREATE INDEX IF NOT EXISTS cleanup_runs_published ON cleanup_runs (run_id) WHERE state = 'published';
