import { randomUUID } from 'node:crypto';
import { s3RequestKeys, type S3DeletePolicy } from '../config/policies';
import { withTransaction, type Pool } from '../db/pool';
import { admissionLock } from '../db/queries/admission';
import type { ResolvedTarget } from '../db/queries/target';
import { admissionChargeKeys, s3AdmissionGrantAndClaim } from '../db/queries/ledger-s3';
import type { ClaimedOperation } from '../db/queries/ledger';
import { MIN_ADMISSION_WAIT_MS, type AdmissionVerdict } from './controller';
import { overrideFor, remoteAdmissionWith } from './overrides';

/**
 * Global admission of object storage policies: one claim is one DeleteObjects request. It takes
 * one request token (requestsPerSecond), one token per key (keysPerSecond) and one of
 * `concurrency` request slots, across every worker together, in the same short transaction on the
 * policy's admission row as remote-delete (pause switch, SlowDown block, re-check of every key).
 *
 * Shapes. Keys: the bucket holds one request's keys (s3RequestKeys), so whole requests leave at
 * keysPerSecond and a second never carries more than keysPerSecond plus one request. Requests: the
 * bucket holds a tenth of a second's requests (at least one).
 *
 * Sending on the bucket's clock. What the store counts is when requests arrive, not when they were
 * granted, and between the two the worker reads the answer, the SDK serializes, checksums and signs
 * 1,000 keys (tens of ms, more on a busy machine or a process's first request). So a request is
 * granted up to S3_SEND_LEAD_MS of keys ahead and at least S3_SEND_MIN_LEAD_MS before it may leave
 * (the bucket lends the keys: it goes below zero; from a full bucket the minimum's keys are dropped), and the worker holds the prepared request until the moment
 * the refill has paid for its keys (`sendAt`, ObjectStorageClient.deleteKeys `onSend`): requests
 * then leave exactly one request's keys apart at the paced rate, whatever the preparation took.
 * One that still leaves late charges its lateness (chargeLateSend), so the next one moves back as
 * far when the charge lands first (it is written while the request travels).
 */
export interface S3Grant {
  claimed: ClaimedOperation[];
  /** Shared by the claimed operations (cleanup_ledger.claim_request_id). */
  requestId: string;
  verdict: AdmissionVerdict;
  /** When asking again may be admitted (the keys or the request token, the end of a block). */
  waitMs: number;
  superseded: number;
  held: number;
  /** Process clock (ms, performance.now) when the refill has paid for this request's keys: send it then, not before; one sent later than S3_LATE_GRACE_MS after it charges its lateness. */
  sendAt: number;
  /** The keys bucket's rate in force (paced), keys per second. */
  keysPerSecond: number;
}

/**
 * A request sent this long after its `sendAt` is late: the keys bucket is charged the keys the rate
 * brought meanwhile, so the next grant moves back as far. Requests then leave at least one
 * request's worth of keys apart as sent, not only as granted (a worker slowed by a busy machine
 * would otherwise send two requests close together).
 */
export const S3_LATE_GRACE_MS = 5;

/**
 * How far ahead of its keys a request may be granted, and how soon after its grant it may leave at
 * the earliest (see "Sending on the bucket's clock"): the minimum is longer than the grant's
 * statement and the SDK's preparation of 1,000 keys take on a busy machine; the difference absorbs
 * a worker asking a little after the keys allowed it (its poll), without moving the send.
 */
export const S3_SEND_LEAD_MS = 300;
export const S3_SEND_MIN_LEAD_MS = 200;

/**
 * Keys are paced at this fraction of keysPerSecond: whole requests then leave a little more than a
 * second's worth of keys apart, so a few milliseconds of network jitter never puts more than
 * keysPerSecond keys into one second at the store (bench: "most keys in any second ÷ limit").
 */
export const S3_KEY_PACE = 0.98;

/** The numbers in force: the file's, or what `reaper admission set` put over them (rate = keys/s). */
export async function s3AdmissionInForce(pool: Pool, policy: S3DeletePolicy): Promise<{ keysPerSecond: number; requestsPerSecond: number; requestKeys: number; requestCapacity: number; concurrency: number }> {
  const inForce = remoteAdmissionWith(policy, await overrideFor(pool, policy.name));
  const keysPerSecond = inForce.ratePerSecond;
  const requestsPerSecond = Math.min(policy.admission.requestsPerSecond, keysPerSecond);
  return {
    keysPerSecond: keysPerSecond * S3_KEY_PACE,
    requestsPerSecond,
    requestKeys: s3RequestKeys(keysPerSecond, policy.remote.maxKeysPerRequest),
    requestCapacity: Math.max(1, Math.floor(requestsPerSecond / 10)),
    concurrency: inForce.concurrency,
  };
}

export async function admitAndClaimS3(
  pool: Pool,
  policy: S3DeletePolicy,
  target: ResolvedTarget,
  request: { keys: readonly string[]; owner: string; cutoff: string; batchId: string },
): Promise<S3Grant> {
  const shape = await s3AdmissionInForce(pool, policy);
  const requestId = randomUUID();
  const leadKeys = (shape.keysPerSecond * S3_SEND_LEAD_MS) / 1000;
  const { state, readAt } = await withTransaction(pool, async (client) => {
    await admissionLock(client, policy.name, shape.requestKeys);
    const outcome = await s3AdmissionGrantAndClaim(client, target, {
      policy: policy.name,
      requestKeys: shape.requestKeys,
      keysPerSecond: shape.keysPerSecond,
      concurrency: shape.concurrency,
      keys: request.keys,
      owner: request.owner,
      leaseMs: policy.leaseMs,
      cutoff: request.cutoff,
      batchId: request.batchId,
      requestCapacity: shape.requestCapacity,
      requestsPerSecond: shape.requestsPerSecond,
      requestId,
      leadKeys,
      minLeadKeys: (shape.keysPerSecond * S3_SEND_MIN_LEAD_MS) / 1000,
    });
    // Read before the commit: the answer's bucketAgeMs ties this clock to the bucket's instant.
    return { state: outcome, readAt: performance.now() };
  });
  let verdict: AdmissionVerdict;
  let waitMs = MIN_ADMISSION_WAIT_MS;
  if (state.paused) verdict = 'paused';
  else if (state.blockedForMs > 0) {
    verdict = 'blocked';
    waitMs = state.blockedForMs;
  } else if (state.claimed.length > 0) verdict = 'admitted';
  else if (state.eligible === 0) verdict = 'none-due';
  else if (state.freeRequests < 1) verdict = 'concurrency';
  else {
    verdict = 'no-token';
    // The later of: the keys this request wants, and one request token.
    const keysMs = ((state.wanted - leadKeys - state.keyTokens) / shape.keysPerSecond) * 1000;
    const requestMs = ((1 - state.requestTokens) / shape.requestsPerSecond) * 1000;
    waitMs = Math.max(MIN_ADMISSION_WAIT_MS, keysMs, requestMs);
  }
  // Keys lent ahead (the bucket below zero after this claim) are paid by the refill at keysPerSecond,
  // counted from the bucket's instant (the statement's start), not from when its answer came back
  // (a slow statement would otherwise send early). In the past when nothing was lent: late already.
  const paidAfterMs = (Math.max(0, -state.keyTokens) / shape.keysPerSecond) * 1000 - state.bucketAgeMs;
  return { claimed: state.claimed, requestId, verdict, waitMs, superseded: state.superseded, held: state.held, sendAt: readAt + paidAfterMs, keysPerSecond: shape.keysPerSecond };
}

/**
 * This process's last request of each policy: when it leaves (reserved before it waits) and its
 * keys. A process's next request leaves no sooner than those keys allow, by this process's clock:
 * a late send's charge to the bucket can wait behind this process's own grants (its pool is busy
 * with them), so the bucket alone would let the next request of the same process follow too close.
 */
const lastLeaving = new Map<string, { at: number; keys: number }>();

/** Resolves when the grant's request may leave: at its `sendAt`, and not before this process's previous request's keys allow. */
export function untilSendAt(policy: string, grant: S3Grant): Promise<void> {
  const previous = lastLeaving.get(policy);
  const floor = previous ? previous.at + (previous.keys / grant.keysPerSecond) * 1000 : -Infinity;
  const leaveAt = Math.max(grant.sendAt, floor, performance.now());
  lastLeaving.set(policy, { at: leaveAt, keys: grant.claimed.length });
  return untilClock(leaveAt);
}

/** Resolves once performance.now() has reached `at` (a timer can fire a fraction of a millisecond early: it waits again). */
async function untilClock(at: number): Promise<void> {
  for (let waitMs = at - performance.now(); waitMs > 0; waitMs = at - performance.now()) {
    await new Promise((resolve) => setTimeout(resolve, Math.ceil(waitMs)));
  }
}

/** As a granted request leaves (ObjectStorageClient.deleteKeys `onSend`: after the SDK signed it): a late one charges its lateness to the keys bucket (see S3_LATE_GRACE_MS). Returns the lateness in ms. */
export async function chargeLateSend(pool: Pool, policy: S3DeletePolicy, grant: S3Grant): Promise<number> {
  const lateMs = performance.now() - grant.sendAt;
  if (lateMs > S3_LATE_GRACE_MS) await admissionChargeKeys(pool, policy.name, (grant.keysPerSecond * lateMs) / 1000);
  return lateMs;
}
