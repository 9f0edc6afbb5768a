-- reaper migration 4: runs that end without completing say so, with their numbers.

-- Rows the scan read but could not publish (a key longer than a message may carry). The cursor
-- moves past them like any other row, so a window made only of such rows is never read again.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS skipped bigint NOT NULL DEFAULT 0;

-- A run that can never complete (a batch dead-lettered, a delay copy lost) ends 'incomplete' after
-- a time without any receipt (REAPER_RUN_INCOMPLETE_AFTER_SECONDS); its reason and counts are in
-- `error`. A run that hit a permanent error (table dropped, permission revoked, queue deleted)
-- ends 'failed' with its reason in `error`.
ALTER TABLE cleanup_runs DROP CONSTRAINT IF EXISTS cleanup_runs_state_check;
ALTER TABLE cleanup_runs ADD CONSTRAINT cleanup_runs_state_check
  CHECK (state IN ('pending', 'scanning', 'published', 'completed', 'failed', 'incomplete'));

-- The completion pass takes a bounded number of published runs per pass, least recently checked
-- first (round robin), instead of every published run every 250 ms.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS completion_checked_at timestamptz;
CREATE INDEX IF NOT EXISTS cleanup_runs_published_by_check
  ON cleanup_runs (completion_checked_at NULLS FIRST, run_id) WHERE state = 'published';
DROP INDEX IF EXISTS cleanup_runs_published;
