-- reaper migration 1: run bookkeeping and batch receipts.

-- Every timestamp that crosses a process boundary is written with microseconds: a JS Date keeps
-- only milliseconds, and a DELETE that compares against a truncated expiry would be a false no-op.
CREATE OR REPLACE FUNCTION reaper_iso(ts timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') $$;

-- (The demo's own table seat_reservations used to be created here. It belongs to the demo, not to
-- reaper: `reaper migrate --with-demo-tables` and the demo create it; shared/db/queries/demo-tables.ts.)

-- One row per run. (policy, scheduled_for) is unique: however many scheduler replicas see a tick,
-- one run exists for it. The cutoff is frozen here, from the database clock, when the run is made.
CREATE TABLE IF NOT EXISTS cleanup_runs (
  run_id            uuid PRIMARY KEY,
  policy            text NOT NULL,
  trigger           text NOT NULL CHECK (trigger IN ('cron', 'catch-up', 'replay', 'manual')),
  scheduled_for     timestamptz NOT NULL,
  cutoff            timestamptz NOT NULL,
  state             text NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'scanning', 'published', 'completed', 'failed')),
  replay_of         uuid REFERENCES cleanup_runs (run_id),
  -- The scheduler executing the run holds a lease; a replica takes an unfinished run over once the
  -- lease has expired and continues from the cursor with the same cutoff.
  owner             text,
  lease_expires_at  timestamptz,
  cursor_expiry     timestamptz,
  cursor_key        text,
  candidates        bigint NOT NULL DEFAULT 0,
  batches_confirmed integer NOT NULL DEFAULT 0,
  error             text,
  created_at        timestamptz NOT NULL DEFAULT now(),
  started_at        timestamptz,
  published_at      timestamptz,
  finished_at       timestamptz,
  UNIQUE (policy, scheduled_for)
);
CREATE INDEX IF NOT EXISTS cleanup_runs_unfinished ON cleanup_runs (created_at) WHERE state IN ('pending', 'scanning');

-- A receipt per batch the workers committed, written in the same transaction as the deletions.
-- A redelivered batch finds its receipt and is a counted no-op; run totals are sums of receipts.
CREATE TABLE IF NOT EXISTS cleanup_batches (
  batch_id     text PRIMARY KEY,
  run_id       uuid NOT NULL,
  policy       text NOT NULL,
  items        integer NOT NULL,
  deleted      integer NOT NULL,
  noop         integer NOT NULL,
  worker_id    text NOT NULL,
  completed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS cleanup_batches_by_run ON cleanup_batches (run_id);
