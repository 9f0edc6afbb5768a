-- reaper migration 21: adaptive row-delete admission (issue 18; docs/design.md "Adaptive row-delete
-- admission"). The adaptive rate lives in the policy's existing admission row, so every worker
-- admits at the same rate and moves the same rate: the token bucket refills at
-- least(adaptive_rate, rowsPerSecond when set).
--   adaptive_rate      rows/s now (NULL until the policy's first adaptive admission: the start rate)
--   adapted_at         when a worker last stepped the rate (a step claims it by this value: at most
--                      one step per observed state, whatever the number of workers)
--   adaptive_admitted  rows admitted since adapted_at (the demand a raise may not run far ahead of)
--   adaptive_pressure  the signal the last step reacted to (1: quiet-time latency); for status and metrics
ALTER TABLE cleanup_admission
  ADD COLUMN IF NOT EXISTS adaptive_rate double precision CHECK (adaptive_rate > 0),
  ADD COLUMN IF NOT EXISTS adapted_at timestamptz,
  ADD COLUMN IF NOT EXISTS adaptive_admitted double precision NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS adaptive_pressure double precision;
