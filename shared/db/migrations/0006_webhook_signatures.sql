-- reaper migration 6: webhook signatures already used.
-- A signed webhook is accepted once: its signature is remembered until its timestamp can no longer
-- pass the 5-minute window (plus a margin for clocks that disagree), so a request replayed within
-- the window is refused by every scheduler replica, not only the one that saw it first.
CREATE TABLE IF NOT EXISTS cleanup_webhook_signatures (
  signature  text PRIMARY KEY,          -- the hex HMAC of the accepted request
  policy     text NOT NULL,
  seen_at    timestamptz NOT NULL DEFAULT now(),
  expires_at timestamptz NOT NULL       -- after this its timestamp is refused anyway; the row may go
);
CREATE INDEX IF NOT EXISTS cleanup_webhook_signatures_expiry ON cleanup_webhook_signatures (expires_at);
