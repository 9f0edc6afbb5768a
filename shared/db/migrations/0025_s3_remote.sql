-- reaper migration 25: object storage (S3) as a remote (README "Object storage (S3)").

-- A DeleteObjects request carries many operations: the operations claimed together share a
-- request id, so the concurrency cap counts requests in flight, not keys, and a retry after a
-- crash can be traced to the request that left the outcome unknown.
ALTER TABLE cleanup_ledger ADD COLUMN IF NOT EXISTS claim_request_id text;

-- Admission counts requests AND keys: the keys bucket is the row's `tokens` (as for every
-- remote-delete policy); the requests bucket is kept beside it. NULL until an s3 policy uses it.
ALTER TABLE cleanup_admission ADD COLUMN IF NOT EXISTS request_tokens double precision;
ALTER TABLE cleanup_admission ADD COLUMN IF NOT EXISTS request_refilled_at timestamptz;

-- One audit row per deleted object AND version: `versions: all` deletes every version of a key,
-- each recorded with its version id (NULL: the current version, or an unversioned bucket).
ALTER TABLE cleanup_audit ADD COLUMN IF NOT EXISTS version_id text;
