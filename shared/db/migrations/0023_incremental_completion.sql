-- reaper migration 23 (issue 18): the completion pass is incremental, so its work per pass does not
-- grow with the number of batches a run published.
--
-- completion_cursor: the largest batch id (in batch id order) up to which every confirmed batch of
-- the run has a receipt. A pass walks the run's batches from there, at most a bounded number, and
-- moves the cursor over the settled prefix; the run completes when a walk finds nothing left. The
-- set of a run's batches is fixed once it is published (checkpoints need the scanning claim), and
-- receipts are never removed while a run is open, so a batch behind the cursor stays settled.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS completion_cursor text;

-- The walk: a run's batches in batch id order (this index also serves everything the (run_id)
-- index served, so that one goes).
CREATE INDEX IF NOT EXISTS cleanup_run_batches_by_run_batch ON cleanup_run_batches (run_id, batch_id);
DROP INDEX IF EXISTS cleanup_run_batches_by_run;

-- "Nothing completed since": the latest receipt of a run is one index probe instead of a walk over
-- all its receipts (and it still serves every lookup by run_id, so the (run_id) index goes: each
-- receipt still maintains two indexes, as before).
CREATE INDEX IF NOT EXISTS cleanup_batches_by_run_completed ON cleanup_batches (run_id, completed_at);
DROP INDEX IF EXISTS cleanup_batches_by_run;
