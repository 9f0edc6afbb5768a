import type { Logger } from 'pino';
import { policyVersion, type Policy } from '../../shared/config/policies';
import { planCount } from '../../shared/db/queries/plan';
import { encodeBatch, makeBatchId, MAX_ID_LENGTH, MAX_MESSAGE_BYTES, type Batch, type BatchItem, type BatchV1, type BatchV2, type BatchVersion } from '../../shared/contracts/batch';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { Pool } from '../../shared/db/pool';
import { expiringRowsCountNonFinite, expiringRowsScanPage, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import {
  runClaimOf,
  runsCompleteIfAllBatchesDone,
  runsExtendLease,
  runsHoldForApproval,
  runsSetPolicyVersion,
  runsMarkFailed,
  runsMarkPublished,
  runsRecordProgress,
  type Run,
  type RunClaim,
} from '../../shared/db/queries/runs';
import type { Metrics } from '../../shared/observability/metrics';
import { failpoint } from '../../shared/testing/failpoints';
import { classifyRunError } from './run-errors';

/** Batches built per window (one scan query); all are confirmed before progress is stored. */
const CONFIRM_WINDOW = 32;
/** Backoff after a retryable error: 0.5 s doubling to 10 s. */
const RETRY_FIRST_MS = 500;
const RETRY_MAX_MS = 10_000;

export interface RunExecutorDeps {
  pool: Pool;
  publisher: ConfirmingPublisher;
  names: BrokerNames;
  owner: string;
  leaseMs: number;
  /** A run whose publishes stay unroutable this long fails (the work queue is gone). */
  unroutableFailAfterMs: number;
  log: Logger;
  metrics: Metrics;
  /** Set when the process is shutting down: stop at the next checkpoint. */
  stopping: () => boolean;
  /**
   * The batch version to publish the next window of `policy` in: REAPER_BATCH_VERSION, held at an
   * older one while a consumer that does not accept it is connected (batch-version-gate.ts).
   */
  batchVersion: (policy: string) => Promise<BatchVersion>;
}

export type RunOutcome = 'published' | 'failed' | 'lost-lease' | 'stopped' | 'awaiting-approval';

interface Window {
  batches: Array<{ batch: Batch; content: Buffer; confirmed: boolean }>;
  candidates: number;
  /** Rows read but not publishable (over-long keys): counted, and the cursor moves past them. */
  skipped: number;
  /** Rows the scan query returned: 0 means nothing after the cursor, and no checkpoint. */
  rowsRead: number;
  cursor: Run['cursor'];
  reachedEnd: boolean;
}

/** How a step ended once retries are over: its value, or why the run stops here. */
type Step<T> = { ok: true; value: T } | { ok: false; outcome: Exclude<RunOutcome, 'published'> };

interface RunContext {
  deps: RunExecutorDeps;
  log: Logger;
  claim: RunClaim;
  policy: string;
}

interface Progress {
  cursor: Run['cursor'];
  candidates: number;
  skipped: number;
  sequence: number;
}

/**
 * Scans a run's policy from its cursor with its frozen cutoff and publishes the candidates in
 * batches, a window at a time: scan up to CONFIRM_WINDOW pages, publish them, wait for every
 * confirm, then store the cursor, the counts and the ids of the confirmed batches. A failed publish
 * is retried with the SAME batch (same id, same rows) until confirmed; a scheduler killed at any
 * point is resumed from a cursor no later than what was confirmed, so batches may be published
 * twice (a duplicate is a no-op for workers), never skipped.
 *
 * Errors: a permanent one (run-errors.ts) fails the run with its reason; a retryable one is
 * retried with backoff while the lease is extended AND checked, so no other replica takes the run
 * over while this one is alive, and this one stops as soon as it learns the claim is lost.
 */
export async function executeRun(deps: RunExecutorDeps, run: Run, policy: Policy, target: ResolvedTarget): Promise<RunOutcome> {
  const log = deps.log.child({ runId: run.runId, policy: run.policy, trigger: run.trigger, cutoff: run.cutoff });
  const claim = runClaimOf(run, deps.owner);
  const attempt = <T>(what: string, step: () => Promise<T>) => retrying({ deps, log, claim, policy: run.policy }, what, step);
  let progress: Progress = { cursor: run.cursor, candidates: run.candidates, skipped: run.skipped, sequence: run.batchesConfirmed };
  log.info({ resumedFrom: run.cursor, claim: run.claimCount }, 'run scanning');
  const versioned = await attempt('record the policy version', () => runsSetPolicyVersion(deps.pool, claim, policyVersion(policy)));
  if (!versioned.ok) return versioned.outcome;
  if (brakeApplies(run, policy)) {
    // Counted BEFORE the first batch is published: an over-limit run never deletes anything.
    const braked = await attempt('count for the brake', () => applyBrake(deps, claim, run, policy, target));
    if (!braked.ok) return braked.outcome;
    if (braked.value !== 'go') {
      if (braked.value === 'lost-lease') return lostLease(log);
      log.warn({ candidates: braked.value.candidates, reason: braked.value.reason }, 'run over its limits: awaiting approval (reaper approve / reaper reject)');
      return 'awaiting-approval';
    }
  }
  for (;;) {
    if (deps.stopping()) return 'stopped';
    const scanned = await attempt('scan', () => scanWindow(deps, run, policy, target, progress));
    if (!scanned.ok) return scanned.outcome;
    const window = scanned.value;
    if (window.batches.length > 0) {
      const confirmed = await attempt('publish', () => publishUnconfirmed(deps, run, window));
      if (!confirmed.ok) return confirmed.outcome;
      failpoint('scheduler-after-confirm');
    }
    // Checkpoint every window that read rows, also one whose rows were all skipped: the cursor
    // must move past them, or the same window would be read again and again.
    if (window.rowsRead > 0) {
      const next: Progress = {
        cursor: window.cursor,
        candidates: progress.candidates + window.candidates,
        skipped: progress.skipped + window.skipped,
        sequence: progress.sequence + window.batches.length,
      };
      const recorded = await attempt('checkpoint', () =>
        runsRecordProgress(deps.pool, {
          claim,
          from: progress.cursor,
          cursor: next.cursor!,
          totals: { candidates: next.candidates, skipped: next.skipped, batchesConfirmed: next.sequence },
          batchIds: window.batches.map((entry) => entry.batch.batchId),
          leaseMs: deps.leaseMs,
        }),
      );
      if (!recorded.ok) return recorded.outcome;
      if (!recorded.value) return lostLease(log);
      failpoint('scheduler-after-checkpoint');
      deps.metrics.batchesPublishedTotal.inc({ policy: run.policy }, window.batches.length);
      deps.metrics.candidatesTotal.inc({ policy: run.policy }, window.candidates);
      if (window.skipped > 0) deps.metrics.rowsSkippedTotal.inc({ policy: run.policy }, window.skipped);
      progress = next;
    }
    if (window.reachedEnd) break;
  }
  const published = await attempt('mark published', () => runsMarkPublished(deps.pool, claim));
  if (!published.ok) return published.outcome;
  if (!published.value) return lostLease(log);
  log.info({ batches: progress.sequence, candidates: progress.candidates, skipped: progress.skipped }, 'run published');
  // Rows expiring at '-infinity' have no instant a batch could carry: the scan leaves them out (so
  // they never hold a batch back); say how many, so someone fixes the data.
  const nonFinite = await expiringRowsCountNonFinite(deps.pool, target).catch(() => 0); // a count for the log only
  if (nonFinite > 0) log.warn({ nonFinite }, "rows expiring at '-infinity' are never published: give them a real expiry");
  // The completion pass would find it too; this only makes a run with nothing to wait for final at once.
  await runsCompleteIfAllBatchesDone(deps.pool, run.runId).catch((error: Error) =>
    log.warn({ err: error.message }, 'completion check failed; the completion pass retries'),
  );
  return 'published';
}

/** The brake looks at a run that has not published anything yet, was not approved, and whose policy sets limits. */
function brakeApplies(run: Run, policy: Policy): boolean {
  const limits = policy.limits;
  return !!limits && (limits.maxPerRun !== undefined || limits.maxFractionPerRun !== undefined) && run.approvedAt === null && run.cursor === null && run.batchesConfirmed === 0;
}

/**
 * The blast-radius brake: counts what the scan would publish (the plan's predicate) and, when that
 * is more than `limits.maxPerRun` or more than `limits.maxFractionPerRun` of the rows satisfying
 * the guard, parks the run in 'awaiting-approval' with the count and the reason.
 */
async function applyBrake(
  deps: RunExecutorDeps,
  claim: RunClaim,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
): Promise<'go' | 'lost-lease' | { candidates: number; reason: string }> {
  const counts = await planCount(deps.pool, target, run.cutoff, { unrecordedFor: policy.kind === 'remote-delete' ? policy.name : undefined });
  const { maxPerRun, maxFractionPerRun } = policy.limits!;
  const reasons: string[] = [];
  if (maxPerRun !== undefined && counts.candidates > maxPerRun) reasons.push(`${counts.candidates} candidates > limits.maxPerRun ${maxPerRun}`);
  const fraction = counts.guarded > 0 ? counts.candidates / counts.guarded : 0;
  if (maxFractionPerRun !== undefined && fraction > maxFractionPerRun) {
    reasons.push(`${counts.candidates} of ${counts.guarded} guarded rows (${(fraction * 100).toFixed(1)}%) > limits.maxFractionPerRun ${maxFractionPerRun}`);
  }
  if (reasons.length === 0) return 'go';
  const hold = { candidates: counts.candidates, reason: `brake: ${reasons.join('; ')}` };
  if (!(await runsHoldForApproval(deps.pool, claim, hold))) return 'lost-lease';
  deps.metrics.runsAwaitingApprovalTotal.inc({ policy: policy.name });
  return hold;
}

function lostLease(log: Logger): 'lost-lease' {
  log.warn('run lease lost to another scheduler; stopping this copy');
  return 'lost-lease';
}

/**
 * Runs `step` until it succeeds. A permanent error fails the run (conditional on the claim) with
 * its reason; a retryable one backs off 0.5 s doubling to 10 s, extending the lease during the
 * wait and stopping as soon as an extension reports the claim lost. Unroutable publishes count as
 * permanent once they have lasted `unroutableFailAfterMs` without a break.
 */
async function retrying<T>(context: RunContext, what: string, step: () => Promise<T>): Promise<Step<T>> {
  const { deps, log, claim } = context;
  let unroutableSince: number | null = null;
  for (let failures = 0; ; failures++) {
    let classified;
    try {
      return { ok: true, value: await step() };
    } catch (error) {
      if (deps.stopping()) return { ok: false, outcome: 'stopped' };
      classified = classifyRunError(error);
    }
    if (classified.kind === 'retryable' && classified.persistent === 'unroutable') {
      unroutableSince ??= Date.now();
      if (Date.now() - unroutableSince >= deps.unroutableFailAfterMs) {
        classified = { kind: 'permanent', reason: `${classified.reason} for ${Math.round((Date.now() - unroutableSince) / 1000)} s (work queue deleted?)` };
      }
    } else {
      unroutableSince = null;
    }
    if (classified.kind === 'permanent') return { ok: false, outcome: await failRun(context, what, classified.reason) };
    const delay = Math.min(RETRY_MAX_MS, RETRY_FIRST_MS * 2 ** failures);
    log.warn({ err: classified.reason, retryInMs: delay }, `run ${what} failed; retrying`);
    const waited = await waitKeepingLease(deps, log, claim, delay);
    if (waited !== 'held') return { ok: false, outcome: waited };
  }
}

/**
 * Sleeps `delayMs` in slices of at most a third of the lease, extending the lease after each:
 * a replica waits out a retryable error without its run being taken over. An extension that fails
 * (the database is down too) is not a verdict: the next one, or the next checkpoint, decides.
 */
async function waitKeepingLease(deps: RunExecutorDeps, log: Logger, claim: RunClaim, delayMs: number): Promise<'held' | 'lost-lease' | 'stopped'> {
  const slice = Math.max(100, Math.min(500, Math.floor(deps.leaseMs / 3)));
  const extendEvery = Math.max(100, Math.floor(deps.leaseMs / 3));
  const until = Date.now() + delayMs;
  let extendedAt = 0;
  for (;;) {
    if (deps.stopping()) return 'stopped';
    if (Date.now() - extendedAt >= extendEvery || Date.now() >= until) {
      try {
        if (!(await runsExtendLease(deps.pool, claim, deps.leaseMs))) return lostLease(log);
        extendedAt = Date.now();
      } catch (error) {
        log.warn({ err: (error as Error).message }, 'run lease extension failed; retrying');
      }
    }
    const left = until - Date.now();
    if (left <= 0) return 'held';
    await new Promise((resolve) => setTimeout(resolve, Math.min(slice, left)));
  }
}

/** Ends the run as failed with `reason`, conditional on the claim; counted and logged at error. */
async function failRun({ deps, log, claim, policy }: RunContext, what: string, reason: string): Promise<'failed' | 'lost-lease'> {
  const error = `${what}: ${reason}`;
  try {
    if (!(await runsMarkFailed(deps.pool, claim, error))) return lostLease(log);
  } catch (markError) {
    // Not recorded: the lease runs out, a scheduler claims the run again and meets the same error.
    log.error({ err: (markError as Error).message, reason: error }, 'run failed permanently, but recording it failed');
    return 'lost-lease';
  }
  deps.metrics.runsFailedTotal.inc({ policy });
  log.error({ reason: error }, 'run failed');
  return 'failed';
}

/**
 * Scans the next CONFIRM_WINDOW pages after `from` in ONE query (a page per batch, cut in memory;
 * at most CONFIRM_WINDOW × batchSize rows held) and builds their batches; nothing is published yet.
 * Rows whose key is too long for a message are counted as skipped; the cursor moves past them.
 */
async function scanWindow(
  deps: RunExecutorDeps,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
  from: { cursor: Run['cursor']; sequence: number },
): Promise<Window> {
  const limit = policy.batchSize * CONFIRM_WINDOW;
  const rows = await expiringRowsScanPage(deps.pool, target, {
    cutoff: run.cutoff,
    after: from.cursor,
    limit,
    // remote-delete: items that already have an operation are the ledger's to carry, not the scan's
    unrecordedFor: policy.kind === 'remote-delete' ? policy.name : undefined,
  });
  const window: Window = { batches: [], candidates: 0, skipped: 0, rowsRead: rows.length, cursor: from.cursor, reachedEnd: rows.length < limit };
  // One version per window, chosen when it is built: a retried window publishes the same bytes.
  const version = rows.length > 0 ? await deps.batchVersion(run.policy) : 1;
  for (let start = 0; start < rows.length; start += policy.batchSize) {
    const page = rows.slice(start, start + policy.batchSize);
    const last = page[page.length - 1]!;
    window.cursor = { expiry: last.observedExpiry, key: last.id };
    const items = page.filter((item) => item.id.length <= MAX_ID_LENGTH);
    if (items.length < page.length) {
      // Such a key cannot travel in a message (docs/design.md: 1 MiB per message); say so loudly.
      deps.log.error({ runId: run.runId, skipped: page.length - items.length, maxIdLength: MAX_ID_LENGTH }, 'rows with over-long keys skipped');
      window.skipped += page.length - items.length;
    }
    for (const content of encodeWithinLimit(run, items, version, policyVersion(policy))) {
      const batch: Batch = { ...content, batchId: makeBatchId(run.runId, from.sequence + window.batches.length + 1, run.claimCount) };
      window.batches.push({ batch, content: encodeBatch(batch), confirmed: false });
      window.candidates += batch.items.length;
    }
  }
  return window;
}

/**
 * Cuts `items` into batches whose encoded message stays within MAX_MESSAGE_BYTES (workers
 * dead-letter a larger one as too-large): a page of long multi-byte or escaped keys can pass
 * 1 MiB below the item limit. Halves until each part fits; the batch id is set by the caller.
 */
/** A batch of either version before its id is given. */
type UnnumberedBatch = Omit<BatchV1, 'batchId'> | Omit<BatchV2, 'batchId'>;

function encodeWithinLimit(run: Run, items: readonly BatchItem[], version: BatchVersion, rule: string): UnnumberedBatch[] {
  if (items.length === 0) return [];
  const body = { runId: run.runId, policy: run.policy, cutoff: run.cutoff, items: [...items] };
  // Version 1 is written exactly as before version 2 existed; 2 adds the scan's policy version.
  const batch: UnnumberedBatch = version === 2 ? { version: 2, ...body, policyVersion: rule } : { version: 1, ...body };
  // The id is at most 200 characters (contract); measure with the longest one it can get.
  const size = encodeBatch({ ...batch, batchId: makeBatchId(run.runId, 999_999, run.claimCount) }).length;
  if (size <= MAX_MESSAGE_BYTES || items.length === 1) return [batch];
  const half = Math.ceil(items.length / 2);
  return [...encodeWithinLimit(run, items.slice(0, half), version, rule), ...encodeWithinLimit(run, items.slice(half), version, rule)];
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
      failpoint('scheduler-after-publish');
    }),
  );
  const failed = results.find((result): result is PromiseRejectedResult => result.status === 'rejected');
  if (failed) throw failed.reason;
  return true;
}
