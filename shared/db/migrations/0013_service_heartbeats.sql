-- reaper migration 13: services say they are alive, and what they accept.
-- Schedulers write a row every few seconds: `reaper trigger` / `reaper replay` without --execute
-- say when no scheduler has been seen recently (the run would wait for one). Workers write one
-- too, with the newest batch version they accept: a scheduler told to publish a newer version
-- holds at the older one while a worker that does not accept it is connected. One row per
-- process start (instance_id); a clean stop deletes it, a crash leaves it to go stale.
CREATE TABLE IF NOT EXISTS service_heartbeats (
  instance_id         uuid PRIMARY KEY,
  service             text NOT NULL CHECK (service IN ('scheduler', 'worker')),
  worker_id           text NOT NULL,
  amqp_prefix         text NOT NULL,
  policies            text[] NOT NULL,
  max_batch_version   integer,
  started_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
  seen_at             timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS service_heartbeats_seen ON service_heartbeats (service, seen_at);
