-- reaper migration 8: indexes for the backlog gauges (services/scheduler/backlog-gauges.ts), which
-- every scheduler replica reads every few seconds. Each keeps its read to the small part of a table.

-- reaper_ledger_operations{state="done"}: finished operations by outcome, counted from the index alone.
CREATE INDEX IF NOT EXISTS cleanup_ledger_done_by_outcome ON cleanup_ledger (policy, outcome) WHERE state = 'done';

-- reaper_runs{policy,state}: every state but 'completed' (failed runs are few; the rest are live).
CREATE INDEX IF NOT EXISTS cleanup_runs_not_completed ON cleanup_runs (policy, state) WHERE state <> 'completed';

-- reaper_last_completed_run_timestamp_seconds and `reaper status`: the latest completed run per policy.
CREATE INDEX IF NOT EXISTS cleanup_runs_completed_by_finish ON cleanup_runs (policy, finished_at DESC) WHERE state = 'completed';
