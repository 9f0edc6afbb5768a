import { admitAndClaim, blockAdmission, GRANT_LIFETIME_MS, refundExpiredGrants, type AdmissionGrant } from '../../../shared/admission/controller';
import type { RemoteDeletePolicy } from '../../../shared/config/policies';
import { withTransaction } from '../../../shared/db/pool';
import { batchesRecordReceipt } from '../../../shared/db/queries/batches';
import type { ResolvedTarget } from '../../../shared/db/queries/expiring-rows';
import {
  ledgerDueSummary,
  ledgerFinish,
  ledgerRecordCandidates,
  ledgerReschedule,
  ledgerSupersedeChanged,
  targetSettleConfirmed,
  type ClaimedOperation,
} from '../../../shared/db/queries/ledger';
import type { RemoteCleanupClient, RemoteOutcome } from '../../../shared/remote/client';
import type { BatchHandler, HandlerContext } from './types';

/** Upper bound of the random extra wait added to a Retry-After (bounded jitter, never negative). */
export const RETRY_AFTER_JITTER_MS = 500;
/** Longest a worker keeps one batch in the admit-call loop before handing it to a delay tier. */
export const HOLD_BATCH_MAX_MS = 5_000;
/** Retry-After assumed when a 429 carries none. */
export const DEFAULT_RETRY_AFTER_MS = 1_000;

/** Delay before retrying an uncertain call with the same key: 1 s doubling to 60 s, plus jitter. */
export function uncertainBackoffMs(attempt: number): number {
  return Math.min(60_000, 1000 * 2 ** Math.max(0, attempt - 1)) + Math.random() * 250;
}

type CallResult = 'confirmed' | 'rate-limited' | 'uncertain' | 'rejected' | 'gave-up' | 'circuit-open' | 'grant-expired' | 'stale-lease';

/**
 * remote-delete. Per delivery:
 *  1. record an operation per still-eligible item (insert-if-absent; the delivery is counted);
 *  2. finish as 'superseded' pending operations whose row changed since;
 *  3. admission: claim due operations within the global rate and concurrency, commit;
 *  4. call the remote for each claimed operation (no transaction or lock held meanwhile);
 *  5. record each outcome, conditional on still holding the lease;
 *  6. if operations of the batch remain open, ask settle to delay the batch until the earliest is due.
 * A crash anywhere leaves the ledger saying what is known; leases expire and the call is retried
 * with the same Idempotency-Key.
 */
export function makeRemoteDeleteHandler(policy: RemoteDeletePolicy, target: ResolvedTarget, remote: RemoteCleanupClient): BatchHandler {
  return async (batch, context) => {
    const recorded = await withTransaction(context.pool, async (client) => {
      const candidates = await ledgerRecordCandidates(client, target, {
        policy: policy.name,
        runId: batch.runId,
        cutoff: batch.cutoff,
        items: batch.items,
        source: 'scan',
      });
      const superseded = await ledgerSupersedeChanged(client, target, candidates.known);
      return { ...candidates, superseded };
    });
    // Admit, call, record, and ask again while admission keeps granting: a batch keeps the tokens
    // flowing instead of waiting a delay tier per grant. It stops at the first empty grant (no
    // token, no slot, paused, blocked, nothing due) or after HOLD_BATCH_MAX_MS, never sleeping.
    const results: CallResult[] = [];
    const holdUntil = Date.now() + HOLD_BATCH_MAX_MS;
    let grant: AdmissionGrant;
    let admitted = 0;
    let called: boolean;
    do {
      grant = await admitAndClaim(context.pool, policy, { keys: recorded.known, owner: context.workerId });
      admitted += grant.claimed.length;
      const round = await Promise.all(grant.claimed.map((operation) => callAndRecord(policy, target, remote, operation, grant.readAt, context)));
      results.push(...round);
      await refundExpiredGrants(context.pool, policy, round.filter((result) => result === 'grant-expired').length);
      // A round whose grants all expired (an overloaded process) made no call: let the batch wait.
      called = round.some((result) => result !== 'grant-expired');
    } while (called && Date.now() < holdUntil);
    const tally = countResults(results);
    for (const [result, count] of Object.entries(tally)) context.metrics.operationsTotal.inc({ policy: policy.name, result }, count);

    const remaining = await ledgerDueSummary(context.pool, recorded.known);
    const detail = {
      ...tally,
      recorded: recorded.inserted,
      superseded: recorded.superseded,
      notEligible: batch.items.length - recorded.known.length,
      admitted,
      deferred: grant.deferred,
    };
    if (remaining.open > 0) {
      const delayMs = remaining.due > 0 ? grant.waitMs : Math.max(remaining.nextInMs ?? grant.waitMs, 100);
      context.log.debug({ ...detail, open: remaining.open, verdict: grant.verdict, delayMs }, 'batch has open operations');
      return { kind: 'retry', delayMs, reason: `${remaining.open} operations open (${grant.verdict})` };
    }
    // Every operation of the batch is finished: the receipt counts confirmations over all its deliveries.
    const receiptWritten = await batchesRecordReceipt(context.pool, {
      batchId: batch.batchId,
      runId: batch.runId,
      policy: policy.name,
      items: batch.items.length,
      deleted: remaining.confirmed,
      workerId: context.workerId,
    });
    return {
      kind: 'done',
      deleted: tally.confirmed ?? 0,
      noop: batch.items.length - (tally.confirmed ?? 0),
      duplicate: !receiptWritten,
      detail,
    };
  };
}

async function callAndRecord(
  policy: RemoteDeletePolicy,
  target: ResolvedTarget,
  remote: RemoteCleanupClient,
  operation: ClaimedOperation,
  grantReadAt: number,
  context: HandlerContext,
): Promise<CallResult> {
  if (performance.now() - grantReadAt > GRANT_LIFETIME_MS) {
    // Too late to call on this grant (a busy event loop, a slow commit): no call, no attempt.
    const applied = await ledgerReschedule(context.pool, {
      operationKey: operation.operationKey,
      owner: context.workerId,
      delayMs: 0,
      lastResult: 'grant-expired',
      uncountAttempt: true,
    });
    return applied ? 'grant-expired' : 'stale-lease';
  }
  const outcome: RemoteOutcome = await remote.delete(operation.assetId, operation.operationKey);
  context.metrics.remoteCallsTotal.inc({ policy: policy.name, outcome: outcome.kind });
  context.failpoint('after-remote-call');
  const owner = context.workerId;
  const key = operation.operationKey;
  let applied: boolean;
  let result: CallResult;
  switch (outcome.kind) {
    case 'confirmed': {
      result = 'confirmed';
      applied = await withTransaction(context.pool, async (client) => {
        const finished = await ledgerFinish(client, { operationKey: key, owner, outcome: 'confirmed', lastResult: `HTTP ${outcome.status}` });
        if (finished) {
          // The row itself now says so (or is gone), if it still holds the same retention decision.
          await targetSettleConfirmed(client, target, {
            assetId: operation.assetId,
            observedExpiry: observedExpiryOf(key, policy.name, operation.assetId),
            markConfirmed: policy.markConfirmed,
          });
        }
        return finished;
      });
      break;
    }
    case 'rate-limited': {
      result = 'rate-limited';
      const delayMs = (outcome.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS) + Math.random() * RETRY_AFTER_JITTER_MS;
      applied = await ledgerReschedule(context.pool, { operationKey: key, owner, delayMs, lastResult: 'rate-limited' });
      await blockAdmission(context.pool, policy.name, outcome.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS);
      break;
    }
    case 'uncertain': {
      if (operation.attemptCount >= policy.retry.maxAttempts) {
        result = 'gave-up';
        applied = await ledgerFinish(context.pool, { operationKey: key, owner, outcome: 'gave-up', lastResult: 'uncertain', error: outcome.reason });
      } else {
        result = 'uncertain';
        applied = await ledgerReschedule(context.pool, {
          operationKey: key,
          owner,
          delayMs: uncertainBackoffMs(operation.attemptCount),
          lastResult: 'uncertain',
          error: outcome.reason,
        });
      }
      break;
    }
    case 'rejected':
      result = 'rejected';
      applied = await ledgerFinish(context.pool, { operationKey: key, owner, outcome: 'rejected', lastResult: `HTTP ${outcome.status}`, error: outcome.reason });
      break;
    case 'circuit-open':
      result = 'circuit-open';
      applied = await ledgerReschedule(context.pool, {
        operationKey: key,
        owner,
        delayMs: outcome.retryInMs,
        lastResult: 'circuit-open',
        uncountAttempt: true,
      });
      break;
  }
  if (!applied) {
    // Our lease expired and another worker claimed the operation: its claim is the truth now.
    context.log.warn({ operationKey: key, outcome: outcome.kind }, 'stale lease: outcome not recorded');
    return 'stale-lease';
  }
  return result;
}

/** The observed expiry is the part of the key after "<policy>:<id>:". */
function observedExpiryOf(key: string, policy: string, assetId: string): string {
  return key.slice(policy.length + 1 + assetId.length + 1);
}

function countResults(results: readonly CallResult[]): Partial<Record<CallResult, number>> {
  const tally: Partial<Record<CallResult, number>> = {};
  for (const result of results) tally[result] = (tally[result] ?? 0) + 1;
  return tally;
}
