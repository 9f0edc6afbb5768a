import { admitAndClaimS3, chargeLateSend, untilSendAt, type S3Grant } from '../../../shared/admission/s3';
import { blockAdmission } from '../../../shared/admission/controller';
import { eventsEnabled, policyVersion, type S3DeletePolicy } from '../../../shared/config/policies';
import { withTransaction } from '../../../shared/db/pool';
import type { ResolvedTarget } from '../../../shared/db/queries/target';
import { ledgerDueSummary, type ClaimedOperation } from '../../../shared/db/queries/ledger';
import {
  auditRecordS3Deleted,
  ledgerFinishRequestKeys,
  ledgerRescheduleRequestKeys,
  targetSettleConfirmedMany,
  type S3KeyOutcomeRow,
} from '../../../shared/db/queries/ledger-s3';
import { objectKeyFor, type ObjectStorageClient, type S3KeyResult, type S3RequestOutcome } from '../../../shared/remote/s3';
import { makeOutboxLimitCheck } from '../outbox-limit';
import { HOLD_BATCH_MAX_MS, observedExpiryOf, RETRY_AFTER_JITTER_MS, uncertainBackoffMs, WAIT_IN_WORKER_MAX_MS } from './remote-delete';
import { countOperationOutcomes, endRemoteDelivery, outboxFullRetry, recordRemoteBatch, WAIT_IN_BROKER_MAX_MS } from './remote-delivery';
import { bookkeepingGate } from '../bookkeeping-gate';
import type { BatchHandler, HandlerContext } from './types';

/** Longest sleep between two admission asks of a batch waiting for a request slot. */
const SLOT_POLL_MS = 50;

/** Where a request's keys went, counted for the batch result and reaper_operations_total. */
type KeyTally = Partial<Record<'confirmed' | 'rejected' | 'retryable' | 'gave-up' | 'rate-limited' | 'uncertain' | 'stale-lease', number>>;

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * remote-delete against object storage (remote.kind s3). Per delivery:
 *  1. record an operation per still-eligible item (shared with the HTTP handler);
 *  2. admission claims ONE request's worth of the batch's due operations (a request token, a
 *     request slot, a key token per key; each key re-checked against its row in the claim);
 *  3. one DeleteObjects request for those keys (no transaction or lock held meanwhile);
 *  4. each key's result recorded under its claim (owner + attempt): Deleted -> confirmed (audit per
 *     object and version, row settled), per-key refusal -> rejected, per-key retryable error ->
 *     pending again with a backoff; a throttled request blocks the whole policy; an uncertain one
 *     puts every key back to pending, to be retried together;
 *  5. repeat while the batch has due operations and its hold lasts; then the delivery ends as
 *     for the HTTP handler (delay tier, parked in the ledger, or the receipt).
 * A crash between 3 and 4 leaves the keys in flight: their leases expire, the claim re-checks them
 * and the retry sends them again (deleting an absent key succeeds, so nothing is deleted twice).
 */
export function makeS3DeleteHandler(policy: S3DeletePolicy, target: ResolvedTarget, storage: ObjectStorageClient): BatchHandler {
  const outboxLimit = makeOutboxLimitCheck(policy);
  return async (batch, context) => {
    const outboxFull = await outboxFullRetry(outboxLimit, policy, context);
    if (outboxFull) return outboxFull;
    const bookkeeping = bookkeepingGate(context.pool);
    const recorded = await bookkeeping.run(() => recordRemoteBatch(policy.name, target, batch, context));
    const holdUntil = Date.now() + HOLD_BATCH_MAX_MS;
    const tally: KeyTally = {};
    let grant: S3Grant | null = null;
    let superseded = 0;
    let requests = 0;
    let waitedInWorker = 0;
    while (recorded.known.length > 0 && Date.now() < holdUntil) {
      grant = await admitAndClaimS3(context.pool, policy, target, { keys: recorded.known, owner: context.workerId, cutoff: batch.cutoff, batchId: batch.batchId });
      superseded += grant.superseded;
      context.metrics.remoteGrantsAdmittedTotal.inc({ policy: policy.name }, grant.claimed.length);
      context.metrics.remoteOperationsClaimedTotal.inc({ policy: policy.name }, grant.claimed.length);
      if (grant.superseded > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'superseded' }, grant.superseded);
      if (grant.held > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'held' }, grant.held);
      if (grant.claimed.length > 0) {
        requests += 1;
        for (const [result, count] of Object.entries(await sendAndRecord(policy, target, storage, grant, context))) {
          tally[result as keyof KeyTally] = (tally[result as keyof KeyTally] ?? 0) + count;
        }
        continue;
      }
      if (grant.verdict === 'paused' || grant.verdict === 'blocked' || grant.verdict === 'none-due') break;
      // No token or no request slot: wait here only while it is near.
      const napMs = grant.verdict === 'concurrency' ? SLOT_POLL_MS : grant.waitMs;
      if (napMs > WAIT_IN_WORKER_MAX_MS || Date.now() + napMs >= holdUntil) break;
      waitedInWorker += 1;
      await sleep(napMs);
    }
    countOperationOutcomes(tally, outboxLimit, policy, context);
    const remaining = await bookkeeping.run(() => ledgerDueSummary(context.pool, {
      policy: policy.name,
      keys: recorded.known,
      batchId: batch.batchId,
      aheadLimit: Math.ceil((policy.admission.keysPerSecond * (WAIT_IN_BROKER_MAX_MS + WAIT_IN_WORKER_MAX_MS)) / 1000),
    }));
    const detail = { ...tally, recorded: recorded.inserted, superseded, notEligible: batch.items.length - recorded.known.length, requests, waitedInWorker };
    return endRemoteDelivery({
      policy,
      batch,
      context,
      known: recorded.known,
      remaining,
      verdict: grant?.verdict ?? 'none-due',
      grantWaitMs: grant?.waitMs ?? 0,
      rate: policy.admission.keysPerSecond,
      confirmed: tally.confirmed ?? 0,
      detail,
    });
  };
}

/** One DeleteObjects request for the claimed operations, and every key's outcome recorded under its claim. */
async function sendAndRecord(
  policy: S3DeletePolicy,
  target: ResolvedTarget,
  storage: ObjectStorageClient,
  grant: S3Grant,
  context: HandlerContext,
): Promise<KeyTally> {
  const owner = context.workerId;
  const claimed = grant.claimed;
  const byObjectKey = new Map(claimed.map((operation) => [objectKeyFor(policy.remote.key, operation.assetId), operation]));
  // The prepared request leaves at its sendAt (admission/s3.ts "Sending on the bucket's clock").
  // A late-send charge is measured as it leaves and written while it travels: waiting for it
  // first (another worker's grant may hold the admission row) would itself make the request late,
  // uncharged. It lands long before the next request's keys are due.
  let lateCharge: Promise<unknown> = Promise.resolve();
  const onSend = async () => {
    await untilSendAt(policy.name, grant);
    context.log.debug({ keys: claimed.length, requestId: grant.requestId }, 'object storage request leaves');
    lateCharge = chargeLateSend(context.pool, policy, grant).catch((error: Error) => context.log.warn({ err: error.message }, 'late-send charge not recorded'));
  };
  const outcome: S3RequestOutcome = await storage.deleteKeys([...byObjectKey.keys()], { onSend });
  await lateCharge;
  context.metrics.remoteCallsTotal.inc({ policy: policy.name, outcome: outcome.kind });
  if (outcome.kind === 'throttled') context.metrics.remoteRateLimitedTotal.inc({ policy: policy.name });
  // The request ran (or may have): a crash from here until the outcome is recorded leaves the keys in flight.
  context.failpoint('after-remote-call');
  const row = (operation: ClaimedOperation, lastResult: string, error: string | null = null): S3KeyOutcomeRow => ({
    operationKey: operation.operationKey,
    attempt: operation.attemptCount,
    lastResult,
    error,
  });
  const maxAttempt = Math.max(...claimed.map((operation) => operation.attemptCount));
  const tally: KeyTally = {};
  const count = (result: keyof KeyTally, applied: Set<string>, rows: readonly S3KeyOutcomeRow[]) => {
    if (applied.size > 0) tally[result] = (tally[result] ?? 0) + applied.size;
    if (rows.length > applied.size) tally['stale-lease'] = (tally['stale-lease'] ?? 0) + rows.length - applied.size;
    if (rows.length > applied.size) context.log.warn({ result, stale: rows.length - applied.size }, 'stale lease: outcome not recorded for some keys');
  };

  switch (outcome.kind) {
    case 'answered': {
      const deleted: Array<{ operation: ClaimedOperation; result: Extract<S3KeyResult, { kind: 'deleted' }> }> = [];
      const refused: Array<{ operation: ClaimedOperation; result: Extract<S3KeyResult, { kind: 'rejected' }> }> = [];
      const retryable: Array<{ operation: ClaimedOperation; result: Extract<S3KeyResult, { kind: 'retryable' }> }> = [];
      for (const [objectKey, operation] of byObjectKey) {
        const result = outcome.results.get(objectKey) ?? { kind: 'retryable', code: 'NoResult', message: 'no result for the key', deletedVersionIds: [] };
        if (result.kind === 'deleted') deleted.push({ operation, result });
        else if (result.kind === 'rejected') refused.push({ operation, result });
        else retryable.push({ operation, result });
        context.metrics.remoteAttemptsTotal.inc({ policy: policy.name, class: result.kind === 'deleted' ? 'confirmed' : result.kind === 'rejected' ? 'rejected' : 'uncertain' });
      }
      await withTransaction(context.pool, async (client) => {
        const rows = deleted.map(({ operation }) => row(operation, 'S3 Deleted'));
        const applied = await ledgerFinishRequestKeys(client, owner, 'confirmed', rows);
        // The store deleted these objects (and versions) whether or not our claim is still current:
        // audited either way, once per object and version; versions gone before a refusal too.
        if (policy.audit?.enabled) {
          await auditRecordS3Deleted(client, policyVersion(policy), [
            ...deleted.map(({ operation, result }) => ({ operationKey: operation.operationKey, versionIds: result.versionIds })),
            ...[...refused, ...retryable]
              .filter(({ result }) => result.deletedVersionIds.length > 0)
              .map(({ operation, result }) => ({ operationKey: operation.operationKey, versionIds: result.deletedVersionIds })),
          ]);
        }
        // The rows themselves now say so (or are gone), where they still hold the decision and are not held.
        await targetSettleConfirmedMany(client, target, {
          items: deleted
            .filter(({ operation }) => applied.has(operation.operationKey))
            .map(({ operation }) => ({ assetId: operation.assetId, observedExpiry: observedExpiryOf(operation.operationKey, policy.name, operation.assetId) })),
          markConfirmed: policy.markConfirmed,
          events: eventsEnabled(policy) ? { policyVersion: policyVersion(policy) } : null,
        });
        count('confirmed', applied, rows);
        if (applied.size > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'confirmed' }, applied.size);
        for (const { operation } of deleted) {
          if (!applied.has(operation.operationKey)) continue;
          const expiry = Date.parse(observedExpiryOf(operation.operationKey, policy.name, operation.assetId));
          context.metrics.deletionLagSeconds.observe({ policy: policy.name }, Math.max(0, (Date.now() - expiry) / 1000));
        }
      });
      // Refused (AccessDenied, Object Lock legal hold or retention): kept for review, never retried.
      const refusedRows = refused.map(({ operation, result }) => row(operation, `S3 ${result.code}`, result.message));
      const rejected = await ledgerFinishRequestKeys(context.pool, owner, 'rejected', refusedRows);
      count('rejected', rejected, refusedRows);
      if (rejected.size > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'rejected' }, rejected.size);
      await retryOrGiveUp(retryable.map(({ operation, result }) => ({ operation, lastResult: `S3 ${result.code}`, error: result.message })), 'retryable');
      return tally;
    }
    case 'throttled': {
      // S3 sends no Retry-After with SlowDown: the block doubles with the request's attempt, as an
      // uncertain retry does; every worker holds off (the policy-wide block), then starts with an empty bucket.
      const blockMs = outcome.retryAfterMs ?? uncertainBackoffMs(maxAttempt);
      const rows = claimed.map((operation) => row(operation, 'rate-limited', `HTTP ${outcome.status} ${outcome.code}`));
      const applied = await ledgerRescheduleRequestKeys(context.pool, owner, blockMs + Math.random() * RETRY_AFTER_JITTER_MS, rows);
      await blockAdmission(context.pool, policy.name, blockMs);
      count('rate-limited', applied, rows);
      return tally;
    }
    case 'uncertain':
      await retryOrGiveUp(claimed.map((operation) => ({ operation, lastResult: 'uncertain', error: outcome.reason })), 'uncertain');
      return tally;
    case 'rejected': {
      const rows = claimed.map((operation) => row(operation, `HTTP ${outcome.status} ${outcome.code}`, outcome.reason));
      const applied = await ledgerFinishRequestKeys(context.pool, owner, 'rejected', rows);
      count('rejected', applied, rows);
      if (applied.size > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'rejected' }, applied.size);
      return tally;
    }
  }

  /** Keys to try again with the same operation: pending after a backoff, or gave-up at retry.maxAttempts. */
  async function retryOrGiveUp(keys: ReadonlyArray<{ operation: ClaimedOperation; lastResult: string; error: string }>, result: 'retryable' | 'uncertain'): Promise<void> {
    if (keys.length === 0) return;
    const spent = keys.filter(({ operation }) => operation.attemptCount >= policy.retry.maxAttempts).map(({ operation, lastResult, error }) => row(operation, lastResult, error));
    const again = keys.filter(({ operation }) => operation.attemptCount < policy.retry.maxAttempts).map(({ operation, lastResult, error }) => row(operation, lastResult, error));
    const gaveUp = await ledgerFinishRequestKeys(context.pool, owner, 'gave-up', spent);
    count('gave-up', gaveUp, spent);
    if (gaveUp.size > 0) context.metrics.remoteOperationsCompletedTotal.inc({ policy: policy.name, outcome: 'gave-up' }, gaveUp.size);
    // The keys of one request wait the same backoff, so they are claimed together again.
    const applied = await ledgerRescheduleRequestKeys(context.pool, owner, uncertainBackoffMs(maxAttempt), again);
    count(result, applied, again);
  }
}
