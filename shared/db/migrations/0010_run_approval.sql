-- reaper migration 10: the blast-radius brake. A run whose scan would exceed its policy's limits
-- publishes nothing and waits in 'awaiting-approval' (its count in `candidates`, the reason in
-- `error`); `reaper approve` sends it on with the same cutoff, `reaper reject` ends it 'rejected'.
ALTER TABLE cleanup_runs DROP CONSTRAINT IF EXISTS cleanup_runs_state_check;
ALTER TABLE cleanup_runs ADD CONSTRAINT cleanup_runs_state_check
  CHECK (state IN ('pending', 'scanning', 'published', 'completed', 'failed', 'incomplete', 'awaiting-approval', 'rejected'));
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS approved_at timestamptz;
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS decided_by text;
