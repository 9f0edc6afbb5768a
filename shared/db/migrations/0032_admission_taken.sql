-- reaper migration 32: what a policy's last admission take saw (issue 41; docs/design.md "The scheduler
-- follows the rate"). An adaptive run's first window is small, and the scheduler waits for its
-- workers' first take to decide how to go on; it needs to know that a take happened and whether that
-- take saw other clients on the database.
--   taken_at           when a worker last took (admissionRowsTake only: neither the row's creation nor a
--                      pause or resume writes it, where updated_at changed for those too)
--   taken_saw_others   adaptive takes only: whether the take's own sample of pg_stat_activity saw
--                      another client (in a statement or a transaction, or one that ended within the
--                      last second); NULL for a take of a policy that is not adaptive
ALTER TABLE cleanup_admission
  ADD COLUMN IF NOT EXISTS taken_at timestamptz,
  ADD COLUMN IF NOT EXISTS taken_saw_others boolean;
