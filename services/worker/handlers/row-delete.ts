import { overrideFor, rowAdmissionWith } from '../../../shared/admission/overrides';
import { outsideWindow } from '../window-gate';
import { admitRows, maxRowsPerStatement, noteRowStatement, takeRowSlot, untilRowSlot, type RowsRefused } from '../../../shared/admission/rows';
import { eventsEnabled, policyVersion, type RowDeletePolicy } from '../../../shared/config/policies';
import type { BatchV1 } from '../../../shared/contracts/batch';
import { ROW_DELETE_PLAN_CACHE_MODE, withTransaction } from '../../../shared/db/pool';
import { expiringRowsDeleteGroupIfStillExpired, type GroupBatchOutcome } from '../../../shared/db/queries/expiring-rows';
import type { ResolvedTarget } from '../../../shared/db/queries/target';
import { classifyHandlerError } from '../errors';
import { makeOutboxLimitCheck, OUTBOX_FULL_REASON, outboxFullRetryMs } from '../outbox-limit';
import type { BatchResult } from '../results';
import type { BatchHandler, HandlerContext } from './types';

/**
 * Longest a message waits in the worker, counted from its delivery (time queued in the coalescer
 * included), for the throttle, the brake or a slot, before its batch goes to a delay tier: one
 * budget for the whole group, not one per chunk (docs/design.md invariant 18).
 */
export const ROW_ADMISSION_HOLD_MS = 5_000;

export interface GroupContext extends HandlerContext {
  stopping?: () => boolean;
  /** performance.now() when the group's oldest message was delivered; the hold budget counts from it. */
  heldSince?: number;
}

/** Handles several batches of one policy together; one result per batch, in the order given. */
export type BatchGroupHandler = (batches: readonly BatchV1[], context: GroupContext) => Promise<BatchResult[]>;

/**
 * row-delete, coalesced: the batches a worker has in hand for one policy (within its prefetch) go
 * to the database as ONE statement (expiringRowsDeleteGroupIfStillExpired: the conditional DELETE
 * over all their items, one receipt per batch, the audit rows) in one transaction; each message is
 * acked after that commit (the consumer settles each batch with its own result). The database
 * decides what is still expired; a renewed or confirmed row is a no-op.
 *
 *  - A batch id seen twice in one group is a duplicate delivery: the statement runs for the first,
 *    the second is a counted duplicate no-op.
 *  - If the combined statement fails, the batches run again one by one (each its own statement
 *    and transaction), so one bad batch (say, a key that is not a uuid) never poisons the others.
 *  - Throttle: the group takes tokens for its item count from the policy's global bucket and a
 *    statement slot as the first step of its transaction (shared/admission/rows.ts); a group that
 *    cannot be admitted within ROW_ADMISSION_HOLD_MS of its oldest message's delivery goes to a
 *    delay tier (acked after that publish).
 *
 * Every group runs in an explicit transaction, the same code whether a failpoint is armed or not:
 * BEGIN, the slot, the statement, COMMIT. With coalescing, its two extra round trips are paid once
 * per group, not per batch. No slot free: the transaction ends at once and the wait for the next
 * try happens outside any transaction (untilRowSlot).
 */
export function makeRowDeleteGroupHandler(policy: RowDeletePolicy, target: ResolvedTarget): BatchGroupHandler {
  const audit = policy.audit?.enabled ? { policyVersion: policyVersion(policy) } : null;
  const archive = policy.archive?.enabled ? { policyVersion: policyVersion(policy) } : null;
  const events = eventsEnabled(policy) ? { policyVersion: policyVersion(policy) } : null;
  const outboxLimit = makeOutboxLimitCheck(policy);

  async function runInTransaction(batches: readonly BatchV1[], context: GroupContext, concurrency: number | null, holdUntil: number): Promise<GroupBatchOutcome[] | 'no-slot'> {
    let slotTakenAt = 0;
    const outcome = await untilRowSlot(
      () =>
        withTransaction(
          context.pool,
          async (client) => {
            if (!(await takeRowSlot(client, policy.name, concurrency))) return 'no-slot' as const;
            slotTakenAt = performance.now();
            return expiringRowsDeleteGroupIfStillExpired(client, target, {
              policy: policy.name,
              batches: batches.map((batch) => ({ batchId: batch.batchId, runId: batch.runId, cutoff: batch.cutoff, items: batch.items })),
              workerId: context.workerId,
              audit,
              archive,
              events,
            });
          },
          // Between the statement and COMMIT: a crash here loses the transaction, never half of it.
          // Its generic plan, deterministically (shared/db/pool.ts ROW_DELETE_PLAN_CACHE_MODE).
          { beforeCommit: () => context.failpoint('before-commit'), planCacheMode: ROW_DELETE_PLAN_CACHE_MODE },
        ),
      { until: holdUntil, stopping: context.stopping },
    );
    if (outcome === 'no-slot') return outcome;
    // Adaptive admission judges the database by how long its deleting statement and COMMIT take (slot waits excluded).
    noteRowStatement(context.pool, policy, { ms: performance.now() - slotTakenAt, rows: batches.reduce((sum, batch) => sum + batch.items.length, 0) });
    context.failpoint('after-commit');
    outboxLimit.deleted(outcome.batches.reduce((sum, batch) => sum + batch.deleted, 0));
    for (const lag of outcome.lagSeconds) context.metrics.deletionLagSeconds.observe({ policy: policy.name }, lag);
    return outcome.batches;
  }

  const resultOf = (batch: BatchV1, outcome: GroupBatchOutcome): BatchResult => ({
    kind: 'done',
    deleted: outcome.deleted,
    noop: batch.items.length - outcome.deleted,
    duplicate: !outcome.receiptWritten,
  });

  return async (batches, context) => {
    const holdUntil = (context.heldSince ?? performance.now()) + ROW_ADMISSION_HOLD_MS;
    const results: Array<BatchResult | undefined> = new Array(batches.length);
    // Distinct batch ids, first occurrence runs; a repeat in the same group is a duplicate no-op.
    const firstIndex = new Map<string, number>();
    batches.forEach((batch, index) => {
      if (firstIndex.has(batch.batchId)) results[index] = { kind: 'done', deleted: 0, noop: batch.items.length, duplicate: true };
      else firstIndex.set(batch.batchId, index);
    });
    // Expiry events: past the outbox limit the policy deletes nothing until the relay catches up.
    if (await outboxLimit.over(context.pool)) {
      context.log.warn({ policy: policy.name, maxOutbox: policy.events?.maxOutbox }, 'expiry-event outbox over its limit: deletions paused, batches go to a delay tier');
      for (const index of firstIndex.values()) results[index] = { kind: 'retry', delayMs: outboxFullRetryMs(), reason: OUTBOX_FULL_REASON };
      return results.map((result) => result!);
    }
    // Throttled: a group takes at most one bucket (the burst) or one batch, so any second sees at
    // most the rate plus one batch; unthrottled, the whole group goes as one statement (adaptive: maxRowsPerStatement).
    const inForce = rowAdmissionWith(policy, await overrideFor(context.pool, policy.name));
    const maxRows = maxRowsPerStatement(context.pool, policy, inForce);
    const chunks: BatchV1[][] = [];
    let rowsInChunk = 0;
    for (const index of firstIndex.values()) {
      const batch = batches[index]!;
      const last = chunks[chunks.length - 1];
      if (last && rowsInChunk + batch.items.length <= maxRows) {
        last.push(batch);
        rowsInChunk += batch.items.length;
      } else {
        chunks.push([batch]);
        rowsInChunk = batch.items.length;
      }
    }
    for (const [i, chunk] of chunks.entries()) {
      const refused = await runChunk(chunk, firstIndex, results, context, holdUntil);
      if (refused) {
        // The rest of the group goes back with it, unasked: the bucket that just refused one chunk
        // has not refilled for the next a moment later, and every ask is a write and a commit on
        // the application's database (a group of 16 one-batch chunks whose hold was spent asked 16
        // times in a few ms; at 500 rows/s, 903 asks a minute for 65 statements, 247 with this and
        // the turns in admitRows: bench figure 7's statement log, docs/design.md).
        for (const batch of chunks.slice(i + 1).flat()) results[firstIndex.get(batch.batchId)!] = later(refused.reason, refused.retryInMs);
        break;
      }
    }
    return results.map((result) => result!);
  };

  async function runChunk(
    unique: BatchV1[],
    firstIndex: ReadonlyMap<string, number>,
    results: Array<BatchResult | undefined>,
    context: GroupContext,
    holdUntil: number,
  ): Promise<RowsRefused | null> {
    const rows = unique.reduce((sum, batch) => sum + batch.items.length, 0);

    // What is left of the group's budget: a later chunk asks once more, it does not wait afresh.
    const holdMs = Math.max(0, holdUntil - performance.now());
    const admitted = await admitRows(context.pool, policy, rows, { holdMs, registry: context.metrics.registry, ...(context.stopping ? { stopping: context.stopping } : {}) });
    if (!admitted.admitted) {
      context.log.info({ reason: admitted.reason, batches: unique.length, rows, waitedMs: Math.round(admitted.waitedMs) }, 'row-delete not admitted in time; batches go to a delay tier');
      for (const batch of unique) results[firstIndex.get(batch.batchId)!] = later(admitted.reason, admitted.retryInMs);
      return admitted;
    }
    // Admission may have waited (up to the group's hold): the schedule window may have closed
    // meanwhile. Nothing is deleted past its end (issue 40); the batches wait for the opening.
    const closed = outsideWindow(policy, new Date());
    if (closed) {
      for (const batch of unique) results[firstIndex.get(batch.batchId)!] = closed;
      return null;
    }
    const concurrency = admitted.admission.concurrency;

    let combined: GroupBatchOutcome[] | 'no-slot' | Error;
    try {
      combined = await runInTransaction(unique, context, concurrency, holdUntil);
    } catch (error) {
      combined = error instanceof Error ? error : new Error(String(error));
    }
    if (combined === 'no-slot') {
      for (const batch of unique) results[firstIndex.get(batch.batchId)!] = later('concurrency', 1_000);
    } else if (!(combined instanceof Error)) {
      unique.forEach((batch, i) => (results[firstIndex.get(batch.batchId)!] = resultOf(batch, combined[i]!)));
    } else if (unique.length === 1 || isUnavailable(classifyHandlerError(combined))) {
      // One batch, or the database itself is unreachable (one by one would fail the same way).
      for (const batch of unique) results[firstIndex.get(batch.batchId)!] = classifyHandlerError(combined);
    } else {
      // One bad batch must not poison the others: each alone, in turn, with its own outcome.
      context.log.warn({ err: combined.message, batches: unique.length }, 'coalesced delete failed; retrying its batches one by one');
      for (const batch of unique) {
        const index = firstIndex.get(batch.batchId)!;
        try {
          const alone = await runInTransaction([batch], context, concurrency, holdUntil);
          results[index] = alone === 'no-slot' ? later('concurrency', 1_000) : resultOf(batch, alone[0]!);
        } catch (error) {
          results[index] = classifyHandlerError(error);
        }
      }
    }
    return null;
  }
}

/** Handed back to a delay tier, to be tried again in `delayMs`. */
const later = (reason: string, delayMs: number): BatchResult => ({ kind: 'retry', delayMs, reason });

const isUnavailable = (result: BatchResult): boolean => result.kind === 'unknown' && result.databaseUnavailable;

/** One batch at a time (a group of one): for callers that hold a single delivery. */
export function makeRowDeleteHandler(policy: RowDeletePolicy, target: ResolvedTarget): BatchHandler {
  const group = makeRowDeleteGroupHandler(policy, target);
  return async (batch, context) => (await group([batch], context))[0]!;
}
