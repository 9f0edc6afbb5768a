-- reaper migration 7: guardrails. Legal holds that every deleting statement re-checks, and an
-- audit trail written in the same statement as the deletion it records.

-- A held key is never deleted (row-delete) nor called for (remote-delete) while the hold is
-- active: until `held_until`, or until removed when that is NULL. Keys are stored as text, the
-- form ids travel in (a uuid key is compared as its canonical text).
CREATE TABLE IF NOT EXISTS cleanup_holds (
  policy      text NOT NULL,
  key         text NOT NULL,
  reason      text NOT NULL CHECK (reason <> ''),
  held_until  timestamptz,
  created_by  text NOT NULL,
  created_at  timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (policy, key)
);

-- One row per deletion that committed (row-delete: in the DELETE statement itself; remote-delete:
-- in the transaction that records the confirmed outcome). Kept `retainDays` by the scheduler.
CREATE TABLE IF NOT EXISTS cleanup_audit (
  audit_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  policy          text NOT NULL,
  key             text NOT NULL,
  observed_expiry timestamptz NOT NULL,
  run_id          uuid,
  batch_id        text,
  policy_version  text NOT NULL,
  operation_key   text,            -- remote-delete only
  outcome         text NOT NULL DEFAULT 'deleted',
  deleted_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS cleanup_audit_by_key ON cleanup_audit (policy, key);
CREATE INDEX IF NOT EXISTS cleanup_audit_by_run ON cleanup_audit (run_id);
CREATE INDEX IF NOT EXISTS cleanup_audit_by_age ON cleanup_audit (policy, deleted_at);

-- The hash of the policy definition a run was made under (shown with the run and in the audit).
ALTER TABLE cleanup_runs ADD COLUMN IF NOT EXISTS policy_version text;

-- remote-delete: an operation whose asset is under a legal hold when it is claimed ends 'held'
-- (no call). A later scan or webhook re-opens it once the hold is gone (ledgerRecordCandidates).
ALTER TABLE cleanup_ledger DROP CONSTRAINT IF EXISTS cleanup_ledger_outcome_check;
ALTER TABLE cleanup_ledger ADD CONSTRAINT cleanup_ledger_outcome_check
  CHECK (outcome IN ('confirmed', 'rejected', 'gave-up', 'superseded', 'held'));
