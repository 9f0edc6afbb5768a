import { randomUUID } from 'node:crypto';
import { s3RequestKeys, type S3DeletePolicy } from '../config/policies';
import { withTransaction, type Pool } from '../db/pool';
import { admissionLock } from '../db/queries/admission';
import type { ResolvedTarget } from '../db/queries/expiring-rows';
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
  /** Process clock (ms) when the grant's answer arrived: a request sent later than S3_LATE_GRACE_MS after it charges its lateness. */
  readAt: number;
  /** The keys bucket's rate in force (paced), keys per second. */
  keysPerSecond: number;
}

/**
 * A request sent this long after its grant is late: the keys bucket is charged the keys the rate
 * brought meanwhile, so the next grant moves back as far. Requests then leave at least one
 * request's worth of keys apart as sent, not only as granted (a worker slowed by a busy machine,
 * or the SDK's first request in a process, would otherwise send two requests close together).
 */
export const S3_LATE_GRACE_MS = 10;

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
  const state = await withTransaction(pool, async (client) => {
    await admissionLock(client, policy.name, shape.requestKeys);
    return s3AdmissionGrantAndClaim(client, target, {
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
    });
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
    const keysMs = ((state.wanted - state.keyTokens) / shape.keysPerSecond) * 1000;
    const requestMs = ((1 - state.requestTokens) / shape.requestsPerSecond) * 1000;
    waitMs = Math.max(MIN_ADMISSION_WAIT_MS, keysMs, requestMs);
  }
  return { claimed: state.claimed, requestId, verdict, waitMs, superseded: state.superseded, held: state.held, readAt: performance.now(), keysPerSecond: shape.keysPerSecond };
}

/** Just before a granted request is sent: a late one charges its lateness to the keys bucket (see S3_LATE_GRACE_MS). Returns the lateness in ms. */
export async function chargeLateSend(pool: Pool, policy: S3DeletePolicy, grant: S3Grant): Promise<number> {
  const lateMs = performance.now() - grant.readAt;
  if (lateMs > S3_LATE_GRACE_MS) await admissionChargeKeys(pool, policy.name, (grant.keysPerSecond * lateMs) / 1000);
  return lateMs;
}
