-- reaper migration 14: an approval covers what was counted, and no more (docs/design.md invariant 16).
-- counted_candidates: the brake's latest count for the run (published so far + still to publish,
--   counted up to a bound; README "Guardrails"), what `reaper approve` is asked about.
-- approved_candidates / approved_policy_version: what the operator approved. The run publishes at
--   most approved_candidates plus the tolerance, under that policy version; past it, or under
--   another version, it goes back to 'awaiting-approval' with a new count (a second decision).
-- `candidates` stays what the run published (its checkpoints' total), never the brake's count.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS counted_candidates bigint;
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS approved_candidates bigint;
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS approved_policy_version text;
