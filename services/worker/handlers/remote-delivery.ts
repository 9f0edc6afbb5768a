import type { AdmissionVerdict } from '../../../shared/admission/controller';
import type { AnyRemoteDeletePolicy } from '../../../shared/config/policies';
import { encodeBatch, type BatchV1 } from '../../../shared/contracts/batch';
import { withTransaction } from '../../../shared/db/pool';
import { batchesRecordReceipt } from '../../../shared/db/queries/batches';
import type { ResolvedTarget } from '../../../shared/db/queries/target';
import { ledgerPark, ledgerRecordCandidates, remoteBatchesForget, remoteBatchesKeep } from '../../../shared/db/queries/ledger';
import type { OutboxLimitCheck } from '../outbox-limit';
import { OUTBOX_FULL_REASON, outboxFullRetryMs } from '../outbox-limit';
import type { BatchResult } from '../results';
import type { HandlerContext } from './types';

/**
 * The two ends of a remote-delete delivery, shared by the HTTP handler (remote-delete.ts) and the
 * object storage handler (s3-delete.ts): recording the batch's operations in the ledger, and
 * deciding what happens to the message once the calls of this delivery are over.
 */

/**
 * A batch that has open operations is kept in the ledger for at most this long in a delay tier;
 * a longer wait is parked in the ledger only (the ledger sweeper publishes the batch again).
 */
export const WAIT_IN_BROKER_MAX_MS = 2_000;

/**
 * Expiry events: past the outbox limit no remote call is made for the policy (no deletion) until
 * the relay catches up: the batch goes to a delay tier. Null when under the limit.
 */
export async function outboxFullRetry(check: OutboxLimitCheck, policy: AnyRemoteDeletePolicy, context: HandlerContext): Promise<BatchResult | null> {
  if (!(await check.over(context.pool))) return null;
  context.log.warn({ policy: policy.name, maxOutbox: policy.events?.maxOutbox }, 'expiry-event outbox over its limit: deletions paused, batch goes to a delay tier');
  return { kind: 'retry', delayMs: outboxFullRetryMs(), reason: OUTBOX_FULL_REASON };
}

/**
 * The operations of a delivery are over: each outcome counted (reaper_operations_total) and, with
 * events on, the confirmed ones against the outbox limit (each wrote an event), which the limit
 * check adds to its last reading until the next one. Both handlers end their calls here, so none
 * can count one and forget the other (the object storage handler once forgot the limit).
 */
export function countOperationOutcomes(tally: Readonly<Record<string, number | undefined>>, outboxLimit: OutboxLimitCheck, policy: AnyRemoteDeletePolicy, context: HandlerContext): void {
  outboxLimit.deleted(tally.confirmed ?? 0);
  for (const [result, count] of Object.entries(tally)) if (count !== undefined) context.metrics.operationsTotal.inc({ policy: policy.name, result }, count);
}

/**
 * Step 1 of a delivery: one pending operation per still-eligible item (insert-if-absent; the
 * delivery counted, the operations marked carried), and the batch's message kept while it has any.
 */
export async function recordRemoteBatch(policy: string, target: ResolvedTarget, batch: BatchV1, context: HandlerContext): Promise<{ inserted: number; known: string[] }> {
  return withTransaction(context.pool, async (client) => {
    const candidates = await ledgerRecordCandidates(client, target, {
      policy,
      runId: batch.runId,
      batchId: batch.batchId,
      cutoff: batch.cutoff,
      items: batch.items,
      source: 'scan',
    });
    if (candidates.known.length > 0) await remoteBatchesKeep(client, { batchId: batch.batchId, policy, content: encodeBatch(batch) });
    return candidates;
  });
}

/**
 * The last step of a delivery. Operations still open: a short wait goes to a delay tier, a long
 * one is parked in the ledger (message acked; the sweeper sends the batch again when its turn is
 * near). All finished: the receipt (confirmations made by this batch's own claims) and the kept
 * message is forgotten.
 */
export async function endRemoteDelivery(args: {
  policy: AnyRemoteDeletePolicy;
  batch: BatchV1;
  context: HandlerContext;
  known: readonly string[];
  remaining: { open: number; due: number; ahead: number; nextInMs: number | null; confirmedByBatch: number };
  verdict: AdmissionVerdict;
  grantWaitMs: number;
  /** Operations per second admitted (keys/s for object storage). */
  rate: number;
  confirmed: number;
  detail: Record<string, number>;
}): Promise<BatchResult> {
  const { policy, batch, context, remaining, verdict, detail } = args;
  if (remaining.open > 0) {
    // When can this batch be admitted? Paused: unknown (the sweeper resumes it). Blocked: when the
    // block ends. Due operations: after the open ones ahead of it, at the admitted rate. Not due
    // (backoff, someone else's live lease): when the earliest is due.
    let waitMs: number;
    if (verdict === 'paused') waitMs = Infinity;
    else if (remaining.due > 0) waitMs = Math.max(args.grantWaitMs, verdict === 'blocked' ? 0 : (remaining.ahead / args.rate) * 1000);
    else waitMs = remaining.nextInMs ?? WAIT_IN_BROKER_MAX_MS + 1;
    if (waitMs <= WAIT_IN_BROKER_MAX_MS) {
      const delayMs = Math.max(waitMs, 100);
      context.log.debug({ ...detail, open: remaining.open, verdict, delayMs }, 'batch has open operations');
      return { kind: 'retry', delayMs, reason: `${remaining.open} operations open (${verdict})` };
    }
    // A long wait is kept in the ledger only: no message cycles meanwhile.
    const parked = await ledgerPark(context.pool, { keys: args.known, notBeforeMs: 0 });
    context.log.debug({ ...detail, open: remaining.open, verdict, parked, waitMs }, 'batch parked in the ledger');
    return { kind: 'done', deleted: args.confirmed, noop: 0, duplicate: false, detail: { ...detail, parked, open: remaining.open } };
  }
  // Every operation of the batch is finished: the receipt counts the confirmations made by this
  // batch's own claims, over all its deliveries (never those another batch made).
  const receiptWritten = await batchesRecordReceipt(context.pool, {
    batchId: batch.batchId,
    runId: batch.runId,
    policy: policy.name,
    items: batch.items.length,
    deleted: remaining.confirmedByBatch,
    workerId: context.workerId,
  });
  await remoteBatchesForget(context.pool, batch.batchId);
  return { kind: 'done', deleted: args.confirmed, noop: batch.items.length - args.confirmed, duplicate: !receiptWritten, detail };
}
