-- reaper migration 20: an archive of what row-delete deleted, and a log of what was restored
-- (docs/design.md invariant 20: restore never overwrites).

-- One row per deleted row of a policy with `archive.enabled`, written by the deleting statement
-- itself (an `archived` CTE beside `audited`), so a row is archived exactly when its deletion
-- committed. `row_data` is to_jsonb() of the whole row as it was; `key` its key's canonical text.
-- Kept `archive.retainDays` by the scheduler, pruned in bounded statements like the audit.
-- restored_at / restore_id: set by `reaper restore` in the transaction that re-inserted the row,
-- so a second restore (or one run again after a kill) never inserts it twice.
CREATE TABLE IF NOT EXISTS cleanup_archive (
  archive_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  policy          text NOT NULL,
  key             text NOT NULL,
  row_data        jsonb NOT NULL,
  run_id          uuid NOT NULL,
  batch_id        text NOT NULL,
  policy_version  text NOT NULL,
  deleted_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
  restored_at     timestamptz,
  restore_id      uuid
);
CREATE INDEX IF NOT EXISTS cleanup_archive_by_run ON cleanup_archive (run_id, archive_id);
CREATE INDEX IF NOT EXISTS cleanup_archive_by_age ON cleanup_archive (policy, deleted_at);

-- The restore log: one row per archived row a `reaper restore` handled, written in the same
-- statement as the re-insert: 'restored', or 'conflict' (its key exists again; left untouched).
-- Not pruned with the archive: it is the record of what operators put back.
CREATE TABLE IF NOT EXISTS cleanup_restores (
  restore_id   uuid NOT NULL,
  archive_id   bigint NOT NULL,
  run_id       uuid NOT NULL,
  policy       text NOT NULL,
  key          text NOT NULL,
  outcome      text NOT NULL CHECK (outcome IN ('restored', 'conflict')),
  operator     text NOT NULL,
  at           timestamptz NOT NULL DEFAULT clock_timestamp(),
  PRIMARY KEY (restore_id, archive_id)
);
CREATE INDEX IF NOT EXISTS cleanup_restores_by_run ON cleanup_restores (run_id);
