-- reaper migration 19: expiry events through a transactional outbox (README "Expiry events").
-- One row per deletion of a policy with `events: { enabled: true }`, written by the deleting
-- statement itself (row-delete) or in the transaction that settles a confirmed remote deletion
-- (remote-delete), so an event exists exactly when its deletion committed. `reaper relay`
-- publishes each row to <prefix>.events and deletes it only after the broker's confirm: a row
-- lives from its deletion until its event is confirmed (at-least-once, message id = policy:key:observed expiry).
CREATE TABLE IF NOT EXISTS cleanup_outbox (
  outbox_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  policy          text NOT NULL,
  key             text NOT NULL,            -- the row's canonical key text (as in the audit)
  observed_expiry timestamptz NOT NULL,
  cutoff          timestamptz,              -- the batch's cutoff (row-delete); NULL for remote-delete
  run_id          uuid,
  batch_id        text,
  policy_version  text NOT NULL,
  deleted_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The relay takes the oldest rows first; the oldest-age gauge and the limit check read one policy's
-- rows in insertion order.
CREATE INDEX IF NOT EXISTS cleanup_outbox_by_policy ON cleanup_outbox (policy, outbox_id);
