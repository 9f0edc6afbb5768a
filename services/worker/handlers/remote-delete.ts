import {
  admissionLockWaitHistogram,
  admitAndClaim,
  blockAdmission,
  bucketShape,
  grantStillGood,
  type AdmissionGrant,
} from '../../../shared/admission/controller';
import { eventsEnabled, policyVersion, type RemoteDeletePolicy } from '../../../shared/config/policies';
import { windowStateAt } from '../../../shared/schedule/window';
import { auditRecordConfirmed } from '../../../shared/db/queries/audit';
import { withTransaction } from '../../../shared/db/pool';
import type { ResolvedTarget } from '../../../shared/db/queries/target';
import {
  ledgerDueSummary,
  ledgerFinish,
  ledgerReschedule,
  targetSettleConfirmed,
  type ClaimedOperation,
} from '../../../shared/db/queries/ledger';
import type { RemoteCleanupClient, RemoteOutcome } from '../../../shared/remote/client';
import { makeOutboxLimitCheck } from '../outbox-limit';
import { countOperationOutcomes, endRemoteDelivery, outboxFullRetry, recordRemoteBatch, WAIT_IN_BROKER_MAX_MS } from './remote-delivery';
import { bookkeepingGate } from '../bookkeeping-gate';
import type { BatchHandler, HandlerContext } from './types';

/** Upper bound of the random extra wait added to a Retry-After (bounded jitter, never negative). */
export const RETRY_AFTER_JITTER_MS = 500;
/**
 * Longest a worker keeps one batch in the admit-call loop before handing it back to the broker:
 * long enough for a batch the ledger sweeper sent for its turn (at most SWEEP_AHEAD_MS away) to
 * wait for it and then be drained in this one delivery.
 */
export const HOLD_BATCH_MAX_MS = 8_000;
/**
 * A batch whose turn (open operations ahead of it ÷ rate) is at most this far waits in the worker
 * (no lease held); a later one is parked in the ledger at once, before any admission is asked for.
 * Above the sweeper's SWEEP_AHEAD_MS: a batch sent for its turn is not sent back.
 */
export const WAIT_IN_WORKER_MAX_MS = 4_000;
/**
 * A waiting batch asks the admission row (a lock every worker shares) only when its turn is this
 * close; until then it re-reads its place in line, which takes no lock. The bucket holds more than
 * this much rate, so the hand-over from one batch to the next loses none.
 */
export const POLL_ADMISSION_WITHIN_MS = 300;
/** Longest sleep of a waiting batch between two reads of its place in line. */
const LINE_CHECK_MAX_MS = 250;
/**
 * A waiting batch gives way to the operations ahead of it only while someone takes them. The
 * copies that carry them may sit behind this very batch in the queue (a delay tier's return, a
 * sweeper's send, another run's batch): then nobody takes them while this batch waits, every
 * prefetch slot can fill with batches waiting for each other's operations, and the queue grows
 * faster than it drains (the 10-minute chaos stall, issue 43). When the line has not moved for
 * this long (or two tokens' time at a slow rate), the batch asks admission for its own operations:
 * the shared bucket still decides how fast anything is called.
 */
export const LINE_STILL_MS = 500;
export function lineStillMs(ratePerSecond: number): number {
  return Math.max(LINE_STILL_MS, (2 * 1000) / ratePerSecond);
}
/**
 * A batch whose operations can be admitted within this time goes to a delay tier; a longer wait
 * (its turn is far, the policy is paused or blocked for long, a backoff) is kept in the ledger
 * only: the message is acked and the ledger sweeper publishes the batch again when its turn is near.
 */
export { WAIT_IN_BROKER_MAX_MS };
/** Retry-After assumed when a 429 carries none. */
export const DEFAULT_RETRY_AFTER_MS = 1_000;

/** Delay before retrying an uncertain call with the same key: 1 s doubling to 60 s, plus jitter. */
export function uncertainBackoffMs(attempt: number): number {
  return Math.min(60_000, 1000 * 2 ** Math.max(0, attempt - 1)) + Math.random() * 250;
}

/** Call results that finish the operation (state done), counted in reaper_remote_operations_completed_total. */
const FINISHING_RESULTS: ReadonlySet<string> = new Set(['confirmed', 'rejected', 'gave-up']);

type CallResult = 'confirmed' | 'rate-limited' | 'uncertain' | 'rejected' | 'gave-up' | 'circuit-open' | 'grant-expired' | 'stale-lease';

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * remote-delete. Per delivery:
 *  1. record an operation per still-eligible item (insert-if-absent; the delivery is counted and
 *     the operations marked as carried); keep the batch's message while it has open operations;
 *  2. admission: one statement re-checks the batch's due operations against their rows
 *     (superseding those that changed), claims what the global rate and concurrency allow, commit;
 *  3. call the remote for each claimed operation (no transaction or lock held meanwhile);
 *  4. record each outcome, conditional on the claim (lease owner and attempt number);
 *  5. repeat while admitted; at the head of the line wait in the worker for the next token;
 *  6. if operations remain open: a short wait goes to a delay tier, a long one is parked in the
 *     ledger (message acked; the ledger sweeper sends the batch again when its turn is near).
 * A crash anywhere leaves the ledger saying what is known; leases expire and the call is retried
 * with the same Idempotency-Key, after the same re-check.
 */
export function makeRemoteDeleteHandler(policy: RemoteDeletePolicy, target: ResolvedTarget, remote: RemoteCleanupClient): BatchHandler {
  const rate = bucketShape(policy.admission.ratePerSecond, policy.admission.burst).ratePerSecond;
  const outboxLimit = makeOutboxLimitCheck(policy);
  return async (batch, context) => {
    // Expiry events: past the outbox limit no remote call is made for the policy (no deletion) until the relay catches up.
    const outboxFull = await outboxFullRetry(outboxLimit, policy, context);
    if (outboxFull) return outboxFull;
    const bookkeeping = bookkeepingGate(context.pool);
    const recorded = await bookkeeping.run(() => recordRemoteBatch(policy.name, target, batch, context));
    const lockWait = admissionLockWaitHistogram(context.metrics.registry);
    const results: CallResult[] = [];
    const holdUntil = Date.now() + HOLD_BATCH_MAX_MS;
    // Its place in line only matters within what a worker would wait for: counting further is waste.
    const aheadLimit = Math.ceil((rate * (WAIT_IN_BROKER_MAX_MS + WAIT_IN_WORKER_MAX_MS)) / 1000);
    const readLine = async () => {
      const line = await bookkeeping.run(() => ledgerDueSummary(context.pool, { policy: policy.name, keys: recorded.known, batchId: batch.batchId, aheadLimit }));
      return { ...line, turnMs: (line.ahead / rate) * 1000 };
    };
    let grant: AdmissionGrant | null = null;
    let admitted = 0;
    let superseded = 0;
    let waitedInWorker = 0;
    /** Admission asks made because the line ahead stood still (nobody took the operations ahead). */
    let standingStillClaims = 0;
    // Calls run while the loop asks for the next grant: a batch at the head of the line takes every
    // token as it arrives (within the concurrency cap), not one round of calls at a time.
    const inProgress = new Set<Promise<void>>();
    // A call whose outcome could not be written (a lock timeout, the database gone): kept here and
    // thrown once every call of the delivery has ended, so the batch's result says so and no
    // rejection is ever left unhandled while the loop sleeps or asks for admission.
    const callErrors: unknown[] = [];
    const startCall = (operation: ClaimedOperation, from: AdmissionGrant): void => {
      const call: Promise<void> = callAndRecord(policy, target, remote, operation, from, context)
        .then(
          (result) => void results.push(result),
          (error: unknown) => {
            callErrors.push(error);
            context.log.warn({ operationKey: operation.operationKey, err: (error as Error)?.message ?? String(error) }, 'call outcome not recorded; the lease expires and the call is retried with the same key');
          },
        )
        .finally(() => inProgress.delete(call));
      inProgress.add(call);
    };
    // The calls' promises never reject (above): racing or awaiting them is safe anywhere.
    const callEnds = () => Promise.race(inProgress);
    // Every way out of the loop (a break, a throw of admission or of a read) first waits for the
    // calls in progress: none outlives its delivery, and each one's outcome is recorded or reported.
    try {
      // Far from its turn (a scan of a large backlog): parked at once, without taking the admission
      // lock, so a whole scan is recorded quickly and the next run's scan finds it in the ledger.
      let line = recorded.known.length > 0 ? await readLine() : null;
      const parkAtOnce = line !== null && line.due > 0 && line.turnMs > WAIT_IN_WORKER_MAX_MS;
      // When the line last moved (its count ahead fell): ahead only falls as others claim.
      let lineMoved = { ahead: line?.ahead ?? 0, at: Date.now() };
      const stillFor = lineStillMs(rate);
      // A call whose outcome write failed ends the claiming: the next would most likely fail the same way.
      // The schedule window is checked at every turn, not only when the message arrived: a batch
      // held in this loop must not go on calling past the window's end (issue 40). What is left
      // goes back as any unfinished batch does, and meets the window gate on its next delivery.
      while (!parkAtOnce && recorded.known.length > 0 && Date.now() < holdUntil && callErrors.length === 0 && windowStateAt(policy.window, new Date()).open) {
        if (line && inProgress.size === 0 && line.due > 0 && line.turnMs > POLL_ADMISSION_WITHIN_MS) {
          // Not at the head of the line yet: wait without the lock until the operations ahead are nearly taken.
          const napMs = Math.min(line.turnMs - POLL_ADMISSION_WITHIN_MS, LINE_CHECK_MAX_MS, holdUntil - Date.now());
          if (napMs > 0) {
            waitedInWorker += 1;
            await sleep(napMs);
          }
          line = await readLine();
          if (line.turnMs > WAIT_IN_WORKER_MAX_MS) break;
          if (line.ahead < lineMoved.ahead) lineMoved = { ahead: line.ahead, at: Date.now() };
          const lineStill = Date.now() - lineMoved.at >= stillFor;
          if (lineStill) standingStillClaims += 1;
          if (!lineStill && line.turnMs > POLL_ADMISSION_WITHIN_MS && Date.now() < holdUntil) continue;
        }
        line = null;
        grant = await admitAndClaim(context.pool, policy, target, { keys: recorded.known, owner: context.workerId, cutoff: batch.cutoff, batchId: batch.batchId });
        lockWait.observe({ policy: policy.name }, grant.lockWaitMs / 1000);
        superseded += grant.superseded;
        context.metrics.remoteGrantsAdmittedTotal.inc({ policy: policy.name }, grant.claimed.length);
        context.metrics.remoteOperationsClaimedTotal.inc({ policy: policy.name }, grant.claimed.length);
        if (grant.superseded > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'superseded' }, grant.superseded);
        if (grant.held > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'held' }, grant.held);
        for (const operation of grant.claimed) startCall(operation, grant);
        admitted += grant.claimed.length;
        if (grant.verdict === 'paused' || grant.verdict === 'blocked') break;
        if (grant.verdict === 'none-due') {
          // Everything of the batch is claimed or waiting a backoff: wait for a call to end, if any.
          if (inProgress.size === 0) break;
          await callEnds();
          continue;
        }
        if (grant.claimed.length === 0 && inProgress.size === 0) {
          // No token or no slot, and nothing of ours running: wait here only while our turn is near.
          line = await readLine();
          if (line.due === 0 || line.turnMs > WAIT_IN_WORKER_MAX_MS || Date.now() + grant.waitMs >= holdUntil) break;
          waitedInWorker += 1;
          await sleep(grant.waitMs);
          continue;
        }
        // Ask again when the next token is due; when the cap was the limit, as soon as a call of ours
        // frees a slot (an ended call does not bring a token: asking then would only take the lock).
        // Never past the batch's hold: a slow rate's next token may be further away than that.
        await Promise.race([sleep(Math.min(grant.waitMs, Math.max(0, holdUntil - Date.now()))), ...(grant.verdict === 'concurrency' && inProgress.size > 0 ? [callEnds()] : [])]);
      }
    } finally {
      await Promise.all(inProgress);
    }
    const tally = countResults(results);
    countOperationOutcomes(tally, outboxLimit, policy, context);
    // The delivery's result is the failure's (a lock timeout is retried, an outage pauses consumption);
    // the operation stays in flight under a lease that expires, then it is claimed and called again.
    if (callErrors.length > 0) throw callErrors[0];

    const remaining = await readLine();
    const detail = {
      ...tally,
      recorded: recorded.inserted,
      superseded,
      notEligible: batch.items.length - recorded.known.length,
      admitted,
      waitedInWorker,
      standingStillClaims,
    };
    return endRemoteDelivery({ policy, batch, context, known: recorded.known, remaining, verdict: grant?.verdict ?? 'none-due', grantWaitMs: grant?.waitMs ?? 0, rate, confirmed: tally.confirmed ?? 0, detail });
  };
}

async function callAndRecord(
  policy: RemoteDeletePolicy,
  target: ResolvedTarget,
  remote: RemoteCleanupClient,
  operation: ClaimedOperation,
  grant: AdmissionGrant,
  context: HandlerContext,
): Promise<CallResult> {
  const owner = context.workerId;
  const key = operation.operationKey;
  // The claim token: every outcome below is recorded only if this claim is still the current one.
  const claim = { operationKey: key, owner, attempt: operation.attemptCount };
  const timing = await grantStillGood(context.pool, policy, grant);
  if (timing === 'no-token') {
    // Late, the bucket refilled meanwhile and is empty now: no call, no attempt; due again at once.
    const applied = await ledgerReschedule(context.pool, { ...claim, delayMs: 0, lastResult: 'grant-expired', uncountAttempt: true });
    return applied ? 'grant-expired' : 'stale-lease';
  }
  const outcome: RemoteOutcome = await remote.delete(operation.assetId, operation.operationKey);
  context.metrics.remoteCallsTotal.inc({ policy: policy.name, outcome: outcome.kind });
  // A call that was made (an open circuit makes none), by class; 429s also apart.
  if (outcome.kind !== 'circuit-open') context.metrics.remoteAttemptsTotal.inc({ policy: policy.name, class: outcome.kind });
  if (outcome.kind === 'rate-limited') context.metrics.remoteRateLimitedTotal.inc({ policy: policy.name });
  context.failpoint('after-remote-call');
  let applied: boolean;
  let result: CallResult;
  switch (outcome.kind) {
    case 'confirmed': {
      result = 'confirmed';
      applied = await recordConfirmation(policy, key, context, () => withTransaction(context.pool, async (client) => {
        const finished = await ledgerFinish(client, { ...claim, outcome: 'confirmed', lastResult: `HTTP ${outcome.status}` });
        // The remote deleted the object even when this claim is stale: audited either way (once per operation).
        if (policy.audit?.enabled) await auditRecordConfirmed(client, key, policyVersion(policy));
        if (finished) {
          // The row itself now says so (or is gone), if it still holds the same retention decision and is not held.
          await targetSettleConfirmed(client, target, {
            assetId: operation.assetId,
            observedExpiry: observedExpiryOf(key, policy.name, operation.assetId),
            markConfirmed: policy.markConfirmed,
            events: eventsEnabled(policy) ? { policyVersion: policyVersion(policy) } : null,
          });
        }
        return finished;
      }));
      break;
    }
    case 'rate-limited': {
      result = 'rate-limited';
      const delayMs = (outcome.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS) + Math.random() * RETRY_AFTER_JITTER_MS;
      applied = await ledgerReschedule(context.pool, { ...claim, delayMs, lastResult: 'rate-limited' });
      await blockAdmission(context.pool, policy.name, outcome.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS);
      break;
    }
    case 'uncertain': {
      if (operation.attemptCount >= policy.retry.maxAttempts) {
        result = 'gave-up';
        applied = await ledgerFinish(context.pool, { ...claim, outcome: 'gave-up', lastResult: 'uncertain', error: outcome.reason });
      } else {
        result = 'uncertain';
        applied = await ledgerReschedule(context.pool, {
          ...claim,
          delayMs: uncertainBackoffMs(operation.attemptCount),
          lastResult: 'uncertain',
          error: outcome.reason,
        });
      }
      break;
    }
    case 'rejected':
      result = 'rejected';
      applied = await ledgerFinish(context.pool, { ...claim, outcome: 'rejected', lastResult: `HTTP ${outcome.status}`, error: outcome.reason });
      break;
    case 'circuit-open':
      result = 'circuit-open';
      applied = await ledgerReschedule(context.pool, {
        ...claim,
        delayMs: outcome.retryInMs,
        lastResult: 'circuit-open',
        uncountAttempt: true,
      });
      break;
  }
  if (applied && FINISHING_RESULTS.has(result)) {
    context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: result });
    if (result === 'confirmed') {
      // Eligibility to confirmed deletion: the "gap between eligibility and completion".
      const expiry = Date.parse(observedExpiryOf(key, policy.name, operation.assetId));
      context.metrics.deletionLagSeconds.observe({ policy: policy.name }, Math.max(0, (Date.now() - expiry) / 1000));
    }
  }
  if (!applied) {
    // Our lease expired and another worker claimed the operation: its claim is the truth now.
    context.log.warn({ operationKey: key, attempt: operation.attemptCount, outcome: outcome.kind }, 'stale lease: outcome not recorded');
    return 'stale-lease';
  }
  return result;
}

/** Tries of the audit row alone after a confirmation's transaction failed, and the wait before each. */
const AUDIT_ALONE_WAITS_MS = [0, 250, 1_000, 3_000];

/**
 * The remote said it deleted the object: `record` writes the outcome, the audit row and the row's
 * settle in one transaction. When that transaction fails (lock timeout, a lost connection, the
 * database restarting), the outcome stays unrecorded and the operation in flight: its lease
 * expires, it is claimed again and re-checked against its row. The deletion happened, though, and
 * if the row changes meanwhile (renewed, held) the next claim supersedes the operation and no call
 * ever confirms it again: so the audit row is written on its own first (a few tries over about 4 s),
 * then the failure goes on as before. auditRecordConfirmed writes once per operation, so a later
 * confirmation adds nothing. Still lost: an audit row whose own tries all fail (an outage longer
 * than the tries) for a row that changes before the operation is claimed again; it is logged.
 */
async function recordConfirmation(policy: RemoteDeletePolicy, operationKey: string, context: HandlerContext, record: () => Promise<boolean>): Promise<boolean> {
  try {
    return await record();
  } catch (error) {
    if (policy.audit?.enabled) {
      let written = false;
      for (const waitMs of AUDIT_ALONE_WAITS_MS) {
        if (waitMs > 0) await sleep(waitMs);
        try {
          await withTransaction(context.pool, (client) => auditRecordConfirmed(client, operationKey, policyVersion(policy)));
          written = true;
          break;
        } catch {
          // the database is still away: the next try, or the log below
        }
      }
      if (!written) context.log.error({ operationKey, err: (error as Error).message }, 'remote confirmed a deletion that could not be recorded or audited; the next claim re-checks the row');
    }
    throw error;
  }
}

/** The observed expiry is the part of the key after "<policy>:<id>:". */
export function observedExpiryOf(key: string, policy: string, assetId: string): string {
  return key.slice(policy.length + 1 + assetId.length + 1);
}

function countResults(results: readonly CallResult[]): Partial<Record<CallResult, number>> {
  const tally: Partial<Record<CallResult, number>> = {};
  for (const result of results) tally[result] = (tally[result] ?? 0) + 1;
  return tally;
}
