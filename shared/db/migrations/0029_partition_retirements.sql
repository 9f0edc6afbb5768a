-- reaper migration 29: retiring whole partitions (issue 44; docs/design.md "Retiring a partition").
-- A retired partition is detached from its policy's table and kept in schema reaper_retired for the
-- policy's partitions.quarantineDays, then dropped by the scheduler. cleanup_partitions records
-- each retirement as a state machine, one step at a time, each step conditional on the state it
-- expects (a crash or a second scheduler neither drops a partition twice nor loses one):
--
--   detaching ──(detached, re-checked, moved into reaper_retired, audited)──> quarantined
--      │                                                                        │     │
--      └──(a re-check failed: attached again / never detached)──> kept          │     └─(restore --partition)─> restored
--                                                                               └─(quarantine over, scheduler)─> dropped
-- Created here only when absent: CREATE SCHEMA (even IF NOT EXISTS) needs CREATE on the database,
-- which the printed migrator role does not have; `reaper roles --print` creates the schema for it
-- (owned by the migrator), so a first install in the documented order (roles, then migrate) works.
DO $$
BEGIN
  IF to_regnamespace('reaper_retired') IS NULL THEN
    CREATE SCHEMA reaper_retired;
  END IF;
EXCEPTION WHEN insufficient_privilege THEN
  RAISE EXCEPTION 'schema reaper_retired does not exist and role % cannot create it: apply the SQL of `reaper roles --print` first (it creates the schema), or create it owned by this role', current_user;
END $$;

CREATE TABLE IF NOT EXISTS cleanup_partitions (
  retirement_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  policy           text NOT NULL,
  run_id           uuid,
  parent_table     text NOT NULL,            -- the policy's table, as quoted in SQL
  source_schema    text NOT NULL,            -- where the partition was attached
  source_name      text NOT NULL,
  retired_name     text NOT NULL,            -- its name in reaper_retired
  bound            text NOT NULL,            -- FOR VALUES FROM (...) TO (...), as PostgreSQL printed it
  lower_bound      timestamptz,              -- NULL: MINVALUE
  upper_bound      timestamptz NOT NULL,
  concurrent       boolean NOT NULL,         -- DETACH ... CONCURRENTLY (else a plain DETACH under lock_timeout)
  state            text NOT NULL CHECK (state IN ('detaching', 'quarantined', 'kept', 'dropped', 'restored')),
  row_count        bigint,
  key_checksum     text,
  reason           text,                     -- why 'kept'
  quarantine_until timestamptz,
  created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
  updated_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- One open retirement per partition, and one table per name in reaper_retired while it is there.
CREATE UNIQUE INDEX IF NOT EXISTS cleanup_partitions_open_source ON cleanup_partitions (source_schema, source_name) WHERE state = 'detaching';
CREATE UNIQUE INDEX IF NOT EXISTS cleanup_partitions_retired_name ON cleanup_partitions (retired_name) WHERE state IN ('detaching', 'quarantined');
CREATE INDEX IF NOT EXISTS cleanup_partitions_by_policy ON cleanup_partitions (policy, state);

-- The audit row of a retired partition: one per partition (key 'partition:reaper_retired.<name>',
-- observed_expiry its upper bound, outcome 'partition-retired'), with its row count, bound and checksum.
ALTER TABLE cleanup_audit ADD COLUMN IF NOT EXISTS row_count bigint;
ALTER TABLE cleanup_audit ADD COLUMN IF NOT EXISTS partition_bound text;
ALTER TABLE cleanup_audit ADD COLUMN IF NOT EXISTS key_checksum text;

-- With events on: one outbox row per retired partition (kind 'partition-retired', published with
-- routing key <policy>.partition-retired), its count, bound and checksum; row events keep kind 'expired'.
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS kind text NOT NULL DEFAULT 'expired' CHECK (kind IN ('expired', 'partition-retired'));
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS row_count bigint;
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS partition_bound text;
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS key_checksum text;
