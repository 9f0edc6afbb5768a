import type { Histogram, Registry } from 'prom-client';
import { promClient } from '../lazy-modules';
import type { RemoteDeletePolicy } from '../config/policies';
import { withTransaction, type Pool } from '../db/pool';
import { admissionBlockFor, admissionGrantAndClaim, admissionLock, admissionTakeOne } from '../db/queries/admission';
import type { ResolvedTarget } from '../db/queries/target';
import type { ClaimedOperation } from '../db/queries/ledger';
import { overrideFor, remoteAdmissionWith } from './overrides';

/**
 * Global admission: no token, no call. One short transaction locks the policy's admission row,
 * refills the bucket from the database clock, checks the pause switch, the 429 block and the
 * concurrency in use (live in-flight leases of every worker), re-checks the batch's due operations
 * against their rows and claims at most that many (docs/design.md invariants 9, 10 and 13).
 *
 * Holding the limit AT THE REMOTE. A call reaches the remote a little after its grant was counted.
 * Lateness can only hurt when, meanwhile, the bucket could have filled up to its cap (refill that
 * the cap throws away is what lets two windows' worth of calls meet at the remote). So:
 *  - the bucket refills at the FULL rate, and its capacity is the burst minus what the rate brings
 *    in GRANT_LIFETIME_MS + NETWORK_MARGIN_MS (a call started within that time is seen by the
 *    remote no more "bunched" than the burst allows);
 *  - a call that could not start within GRANT_LIFETIME_MS (a busy machine) is NOT thrown away: if
 *    the bucket could not have reached its cap since the grant (tokens left + this round's grants +
 *    rate × lateness below the capacity), counting the grant now instead of then changes nothing
 *    and the call starts; otherwise (the bucket was rich anyway) it takes a fresh token at once.
 * The steady rate is therefore the configured rate, not a fraction of it.
 */
export const GRANT_LIFETIME_MS = 25;
/**
 * From the lateness check (just before the request is made) to the call's arrival at the remote's
 * limiter: the client's send and the remote's own reading of it, on two event loops. Measured at
 * the stand-in API (bench figure 5, 2026-12-07, 2,000 calls a round, the check's epoch ms sent in
 * a header for the measurement only): p50 1 ms, p90 3-6 ms, p99 7-24 ms, p99.9 18-80 ms, idle and
 * under one and three busy loops on the 2 cores alike. At 5 ms (before) about one call in ten arrived later than the bucket
 * allowed for, and 3 rounds in 31 met a 429 (each blocks the whole policy for its Retry-After, 1 s
 * there: 0.91 of R for the round). 20 covers the p99; the rarer tail meets the remote's spare
 * tokens instead (its bucket stays this much fuller than ours).
 */
const NETWORK_MARGIN_MS = 20;

/** The bucket the database keeps for a policy's (rate, burst) at the remote. */
export function bucketShape(ratePerSecond: number, burst: number): { ratePerSecond: number; capacity: number } {
  const margin = Math.ceil((ratePerSecond * (GRANT_LIFETIME_MS + NETWORK_MARGIN_MS)) / 1000);
  if (burst - margin >= 1) return { ratePerSecond, capacity: burst - margin };
  // A burst too small to absorb the lateness: take it from the rate instead (the old rule).
  return { ratePerSecond: ratePerSecond / (1 + (GRANT_LIFETIME_MS + NETWORK_MARGIN_MS) / 1000), capacity: 1 };
}

/** Shortest wait before an operation that found no token or no free slot asks again. */
export const MIN_ADMISSION_WAIT_MS = 20;

export type AdmissionVerdict = 'admitted' | 'paused' | 'blocked' | 'no-token' | 'concurrency' | 'none-due';

export interface AdmissionGrant {
  claimed: ClaimedOperation[];
  /** Process clock (ms) when the refilled bucket was read. */
  readAt: number;
  /** Tokens left in the bucket right after this grant. */
  tokensAfter: number;
  verdict: AdmissionVerdict;
  /** Due operations whose row no longer holds their decision: finished 'superseded' by the same statement. */
  superseded: number;
  /** Due operations whose asset is under a legal hold: finished 'held' by the same statement, no call. */
  held: number;
  /** When asking again may be admitted (next token, a free slot, the end of a block). */
  waitMs: number;
  /** How long the admission row's lock took to get (contention between workers). */
  lockWaitMs: number;
}

const lockWaitHistograms = new WeakMap<Registry, Histogram<'policy'>>();

/** reaper_admission_lock_wait_seconds{policy}: registered on first use in the process's registry. */
export function admissionLockWaitHistogram(registry: Registry): Histogram<'policy'> {
  let histogram = lockWaitHistograms.get(registry);
  if (!histogram) {
    histogram = new (promClient().Histogram)({
      name: 'reaper_admission_lock_wait_seconds',
      help: 'Time to get the policy admission row lock (remote-delete), per grant',
      labelNames: ['policy'],
      buckets: [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1],
      registers: [registry],
    });
    lockWaitHistograms.set(registry, histogram);
  }
  return histogram;
}

export async function admitAndClaim(
  pool: Pool,
  policy: RemoteDeletePolicy,
  target: ResolvedTarget,
  request: { keys: readonly string[]; owner: string; cutoff: string; batchId: string },
): Promise<AdmissionGrant> {
  // The file's values, or what `reaper admission set` put over them (read at most OVERRIDE_REFRESH_MS ago).
  const admission = remoteAdmissionWith(policy, await overrideFor(pool, policy.name));
  const { concurrency } = admission;
  const bucket = bucketShape(admission.ratePerSecond, admission.burst);
  return withTransaction(pool, async (client) => {
    const asked = performance.now();
    await admissionLock(client, policy.name, bucket.capacity);
    const lockWaitMs = performance.now() - asked;
    const state = await admissionGrantAndClaim(client, target, {
      policy: policy.name,
      ratePerSecond: bucket.ratePerSecond,
      burst: bucket.capacity,
      concurrency,
      keys: request.keys,
      owner: request.owner,
      leaseMs: policy.leaseMs,
      cutoff: request.cutoff,
      batchId: request.batchId,
    });
    // The bucket was read a moment before this answer arrived: the grant's age is undercounted by
    // that one trip back, which NETWORK_MARGIN_MS covers.
    const readAt = performance.now();
    let verdict: AdmissionVerdict = 'admitted';
    let waitMs = MIN_ADMISSION_WAIT_MS;
    if (state.paused) {
      verdict = 'paused';
    } else if (state.blockedForMs > 0) {
      verdict = 'blocked';
      waitMs = state.blockedForMs;
    } else if (state.claimed.length === 0 && (state.wholeTokens === 0 || state.freeSlots <= 0)) {
      verdict = state.wholeTokens === 0 ? 'no-token' : 'concurrency';
      // A token arrives in (1 - fraction) / rate seconds; a slot frees when a call ends.
      if (state.wholeTokens === 0) waitMs = Math.max(MIN_ADMISSION_WAIT_MS, ((1 - (state.tokens - state.wholeTokens)) / bucket.ratePerSecond) * 1000);
    } else if (state.claimed.length === 0) {
      verdict = 'none-due';
    } else {
      // Admitted: the next token is due when the fraction left completes to one.
      const left = state.tokens - state.claimed.length;
      waitMs = left >= 1 ? MIN_ADMISSION_WAIT_MS : Math.max(MIN_ADMISSION_WAIT_MS / 2, ((1 - (left - Math.floor(left))) / bucket.ratePerSecond) * 1000);
    }
    return { claimed: state.claimed, readAt, tokensAfter: state.tokens - state.claimed.length, verdict, superseded: state.superseded, held: state.held, waitMs, lockWaitMs };
  });
}

/**
 * May a call granted at `grant.readAt` still start now? Within GRANT_LIFETIME_MS: yes. Later: yes
 * when the bucket could not have reached its capacity since (then counting the grant now instead
 * of then is the same bucket); otherwise a fresh token is taken at once (false when none is left).
 */
export async function grantStillGood(pool: Pool, policy: RemoteDeletePolicy, grant: AdmissionGrant): Promise<'in-time' | 'late-same-bucket' | 'regranted' | 'no-token'> {
  const lateMs = performance.now() - grant.readAt;
  if (lateMs <= GRANT_LIFETIME_MS) return 'in-time';
  const admission = remoteAdmissionWith(policy, await overrideFor(pool, policy.name));
  const bucket = bucketShape(admission.ratePerSecond, admission.burst);
  const highest = grant.tokensAfter + grant.claimed.length + (bucket.ratePerSecond * (lateMs + NETWORK_MARGIN_MS)) / 1000;
  if (highest <= bucket.capacity) return 'late-same-bucket';
  const taken = await admissionTakeOne(pool, { policy: policy.name, ratePerSecond: bucket.ratePerSecond, burst: bucket.capacity });
  return taken ? 'regranted' : 'no-token';
}

/** A 429 tells every worker to hold off: the whole policy is blocked for the Retry-After. */
export async function blockAdmission(pool: Pool, policy: string, delayMs: number): Promise<void> {
  await admissionBlockFor(pool, policy, delayMs);
}
