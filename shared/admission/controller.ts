import type { RemoteDeletePolicy } from '../config/policies';
import { withTransaction, type Pool } from '../db/pool';
import { admissionBlockFor, admissionGrantAndClaim, admissionLock, admissionRefund } from '../db/queries/admission';
import { ledgerDeferPending, type ClaimedOperation } from '../db/queries/ledger';

/**
 * Global admission: no token, no call. One short transaction locks the policy's admission row,
 * refills the bucket from the database clock, checks the pause switch, the 429 block and the
 * concurrency in use (live in-flight leases of every worker), and claims at most that many due
 * operations. Operations not admitted are deferred with a not_before: durable state, not a
 * sleeping worker (docs/design.md invariants 9 and 10).
 */

/**
 * A grant is good for this long: a call that cannot start within it is not made (the operation is
 * rescheduled). Calls therefore reach the remote at most GRANT_LIFETIME_MS (+ a network margin)
 * after the bucket was read, and refilling at rate / (1 + that delay) keeps every one-second
 * window AT THE REMOTE within rate + burst, not just the grants.
 */
export const GRANT_LIFETIME_MS = 25;
const NETWORK_MARGIN_MS = 5;
export function effectiveRefillRate(ratePerSecond: number): number {
  return ratePerSecond / (1 + (GRANT_LIFETIME_MS + NETWORK_MARGIN_MS) / 1000);
}

/** Shortest wait before an operation that found no token or no free slot asks again. */
export const MIN_ADMISSION_WAIT_MS = 100;
/** Waits at least this long are written to the operations' not_before. */
export const DEFER_IN_LEDGER_FROM_MS = 1_000;
/** How often paused work looks at the switch again. */
export const PAUSED_RECHECK_MS = 1_000;

export type AdmissionVerdict = 'admitted' | 'paused' | 'blocked' | 'no-token' | 'concurrency' | 'none-due';

export interface AdmissionGrant {
  claimed: ClaimedOperation[];
  /** Process clock (ms) when the refilled bucket was read; the grant expires GRANT_LIFETIME_MS later. */
  readAt: number;
  verdict: AdmissionVerdict;
  /** Operations due now whose not_before was moved by waitMs (long waits only). */
  deferred: number;
  /** When the deferred ones should ask again. */
  waitMs: number;
}

export async function admitAndClaim(
  pool: Pool,
  policy: RemoteDeletePolicy,
  request: { keys: readonly string[]; owner: string },
): Promise<AdmissionGrant> {
  const { burst, concurrency } = policy.admission;
  const ratePerSecond = effectiveRefillRate(policy.admission.ratePerSecond);
  return withTransaction(pool, async (client) => {
    await admissionLock(client, policy.name, burst);
    const state = await admissionGrantAndClaim(client, {
      policy: policy.name,
      ratePerSecond,
      burst,
      concurrency,
      keys: request.keys,
      owner: request.owner,
      leaseMs: policy.leaseMs,
    });
    // The bucket was read a moment before this answer arrived: the grant's age is undercounted by
    // that one trip back, which NETWORK_MARGIN_MS covers.
    const readAt = performance.now();
    let verdict: AdmissionVerdict = 'admitted';
    let waitMs = MIN_ADMISSION_WAIT_MS;
    if (state.paused) {
      verdict = 'paused';
      waitMs = PAUSED_RECHECK_MS;
    } else if (state.blockedForMs > 0) {
      verdict = 'blocked';
      waitMs = state.blockedForMs;
    } else if (state.claimed.length === 0 && (state.wholeTokens === 0 || state.freeSlots <= 0)) {
      verdict = state.wholeTokens === 0 ? 'no-token' : 'concurrency';
      // A token arrives in (1 - fraction) / rate seconds; a slot frees when a call ends.
      waitMs = state.wholeTokens === 0 ? Math.max(MIN_ADMISSION_WAIT_MS, ((1 - (state.tokens - state.wholeTokens)) / ratePerSecond) * 1000) : MIN_ADMISSION_WAIT_MS;
    } else if (state.claimed.length === 0) {
      verdict = 'none-due';
    }
    // A wait of a token or a free slot is short: the batch waits in a delay tier and the operations
    // stay due. A pause or a 429 block can be long: the operations themselves record when to retry.
    const deferred = waitMs >= DEFER_IN_LEDGER_FROM_MS ? await ledgerDeferPending(client, request.keys, waitMs) : 0;
    return { claimed: state.claimed, readAt, verdict, deferred, waitMs };
  });
}

/** Tokens of grants that expired unused go back to the bucket (capped at the burst). */
export async function refundExpiredGrants(pool: Pool, policy: RemoteDeletePolicy, count: number): Promise<void> {
  if (count > 0) await admissionRefund(pool, policy.name, count, policy.admission.burst);
}

/** A 429 tells every worker to hold off: the whole policy is blocked for the Retry-After. */
export async function blockAdmission(pool: Pool, policy: string, delayMs: number): Promise<void> {
  await admissionBlockFor(pool, policy, delayMs);
}
