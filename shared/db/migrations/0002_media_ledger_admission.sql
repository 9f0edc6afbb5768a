-- reaper migration 2: remote-delete. The operation ledger and global admission.

-- (The demo's table media_assets used to be created here: see migration 1.)

-- One row per destructive operation; the authority for every remote call.
-- operation_key = '<policy>:<id>:<observed expiry>': an asset restored and expired again is a new
-- retention decision and gets a new key. State machine: pending -> in_flight -> done, and
-- in_flight -> pending (rescheduled, or lease expired). The outcome and retry timing are columns.
CREATE TABLE IF NOT EXISTS cleanup_ledger (
  operation_key    text PRIMARY KEY,
  policy           text NOT NULL,
  asset_id         text NOT NULL,
  observed_expiry  timestamptz NOT NULL,
  run_id           uuid,
  source           text NOT NULL DEFAULT 'scan' CHECK (source IN ('scan', 'webhook')),
  state            text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'in_flight', 'done')),
  outcome          text CHECK (outcome IN ('confirmed', 'rejected', 'gave-up', 'superseded')),
  last_result      text,                          -- classification of the latest call
  last_error       text,
  attempt_count    integer NOT NULL DEFAULT 0,    -- remote calls started (cleanup attempts)
  delivery_count   integer NOT NULL DEFAULT 0,    -- broker deliveries that carried it (transport)
  not_before       timestamptz NOT NULL DEFAULT now(),
  lease_owner      text,
  lease_expires_at timestamptz,
  payload          jsonb,                         -- bulky snapshot of the row; cleared once confirmed
  created_at       timestamptz NOT NULL DEFAULT now(),
  updated_at       timestamptz NOT NULL DEFAULT now(),
  completed_at     timestamptz,
  CHECK ((state = 'done') = (outcome IS NOT NULL)),
  CHECK (state <> 'in_flight' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS cleanup_ledger_pending_due ON cleanup_ledger (policy, not_before) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS cleanup_ledger_in_flight ON cleanup_ledger (policy, lease_expires_at) WHERE state = 'in_flight';
CREATE INDEX IF NOT EXISTS cleanup_ledger_by_asset ON cleanup_ledger (policy, asset_id);

-- Global admission per policy, shared by every worker process: a token bucket (tokens refill at
-- the policy's rate up to its burst), a pause switch, and a block set by the remote's 429s.
CREATE TABLE IF NOT EXISTS cleanup_admission (
  policy        text PRIMARY KEY,
  tokens        double precision NOT NULL,
  refilled_at   timestamptz NOT NULL,
  paused        boolean NOT NULL DEFAULT false,
  paused_at     timestamptz,
  blocked_until timestamptz,
  updated_at    timestamptz NOT NULL DEFAULT now()
);
