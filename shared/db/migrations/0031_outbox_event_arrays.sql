-- reaper migration 31: one outbox row per deleting statement and batch, carrying the events of all
-- the rows it deleted (issue 41 item 5). One row per deleted row (migration 0019) cost the deletion a
-- heap tuple, a primary-key entry and a (policy, outbox_id) entry per row: WAL per deleted row went
-- from 252 B (events off) to 642 B, and row-delete ran at 0.62-0.70 of its speed without events
-- (bench figure 8), 0.63 even with no relay running. Now row-delete writes one row per batch of its
-- statement (keys and observed_expiries in the same order, event_count their length), and S3
-- remote-delete one per (run, batch) of a settled request. `reaper relay` expands a row into one
-- message per event, with the same body and message id as before (policy:key:observed
-- expiry:outbox_id: a statement deletes a key once, so a key is in a row at most once), and deletes
-- the row only when ALL its events were confirmed (a partly confirmed row is published again whole).
--
-- Two layouts, told apart by `keys`:
--   keys IS NULL      one event in key / observed_expiry (rows written before this migration, a
--                     single HTTP remote-delete settle, a retired partition): as before.
--   keys IS NOT NULL  event_count events in keys / observed_expiries; key and observed_expiry NULL
--                     (no key of the row stands for the others). Only row events (kind 'expired').
-- A relay of this release reads both. A relay of an earlier release would read a row of the second
-- as one event with no key, publish that and delete the row: the lease column is renamed below so
-- that such a relay's claim statement fails instead (it logs "relay pass failed" and publishes
-- nothing; the rows wait for a relay of this release). Workers and schedulers of an earlier release
-- never touch the lease column: they go on during a rolling upgrade, in any order.
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS keys text[];
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS observed_expiries timestamptz[];
-- What the relay's per-pass limit, the worker's events.maxOutbox check and `reaper status` add up.
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS event_count integer NOT NULL DEFAULT 1;
ALTER TABLE cleanup_outbox ALTER COLUMN key DROP NOT NULL;
ALTER TABLE cleanup_outbox ALTER COLUMN observed_expiry DROP NOT NULL;
-- Exactly one layout per row, the arrays as long as the count the limits sum and without NULLs: a
-- row that broke this would publish other events than it counts (or events with no key or expiry).
-- NOT VALID: the rows written before this migration meet it by construction (key and expiry were
-- NOT NULL), and validating would read a possibly large outbox (a broker outage's backlog) under
-- the ACCESS EXCLUSIVE lock, holding every deleting statement back; every new or changed row is
-- checked. Added once (a re-run finds it).
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'cleanup_outbox'::regclass AND conname = 'cleanup_outbox_one_layout') THEN
    ALTER TABLE cleanup_outbox ADD CONSTRAINT cleanup_outbox_one_layout CHECK (
      CASE WHEN keys IS NULL
        THEN key IS NOT NULL AND observed_expiry IS NOT NULL AND observed_expiries IS NULL AND event_count = 1
        ELSE key IS NULL AND observed_expiry IS NULL AND kind = 'expired' AND event_count >= 1 AND observed_expiries IS NOT NULL
          AND cardinality(keys) = event_count AND cardinality(observed_expiries) = event_count
          AND array_position(keys, NULL) IS NULL AND array_position(observed_expiries, NULL) IS NULL
      END
    ) NOT VALID;
  END IF;
END $$;
-- The lease (migration 0026) under a new name: see above. Renamed once (a re-run finds it done);
-- the table as the statement resolves it (search_path), not as current_schema() names it.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'cleanup_outbox'::regclass AND attname = 'claimed_until' AND NOT attisdropped) THEN
    ALTER TABLE cleanup_outbox RENAME COLUMN claimed_until TO claim_expires_at;
  END IF;
END $$;
