-- reaper migration 12: live admission control and the row-delete throttle.
-- cleanup_admission_overrides: values set by `reaper admission set` (NULL = the file's value),
-- read by every worker at most a second later; `reaper admission reset` deletes the row. Who set
-- it and when are kept with it. For remote-delete `rate` is calls/s; for row-delete it is rows/s.
CREATE TABLE IF NOT EXISTS cleanup_admission_overrides (
  policy      text PRIMARY KEY,
  rate        double precision CHECK (rate > 0),
  burst       integer CHECK (burst >= 1),
  concurrency integer CHECK (concurrency >= 1),
  set_by      text NOT NULL,
  set_at      timestamptz NOT NULL DEFAULT now()
);
