-- reaper migration 5: the ledger is the record of remote work (issue 7, items 7, 10 and 17).
--
-- batch_id          the batch that first recorded the operation; its message is kept in
--                   cleanup_remote_batches until its receipt is written, so the ledger can send the
--                   same batch again (same id, run and cutoff) when its operations' turn comes.
-- claim_batch_id    the batch whose delivery made the latest claim: a batch receipt counts only the
--                   confirmations of its own claims.
-- last_delivered_at when a copy of a batch carrying the operation was last delivered or published;
--                   NULL while no copy carries it (recorded by a webhook, parked while it waits its
--                   turn, or its lease reclaimed). The ledger sweeper publishes a batch for
--                   operations that are due and not carried.
ALTER TABLE cleanup_ledger ADD COLUMN IF NOT EXISTS batch_id text;
ALTER TABLE cleanup_ledger ADD COLUMN IF NOT EXISTS claim_batch_id text;
ALTER TABLE cleanup_ledger ADD COLUMN IF NOT EXISTS last_delivered_at timestamptz;
CREATE INDEX IF NOT EXISTS cleanup_ledger_open_by_batch ON cleanup_ledger (batch_id) WHERE state <> 'done';
CREATE INDEX IF NOT EXISTS cleanup_ledger_carried ON cleanup_ledger (policy, last_delivered_at) WHERE state <> 'done';

-- The message of every remote-delete batch with open operations, exactly as published.
CREATE TABLE IF NOT EXISTS cleanup_remote_batches (
  batch_id   text PRIMARY KEY,
  policy     text NOT NULL,
  content    bytea NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);
