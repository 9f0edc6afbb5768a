/**
 * The expiry event, version 1 (docs/design.md "Expiry events"): what `reaper relay` publishes to
 * `<prefix>.events` for each deletion of a policy with `events: { enabled: true }`.
 *
 * Versioning, like the batch contract: a field is only ever added in a new version (consumers of
 * version N accept every version up to N, and ignore fields they do not know); a field's meaning
 * never changes within a version. Delivery is at-least-once: consumers dedupe on the message id,
 * which is the operation's stable key and so the same on every redelivery of one deletion.
 */
export const EXPIRY_EVENT_VERSION = 1;

/** Header on every expiry event: the deletion was reaper's expiry, not a user's delete. */
export const EVENT_CAUSE_HEADER = 'x-reaper-cause';
export const EVENT_CAUSE_EXPIRY = 'expiry';

export interface ExpiryEventV1 {
  version: 1;
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

/** `<policy>:<key>:<observed expiry>`: the operation's stable key (remote-delete's ledger key too). */
export function expiryEventMessageId(event: Pick<ExpiryEventV1, 'policy' | 'key' | 'observedExpiry'>): string {
  return `${event.policy}:${event.key}:${event.observedExpiry}`;
}

/** The topic routing key: consumers bind `<policy>.expired`, or `#.expired` for every policy. */
export function expiryEventRoutingKey(policy: string): string {
  return `${policy}.expired`;
}

export function encodeExpiryEvent(event: ExpiryEventV1): Buffer {
  return Buffer.from(JSON.stringify(event));
}
