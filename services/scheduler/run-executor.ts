import type { Logger } from 'pino';
import type { Policy } from '../../shared/config/policies';
import { encodeBatch, makeBatchId, MAX_ID_LENGTH, type BatchV1 } from '../../shared/contracts/batch';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { Pool } from '../../shared/db/pool';
import { expiringRowsScanPage, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import {
  runsCompleteIfAllBatchesDone,
  runsMarkPublished,
  runsRecordProgress,
  type Run,
} from '../../shared/db/queries/runs';
import type { Metrics } from '../../shared/observability/metrics';

/** Batches published before waiting for their confirms and recording progress. */
const CONFIRM_WINDOW = 32;

export interface RunExecutorDeps {
  pool: Pool;
  publisher: ConfirmingPublisher;
  names: BrokerNames;
  owner: string;
  leaseMs: number;
  log: Logger;
  metrics: Metrics;
  /** Set when the process is shutting down: stop at the next checkpoint. */
  stopping: () => boolean;
}

export type RunOutcome = 'published' | 'lost-lease' | 'stopped';

/**
 * Scans a run's policy from its cursor with its frozen cutoff and publishes the candidates in
 * batches. Progress (cursor, counts) is stored only after the broker confirmed every batch up to
 * the cursor, so a scheduler killed at any point resumes from a cursor no later than what was
 * confirmed: batches may be published twice (a duplicate is a no-op for workers), never skipped.
 * A failed publish or query retries from the last checkpoint after a backoff.
 */
export async function executeRun(deps: RunExecutorDeps, run: Run, policy: Policy, target: ResolvedTarget): Promise<RunOutcome> {
  const log = deps.log.child({ runId: run.runId, policy: run.policy, trigger: run.trigger, cutoff: run.cutoff });
  let checkpoint = { cursor: run.cursor, sequence: run.batchesConfirmed };
  let failures = 0;
  log.info({ resumedFrom: run.cursor }, 'run scanning');
  for (;;) {
    if (deps.stopping()) return 'stopped';
    try {
      const step = await publishWindow(deps, run, policy, target, checkpoint);
      if (step.batches > 0) {
        const stillOwner = await runsRecordProgress(deps.pool, {
          runId: run.runId,
          owner: deps.owner,
          cursor: step.cursor!,
          candidates: step.candidates,
          batches: step.batches,
          leaseMs: deps.leaseMs,
        });
        if (!stillOwner) {
          log.warn('run lease lost to another scheduler; stopping this copy');
          return 'lost-lease';
        }
        deps.metrics.batchesPublishedTotal.inc({ policy: run.policy }, step.batches);
        deps.metrics.candidatesTotal.inc({ policy: run.policy }, step.candidates);
        checkpoint = { cursor: step.cursor, sequence: checkpoint.sequence + step.batches };
        failures = 0;
      }
      if (step.reachedEnd) break;
    } catch (error) {
      failures += 1;
      const delay = Math.min(10_000, 250 * 2 ** failures);
      log.warn({ err: (error as Error).message, retryInMs: delay }, 'run step failed; retrying from the last checkpoint');
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
  if (!(await runsMarkPublished(deps.pool, run.runId, deps.owner))) return 'lost-lease';
  await runsCompleteIfAllBatchesDone(deps.pool, run.runId);
  log.info({ batches: checkpoint.sequence }, 'run published');
  return 'published';
}

/**
 * Scans and publishes up to CONFIRM_WINDOW pages from `from`, then waits for every confirm.
 * Throws if any publish failed (the caller retries the whole window).
 */
async function publishWindow(
  deps: RunExecutorDeps,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
  from: { cursor: Run['cursor']; sequence: number },
): Promise<{ batches: number; candidates: number; cursor: Run['cursor']; reachedEnd: boolean }> {
  const confirms: Array<Promise<void>> = [];
  let cursor = from.cursor;
  let candidates = 0;
  let reachedEnd = false;
  try {
    await scanAndPublish();
  } catch (error) {
    await Promise.allSettled(confirms); // nothing left dangling; the window is retried whole
    throw error;
  }
  const results = await Promise.allSettled(confirms);
  const failed = results.find((result): result is PromiseRejectedResult => result.status === 'rejected');
  if (failed) throw failed.reason;
  return { batches: confirms.length, candidates, cursor, reachedEnd };

  async function scanAndPublish(): Promise<void> {
  while (confirms.length < CONFIRM_WINDOW) {
    const page = await expiringRowsScanPage(deps.pool, target, { cutoff: run.cutoff, after: cursor, limit: policy.batchSize });
    if (page.length === 0) {
      reachedEnd = true;
      break;
    }
    const last = page[page.length - 1]!;
    cursor = { expiry: last.observedExpiry, key: last.id };
    const items = page.filter((item) => item.id.length <= MAX_ID_LENGTH);
    if (items.length < page.length) {
      // Such a key cannot travel in a message (DESIGN.md: 1 MiB per message); say so loudly.
      deps.log.error({ skipped: page.length - items.length, maxIdLength: MAX_ID_LENGTH }, 'rows with over-long keys skipped');
    }
    if (items.length === 0) continue;
    const sequence = from.sequence + confirms.length + 1;
    const batch: BatchV1 = {
      version: 1,
      runId: run.runId,
      batchId: makeBatchId(run.runId, sequence),
      policy: run.policy,
      cutoff: run.cutoff,
      items,
    };
    confirms.push(
      deps.publisher.publish(deps.names.workExchange, run.policy, encodeBatch(batch), {
        messageId: batch.batchId,
        contentType: 'application/json',
        headers: { 'x-run-id': run.runId },
      }),
    );
    candidates += items.length;
    if (page.length < policy.batchSize) {
      reachedEnd = true;
      break;
    }
  }
  }
}
