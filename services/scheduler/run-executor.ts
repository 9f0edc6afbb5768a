import type { Logger } from 'pino';
import type { Policy } from '../../shared/config/policies';
import { encodeBatch, makeBatchId, MAX_ID_LENGTH, type BatchV1 } from '../../shared/contracts/batch';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { Pool } from '../../shared/db/pool';
import { expiringRowsScanPage, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import { runsCompleteIfAllBatchesDone, runsMarkPublished, runsRecordProgress, type Run } from '../../shared/db/queries/runs';
import type { Metrics } from '../../shared/observability/metrics';

/** Batches built per window (one scan query); all are confirmed before progress is stored. */
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

interface Window {
  batches: Array<{ batch: BatchV1; content: Buffer; confirmed: boolean }>;
  candidates: number;
  cursor: Run['cursor'];
  reachedEnd: boolean;
}

/**
 * Scans a run's policy from its cursor with its frozen cutoff and publishes the candidates in
 * batches, a window at a time: scan up to CONFIRM_WINDOW pages, publish them, wait for every
 * confirm, then store the cursor, the counts and the ids of the confirmed batches. A failed publish
 * is retried with the SAME batch (same id, same rows) until confirmed; a scheduler killed at any
 * point is resumed from a cursor no later than what was confirmed, so batches may be published
 * twice (a duplicate is a no-op for workers), never skipped.
 */
export async function executeRun(deps: RunExecutorDeps, run: Run, policy: Policy, target: ResolvedTarget): Promise<RunOutcome> {
  const log = deps.log.child({ runId: run.runId, policy: run.policy, trigger: run.trigger, cutoff: run.cutoff });
  let checkpoint = { cursor: run.cursor, sequence: run.batchesConfirmed };
  log.info({ resumedFrom: run.cursor, claim: run.claimCount }, 'run scanning');
  for (;;) {
    if (deps.stopping()) return 'stopped';
    const window = await retrying(deps, log, 'scan', () => scanWindow(deps, run, policy, target, checkpoint));
    if (window === null) return 'stopped';
    if (window.batches.length > 0) {
      const confirmed = await retrying(deps, log, 'publish', () => publishUnconfirmed(deps, run, window));
      if (confirmed === null) return 'stopped';
      const stillOwner = await retrying(deps, log, 'checkpoint', () =>
        runsRecordProgress(deps.pool, {
          runId: run.runId,
          owner: deps.owner,
          cursor: window.cursor!,
          candidates: window.candidates,
          batchIds: window.batches.map((entry) => entry.batch.batchId),
          leaseMs: deps.leaseMs,
        }),
      );
      if (stillOwner === null) return 'stopped';
      if (!stillOwner) {
        log.warn('run lease lost to another scheduler; stopping this copy');
        return 'lost-lease';
      }
      deps.metrics.batchesPublishedTotal.inc({ policy: run.policy }, window.batches.length);
      deps.metrics.candidatesTotal.inc({ policy: run.policy }, window.candidates);
      checkpoint = { cursor: window.cursor, sequence: checkpoint.sequence + window.batches.length };
    }
    if (window.reachedEnd) break;
  }
  if (!(await runsMarkPublished(deps.pool, run.runId, deps.owner))) return 'lost-lease';
  await runsCompleteIfAllBatchesDone(deps.pool, run.runId);
  log.info({ batches: checkpoint.sequence }, 'run published');
  return 'published';
}

/** Runs `step` until it succeeds, backing off 0.5 s doubling to 10 s; null once shutting down. */
async function retrying<T>(deps: RunExecutorDeps, log: Logger, what: string, step: () => Promise<T>): Promise<T | null> {
  for (let failures = 0; ; failures++) {
    try {
      return await step();
    } catch (error) {
      if (deps.stopping()) return null;
      const delay = Math.min(10_000, 500 * 2 ** failures);
      log.warn({ err: (error as Error).message, retryInMs: delay }, `run ${what} failed; retrying`);
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}

/**
 * Scans the next CONFIRM_WINDOW pages after `from` in ONE query (a page per batch, cut in memory;
 * at most CONFIRM_WINDOW × batchSize rows held) and builds their batches; nothing is published yet.
 */
async function scanWindow(
  deps: RunExecutorDeps,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
  from: { cursor: Run['cursor']; sequence: number },
): Promise<Window> {
  const limit = policy.batchSize * CONFIRM_WINDOW;
  const rows = await expiringRowsScanPage(deps.pool, target, { cutoff: run.cutoff, after: from.cursor, limit });
  const window: Window = { batches: [], candidates: 0, cursor: from.cursor, reachedEnd: rows.length < limit };
  for (let start = 0; start < rows.length; start += policy.batchSize) {
    const page = rows.slice(start, start + policy.batchSize);
    const last = page[page.length - 1]!;
    window.cursor = { expiry: last.observedExpiry, key: last.id };
    const items = page.filter((item) => item.id.length <= MAX_ID_LENGTH);
    if (items.length < page.length) {
      // Such a key cannot travel in a message (docs/design.md: 1 MiB per message); say so loudly.
      deps.log.error({ runId: run.runId, skipped: page.length - items.length, maxIdLength: MAX_ID_LENGTH }, 'rows with over-long keys skipped');
    }
    if (items.length === 0) continue;
    const batch: BatchV1 = {
      version: 1,
      runId: run.runId,
      batchId: makeBatchId(run.runId, from.sequence + window.batches.length + 1, run.claimCount),
      policy: run.policy,
      cutoff: run.cutoff,
      items,
    };
    window.batches.push({ batch, content: encodeBatch(batch), confirmed: false });
    window.candidates += items.length;
  }
  return window;
}

/** Publishes every batch of the window not confirmed yet, and waits for all confirms; throws if any failed. */
async function publishUnconfirmed(deps: RunExecutorDeps, run: Run, window: Window): Promise<true> {
  const pending = window.batches.filter((entry) => !entry.confirmed);
  const results = await Promise.allSettled(
    pending.map(async (entry) => {
      await deps.publisher.publish(deps.names.workExchange, run.policy, entry.content, {
        messageId: entry.batch.batchId,
        contentType: 'application/json',
        headers: { 'x-run-id': run.runId },
      });
      entry.confirmed = true;
    }),
  );
  const failed = results.find((result): result is PromiseRejectedResult => result.status === 'rejected');
  if (failed) throw failed.reason;
  return true;
}
