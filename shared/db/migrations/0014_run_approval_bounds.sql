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
-- window_candidates: the candidates of the window the current claim is publishing, written when it
--   checks its claim before publishing and cleared by the window's checkpoint.
-- unconfirmed_candidates: windows earlier claims may have published without a checkpoint (a
--   takeover folds window_candidates in here). They count against the allowance: those rows may
--   be deleted even if the next claim's scan publishes other rows instead of them.
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS window_candidates bigint NOT NULL DEFAULT 0;
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS unconfirmed_candidates bigint NOT NULL DEFAULT 0;
