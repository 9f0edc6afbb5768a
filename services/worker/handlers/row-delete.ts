import { overrideFor, rowAdmissionWith } from '../../../shared/admission/overrides';
import { ADAPTIVE } from '../../../shared/admission/adaptive';
import { admitRows, maxRowsPerStatement, noteRowStatement, takeRowSlot, untilRowSlot, type RowsRefused } from '../../../shared/admission/rows';
import { eventsEnabled, policyVersion, type RowDeletePolicy } from '../../../shared/config/policies';
import type { BatchV1 } from '../../../shared/contracts/batch';
import { ROW_DELETE_PLAN_CACHE_MODE, withTransaction } from '../../../shared/db/pool';
import { expiringRowsDeleteGroupIfStillExpired, type GroupBatchOutcome, type ResolvedTarget } from '../../../shared/db/queries/expiring-rows';
import { classifyHandlerError } from '../errors';
import { makeOutboxLimitCheck, OUTBOX_FULL_REASON, OUTBOX_FULL_RETRY_MS } from '../outbox-limit';
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

  async function runInTransaction(batches: readonly Piece['batch'][], context: GroupContext, concurrency: number | null, holdUntil: number): Promise<GroupBatchOutcome[] | 'no-slot'> {
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
              batches: batches.map((batch) => ({ batchId: batch.batchId, messageBatchId: batch.messageBatchId, runId: batch.runId, cutoff: batch.cutoff, items: batch.items })),
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
      for (const index of firstIndex.values()) results[index] = { kind: 'retry', delayMs: OUTBOX_FULL_RETRY_MS, reason: OUTBOX_FULL_REASON };
      return results.map((result) => result!);
    }
    // Throttled: a group takes at most one bucket (the burst) or one batch, so any second sees at
    // most the rate plus one batch; unthrottled, the whole group goes as one statement (adaptive:
    // maxRowsPerStatement, and a batch bigger than that goes in parts).
    const inForce = rowAdmissionWith(policy, await overrideFor(context.pool, policy.name));
    const maxRows = maxRowsPerStatement(context.pool, policy, inForce);
    const pieces: Piece[] = [...firstIndex.values()].flatMap((index) =>
      inForce.rowsPerSecond === null && batches[index]!.items.length > maxRows ? partsOf(batches[index]!, index) : [{ batch: batches[index]!, index }],
    );
    const chunks: Piece[][] = [];
    let rowsInChunk = 0;
    for (const piece of pieces) {
      const last = chunks[chunks.length - 1];
      if (last && rowsInChunk + piece.batch.items.length <= maxRows) {
        last.push(piece);
        rowsInChunk += piece.batch.items.length;
      } else {
        chunks.push([piece]);
        rowsInChunk = piece.batch.items.length;
      }
    }
    const outcomes = new Map<Piece, BatchResult>();
    for (const [i, chunk] of chunks.entries()) {
      // A part runs only if every earlier part of its batch committed: the last part carries the
      // batch's own id, whose receipt tells the run that the whole batch is done.
      const runnable: Piece[] = [];
      for (const piece of chunk) {
        const failed = earlierFailure(piece, pieces, outcomes);
        if (failed) outcomes.set(piece, failed);
        else runnable.push(piece);
      }
      const refused = runnable.length > 0 ? await runChunk(runnable, outcomes, context, holdUntil) : null;
      if (refused) {
        // The rest of the group goes back with it, unasked: the bucket that just refused one chunk
        // has not refilled for the next a moment later, and every ask is a write and a commit on
        // the application's database (a group of 16 one-batch chunks whose hold was spent asked 16
        // times in a few ms; at 500 rows/s, 903 asks a minute for 65 statements, 247 with this and
        // the turns in admitRows: bench figure 7's statement log, docs/design.md).
        for (const piece of chunks.slice(i + 1).flat()) outcomes.set(piece, later(refused.reason, refused.retryInMs));
        break;
      }
    }
    for (const index of firstIndex.values()) {
      results[index] = resultOfParts(batches[index]!, pieces.filter((piece) => piece.index === index).map((piece) => outcomes.get(piece)!));
    }
    return results.map((result) => result!);
  };

  /** Runs one chunk (a statement's worth of pieces) and records an outcome for each piece; the refusal when admission said no. */
  async function runChunk(chunk: Piece[], outcomes: Map<Piece, BatchResult>, context: GroupContext, holdUntil: number): Promise<RowsRefused | null> {
    const rows = chunk.reduce((sum, piece) => sum + piece.batch.items.length, 0);

    // What is left of the group's budget: a later chunk asks once more, it does not wait afresh.
    const holdMs = Math.max(0, holdUntil - performance.now());
    const admitted = await admitRows(context.pool, policy, rows, { holdMs, registry: context.metrics.registry, ...(context.stopping ? { stopping: context.stopping } : {}) });
    if (!admitted.admitted) {
      context.log.info({ reason: admitted.reason, batches: chunk.length, rows, waitedMs: Math.round(admitted.waitedMs) }, 'row-delete not admitted in time; batches go to a delay tier');
      for (const piece of chunk) outcomes.set(piece, later(admitted.reason, admitted.retryInMs));
      return admitted;
    }
    const concurrency = admitted.admission.concurrency;

    let combined: GroupBatchOutcome[] | 'no-slot' | Error;
    try {
      combined = await runInTransaction(chunk.map((piece) => piece.batch), context, concurrency, holdUntil);
    } catch (error) {
      combined = error instanceof Error ? error : new Error(String(error));
    }
    if (combined === 'no-slot') {
      for (const piece of chunk) outcomes.set(piece, later('concurrency', 1_000));
    } else if (!(combined instanceof Error)) {
      chunk.forEach((piece, i) => outcomes.set(piece, resultOf(piece.batch, combined[i]!)));
    } else if (chunk.length === 1 || isUnavailable(classifyHandlerError(combined))) {
      // One batch, or the database itself is unreachable (one by one would fail the same way).
      for (const piece of chunk) outcomes.set(piece, classifyHandlerError(combined));
    } else {
      // One bad batch must not poison the others: each alone, in turn, with its own outcome (a
      // part after a failed part of its batch is not run).
      context.log.warn({ err: combined.message, batches: chunk.length }, 'coalesced delete failed; retrying its batches one by one');
      for (const piece of chunk) {
        const failed = earlierFailure(piece, chunk, outcomes);
        if (failed) {
          outcomes.set(piece, failed);
          continue;
        }
        try {
          const alone = await runInTransaction([piece.batch], context, concurrency, holdUntil);
          outcomes.set(piece, alone === 'no-slot' ? later('concurrency', 1_000) : resultOf(piece.batch, alone[0]!));
        } catch (error) {
          outcomes.set(piece, classifyHandlerError(error));
        }
      }
    }
    return null;
  }
}

/**
 * A batch, or one part of a batch bigger than the statement size in force; `index` is its
 * message's place in the group. A part is a GroupBatch of its own (own receipt), of the same run
 * and cutoff.
 */
interface Piece {
  batch: BatchV1 & { messageBatchId?: string };
  index: number;
}

/**
 * A batch in parts of ADAPTIVE.statementPartRows items, in order: each part its own receipt id
 * (`<batch id>~p<n>`) but the last, which keeps the batch's own id, so the run counts the batch
 * done (cleanup_run_batches) only once every part has committed. The split depends only on the
 * batch, so every delivery of it splits it the same way: a redelivery after a crash between two
 * parts finds the committed parts' receipts (duplicates, nothing deleted twice) and deletes the
 * rest. The audit, archive and outbox rows carry the batch's own id (messageBatchId).
 */
export function partsOf(batch: BatchV1, index: number): Piece[] {
  const size = ADAPTIVE.statementPartRows;
  const count = Math.ceil(batch.items.length / size);
  return Array.from({ length: count }, (_, n) => ({
    batch: {
      ...batch,
      batchId: n === count - 1 ? batch.batchId : `${batch.batchId}~p${n + 1}`,
      messageBatchId: batch.batchId,
      items: batch.items.slice(n * size, (n + 1) * size),
    },
    index,
  }));
}

/** The outcome of an earlier part of the piece's batch that did not commit, if any: the piece shares it. */
function earlierFailure(piece: Piece, among: readonly Piece[], outcomes: ReadonlyMap<Piece, BatchResult>): BatchResult | null {
  for (const other of among) {
    if (other === piece) return null;
    const outcome = outcomes.get(other);
    if (other.index === piece.index && outcome && outcome.kind !== 'done') return outcome;
  }
  return null;
}

/**
 * One batch's result from its parts' (one part: its own). Every part committed: done, duplicate only
 * if every part was. Otherwise the first part's that did not commit (the message is delayed,
 * redelivered or dead-lettered; the parts that committed are duplicates then); a delay counts
 * the rows its committed parts deleted (deletedBefore), which no later delivery counts again.
 */
function resultOfParts(batch: BatchV1, parts: readonly BatchResult[]): BatchResult {
  if (parts.length === 1) return parts[0]!;
  let deleted = 0;
  for (const part of parts) {
    if (part.kind === 'done') {
      deleted += part.deleted;
      continue;
    }
    return part.kind === 'retry' && deleted > 0 ? { ...part, deletedBefore: deleted } : part;
  }
  return { kind: 'done', deleted, noop: batch.items.length - deleted, duplicate: parts.every((part) => part.kind === 'done' && part.duplicate) };
}

/** Handed back to a delay tier, to be tried again in `delayMs`. */
const later = (reason: string, delayMs: number): BatchResult => ({ kind: 'retry', delayMs, reason });

const isUnavailable = (result: BatchResult): boolean => result.kind === 'unknown' && result.databaseUnavailable;

/** One batch at a time (a group of one): for callers that hold a single delivery. */
export function makeRowDeleteHandler(policy: RowDeletePolicy, target: ResolvedTarget): BatchHandler {
  const group = makeRowDeleteGroupHandler(policy, target);
  return async (batch, context) => (await group([batch], context))[0]!;
}
