/**
 * The expiry event, version 2 (docs/design.md "Expiry events"): what `reaper relay` publishes to
 * `<prefix>.events` for each deletion of a policy with `events: { enabled: true }`.
 *
 * Versioning, like the batch contract: a field is only ever added in a new version (consumers of
 * version N accept every version up to N, and ignore fields they do not know); a field's meaning
 * never changes within a version. Delivery is at-least-once: consumers dedupe on the message id.
 *
 * Version 2 (issue 40) added `eventId`, which is also the message id: `<policy>:<key>:<observed
 * expiry>:<deletion>`, where the deletion is the outbox row's id. Version 1's id was the operation
 * key alone, the same for a row deleted, restored and deleted again: a consumer deduping on it
 * dropped the second, real deletion. An event stays in its outbox row until its confirm (a row of
 * several events keeps those not yet confirmed, under the same row id), so the id is the same on
 * every retry of one deletion and differs between two deletions.
 */
export const EXPIRY_EVENT_VERSION = 2;

/** Header on every expiry event: the deletion was reaper's expiry, not a user's delete. */
export const EVENT_CAUSE_HEADER = 'x-reaper-cause';
export const EVENT_CAUSE_EXPIRY = 'expiry';

export interface ExpiryEventV2 {
  version: 2;
  /** Unique per deletion, stable across the relay's retries: the message id (expiryEventId). */
  eventId: string;
  policy: string;
  /** The row's key as canonical text (a uuid as its canonical text). */
  key: string;
  /** The expiry the deletion was decided on: UTC ISO 8601, six fractional digits. */
  observedExpiry: string;
  /** The batch's cutoff (row-delete); null for remote-delete (the ledger has no cutoff). */
  cutoff: string | null;
  runId: string | null;
  batchId: string | null;
  /** When the deleting transaction ran (database clock). */
  deletedAt: string;
  /** The hash of the policy definition the deletion ran under (shared/config/policies.ts). */
  policyVersion: string;
}

/**
 * `<policy>:<key>:<observed expiry>:<deletion>`: the retention decision (the remote ledger's
 * operation key) and which deletion of it (the outbox row's id, a decimal integer).
 */
export function expiryEventId(decision: { policy: string; key: string; observedExpiry: string }, deletion: string): string {
  return `${decision.policy}:${decision.key}:${decision.observedExpiry}:${deletion}`;
}

/** The message id of an event: its eventId. */
export function expiryEventMessageId(event: Pick<ExpiryEventV2, 'eventId'>): string {
  return event.eventId;
}

/** The topic routing key: consumers bind `<policy>.expired`, or `#.expired` for every policy. */
export function expiryEventRoutingKey(policy: string): string {
  return `${policy}.expired`;
}

export function encodeExpiryEvent(event: ExpiryEventV2): Buffer {
  return Buffer.from(JSON.stringify(event));
}

/**
 * The partition-retired event, version 1 (issue 44; docs/guardrails.md "Retiring partitions"): one
 * per partition retired by a policy with `events: { enabled: true }`, written in the transaction
 * that moved it into reaper_retired, published by `reaper relay` with routing key
 * `<policy>.partition-retired` (consumers bind it, or `#.partition-retired`). Its rows have no
 * event of their own: the count, the bound and the checksum of (key, expiry) stand for them.
 */
export const PARTITION_RETIRED_EVENT_VERSION = 1;

export interface PartitionRetiredEventV1 {
  version: 1;
  /** `<policy>:partition:<retired table>:<deletion>` (the outbox row's id): the message id. */
  eventId: string;
  policy: string;
  /** Where the retired table is kept during the quarantine: reaper_retired.<name>. */
  partition: string;
  /** The partition's bound as PostgreSQL printed it (FOR VALUES FROM (...) TO (...)). */
  bound: string;
  /** Its upper bound: every row expired before it. UTC ISO 8601, six fractional digits. */
  upperBound: string;
  rowCount: number;
  /** Sum of the first 60 bits of md5(key || ':' || expiry) over its rows, hex (order-independent). */
  keyChecksum: string;
  runId: string | null;
  /** When the retiring transaction ran (database clock). */
  retiredAt: string;
  policyVersion: string;
}

export function partitionRetiredRoutingKey(policy: string): string {
  return `${policy}.partition-retired`;
}
