import type { Logger } from 'pino';
import { DEFAULT_APPROVAL_TOLERANCE, policyVersion, retiresPartitions, type Policy } from '../../shared/config/policies';
import { retirePartitions } from './partition-retirement';
import { planBrakeCount } from '../../shared/db/queries/plan';
import { batchBytesAtMost, encodeBatch, makeBatchId, MAX_ID_LENGTH, MAX_MESSAGE_BYTES, type Batch, type BatchItem, type BatchV1, type BatchV2, type BatchVersion } from '../../shared/contracts/batch';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { Pool } from '../../shared/db/pool';
import { expiringRowsCountNonFinite, expiringRowsScanPage } from '../../shared/db/queries/expiring-rows';
import type { ResolvedTarget } from '../../shared/db/queries/target';
import {
  runClaimOf,
  runsCompleteIfAllBatchesDone,
  runsExtendLease,
  runsBeginWindow,
  runsHoldForApproval,
  runsRecordCount,
  runsSetPolicyVersion,
  runsMarkFailed,
  runsEarlierWithUndeliveredBatches,
  runsMarkPublished,
  runsRecordProgress,
  type Run,
  type RunClaim,
  UNDELIVERED_COUNT_CAP,
} from '../../shared/db/queries/runs';
import type { Metrics } from '../../shared/observability/metrics';
import { failpoint } from '../../shared/observability/failpoint-hook';
import { testTimings } from '../../shared/config/test-timings';
import { classifyRunError } from './run-errors';
import { windowStateAt } from '../../shared/schedule/window';

/** Batches built per window (one scan query); all are confirmed before progress is stored. */
const CONFIRM_WINDOW = 32;
/**
 * remote-delete: a new scheduled run (cron, catch-up) publishes nothing while an earlier run of the policy, published at most
 * this long ago, still has batches no worker has received (issue 43, the chaos stall). They carry
 * the same unrecorded items the scan would find, and copying them into a queue that is already
 * behind is what made its delay, and its inflow, grow together. Bounded so that a batch lost for
 * good (a purged queue) holds back new runs for this long at most; runs that end `incomplete` stop
 * holding them back at once.
 */
export const CARRIED_BY_BROKER_MAX_MS = 10 * 60_000;
/**
 * Pacing (deps.paceBy): while the policy's workers are admitted at an adaptive rate, the run
 * publishes at most this far (in seconds of that rate) ahead of what they may delete, in windows of
 * about that many rows, so the scan's work on the database is spread over the run like the
 * deletion's instead of all at its start.
 */
const PACE_AHEAD_SECONDS = 2;
/** While ahead, the rate is read again this often (it may rise, or stop being in force). */
const PACE_POLL_MS = 1_000;
/** While a run's first window waits for its workers' first take (PaceSource.firstTake), the pace is read this often. */
const PACE_FIRST_POLL_MS = 50;
/** Backoff after a retryable error: 0.5 s doubling to 10 s (a test may lower the cap: REAPER_TEST_RUN_RETRY_MAX_MS). */
const RETRY_FIRST_MS = 500;
export const RETRY_MAX_MS = 10_000;

/** The steps of a run, in the order a window reaches them (what `beforeStep` is told). */
export type RunStep = 'count' | 'partition-detach' | 'scan' | 'publish' | 'checkpoint';

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
  /**
   * Told the run's total (published + still to publish, bounded) when the executor counts it: the
   * CLI's progress bar uses this count instead of making its own. Set, it also makes a run without
   * limits count once.
   */
  onCounted?: (total: number) => void;
  /** Batches per window (default 32). The run model test makes windows small. */
  windowBatches?: number;
  /** Awaited before each step: the run model test interleaves other commands there. */
  beforeStep?: (step: RunStep) => Promise<void>;
  /** The clock a policy's schedule window is read with (default: this process's). */
  now?: () => Date;
  /**
   * Pacing (issues 18, 41), for a row-delete policy with a rate: how to read the rows/s its workers
   * are admitted at now (a fixed rate, or the adaptive one while in force). Null or absent: every
   * window is published at once. See paceWindow.
   */
  paceBy?: (policy: Policy) => PaceSource | null;
}

/** One read of a run's pace, before a window. */
export interface PaceReading {
  /** The rows/s the policy's workers are admitted at now; null when no rate is in force (adaptive: alone, or nobody stepped it lately). */
  rate: number | null;
  /** Adaptive: a stamp of the policy's last admission take (null: none yet); a different one means a worker took since. */
  lastTakeAt?: string | null;
  /** Adaptive: whether that take's own sample saw another client on the database. */
  lastTakeSawOthers?: boolean | null;
}

/**
 * How a policy's runs are paced: `read` before each window. `firstTake` (adaptive policies): with no
 * rate in force at a run's start nothing is known yet of the others, so the run's first window is
 * PACE_AHEAD_SECONDS of `rowsPerSecond` (the law's floor: what the workers start at when their look
 * finds the database busy) and the scheduler waits, at most `withinMs`, for a take after it
 * (paceWindow).
 */
export interface PaceSource {
  read: () => Promise<PaceReading>;
  firstTake: { rowsPerSecond: number; withinMs: number } | null;
}

/**
 * 'window-closed': the policy's schedule window closed; the run stopped at a batch boundary with its
 * cursor checkpointed and continues, with its original cutoff, when a scheduler claims it in the next window.
 */
export type RunOutcome = 'published' | 'failed' | 'lost-lease' | 'stopped' | 'awaiting-approval' | 'window-closed';

/**
 * A batch ready to publish: its id and its encoded message, nothing else. The items are not kept
 * once encoded: a window's rows then die young (before the window's publish and checkpoint round
 * trips), instead of surviving into the old generation every window, which grew the scheduler's
 * peak RSS with the length of the run (issue 18).
 */
interface Encoded {
  batchId: string;
  content: Buffer;
  confirmed: boolean;
}

/** One page of the scan: a batch's worth of rows (more than one batch when a message would be too large). */
interface Page {
  batches: Encoded[];
  candidates: number;
  /** Rows read but not publishable (over-long keys): counted, and the cursor moves past them. */
  skipped: number;
  rows: number;
  cursor: NonNullable<Run['cursor']>;
}

interface Window {
  batches: Encoded[];
  candidates: number;
  skipped: number;
  /** Rows the scan query returned: 0 means nothing after the cursor, and no checkpoint. */
  rowsRead: number;
  cursor: Run['cursor'];
  reachedEnd: boolean;
}

/** How a step ended once retries are over: its value, or why the run stops here. */
type Step<T> = { ok: true; value: T } | { ok: false; outcome: Exclude<RunOutcome, 'published' | 'window-closed'> };

interface RunContext {
  deps: RunExecutorDeps;
  log: Logger;
  claim: RunClaim;
  policy: string;
  lease: LeaseKeeper;
}

/** A claim's pacing so far: when the rows it published at a known rate would all be admitted. */
interface Pace {
  readonly source: PaceSource | null;
  /** When the rows published at a known rate would all be admitted (ms, this process's clock). */
  dueAt: number;
  /** The rate dueAt was reckoned at: a different rate read later moves what is still due (paceWindow). */
  dueRate: number | null;
  /** Rows published before a rate was in force, and when the first of them went out: counted in dueAt once one is. */
  unpacedRows: number;
  unpacedSince: number | null;
  /**
   * The wait for the workers' first take (source.firstTake): null before the first window; then the
   * last take read before it (undefined: that read failed, the next good one is the baseline) and
   * when the wait began (the first read after the first window went out); 'decided' once a take
   * decided, or the wait ran out.
   */
  firstTake: { before: string | null | undefined; since: number | null } | 'decided' | null;
  /** Whether the log said this claim is paced (once per claim). */
  told: boolean;
}

interface Progress {
  cursor: Run['cursor'];
  candidates: number;
  skipped: number;
  sequence: number;
}

/**
 * How many candidates this run may publish in all (its checkpointed total included), and what
 * sets that number, for the reason when a window would pass it (docs/design.md invariant 16).
 */
interface Allowance {
  limit: number;
  describe: string;
  /** Whether a hold must count guarded rows again (maxFractionPerRun sets the limit). */
  fraction: boolean;
}

const UNLIMITED: Allowance = { limit: Number.POSITIVE_INFINITY, describe: 'no limit', fraction: false };

/**
 * Scans a run's policy from its cursor with its frozen cutoff and publishes the candidates in
 * batches, a window at a time: scan up to CONFIRM_WINDOW pages, check the claim, publish them,
 * wait for every confirm, then store the cursor, the counts and the ids of the confirmed batches.
 * A failed publish is retried with the SAME batch (same id, same rows) until confirmed; a
 * scheduler killed at any point is resumed from a cursor no later than what was confirmed, so
 * batches may be published twice (a duplicate is a no-op for workers), never skipped.
 *
 * The lease is extended on a timer for as long as this runs, whatever the step (count, scan,
 * publish, checkpoint, a retry's backoff), and the claim is checked before each window is
 * published: a scheduler whose claim was taken over publishes nothing more (invariant 17).
 *
 * The brake (invariant 16): every window is fitted to the run's allowance before it is published
 * (limits.maxPerRun / maxFractionPerRun, or the approved count plus limits.approvalTolerance); a
 * window that would pass it is cut to the pages that fit, and the run goes back to
 * 'awaiting-approval' with a new count. An approved run whose policy version changed since the
 * approval goes back too, before it publishes anything more.
 *
 * Errors: a permanent one (run-errors.ts) fails the run with its reason; a retryable one is
 * retried with backoff, the lease still kept, stopping as soon as the claim is known lost.
 */
export async function executeRun(deps: RunExecutorDeps, run: Run, policy: Policy, target: ResolvedTarget): Promise<RunOutcome> {
  const log = deps.log.child({ runId: run.runId, policy: run.policy, trigger: run.trigger, cutoff: run.cutoff });
  const claim = runClaimOf(run, deps.owner);
  const lease = keepLease(deps, log, claim);
  try {
    return await executeClaimed({ deps, log, claim, policy: run.policy, lease }, run, policy, target);
  } finally {
    lease.stop();
  }
}

async function executeClaimed(context: RunContext, run: Run, policy: Policy, target: ResolvedTarget): Promise<RunOutcome> {
  const { deps, log, claim, lease } = context;
  const attempt = <T>(what: string, step: () => Promise<T>) => retrying(context, what, step);
  const version = policyVersion(policy);
  let progress: Progress = { cursor: run.cursor, candidates: run.candidates, skipped: run.skipped, sequence: run.batchesConfirmed };
  log.info({ resumedFrom: run.cursor, claim: run.claimCount }, 'run scanning');
  const versioned = await attempt('record the policy version', () => runsSetPolicyVersion(deps.pool, claim, version));
  if (!versioned.ok) return versioned.outcome;
  // Scheduled runs only: a run an operator asked for (manual, replay) publishes what it finds.
  const scheduled = run.trigger === 'cron' || run.trigger === 'catch-up';
  if (policy.kind === 'remote-delete' && scheduled && run.cursor === null && run.batchesConfirmed === 0) {
    const carried = await attempt('look for batches still in the broker', () =>
      runsEarlierWithUndeliveredBatches(deps.pool, { policy: run.policy, runId: run.runId, withinMs: CARRIED_BY_BROKER_MAX_MS }),
    );
    if (!carried.ok) return carried.outcome;
    if (carried.value) return deferToCarryingRun(context, carried.value);
  }
  const start = await attempt('count for the brake', async () => {
    await deps.beforeStep?.('count');
    return startingAllowance(context, run, policy, target, version);
  });
  if (!start.ok) return start.outcome;
  if (lease.lost) return lostLease(log);
  if ('hold' in start.value) return hold(context, policy, version, start.value.hold);
  const allowance = start.value.allowance;
  // Whole partitions first (issue 44): their rows count toward the allowance like published rows,
  // and what the scan then finds of them is nothing (they are no longer in the table).
  let retiredRows = 0;
  if (retiresPartitions(policy) && target.partitioned) {
    const retired = await attempt('retire partitions', () =>
      retirePartitions({ pool: deps.pool, log, stillClaimed: () => !lease.lost && !deps.stopping(), beforeDetach: async () => deps.beforeStep?.('partition-detach') }, run, policy, target, {
        room: allowance.limit - progress.candidates - run.unconfirmedCandidates,
        policyVersion: version,
      }),
    );
    if (!retired.ok) return retired.outcome;
    if (lease.lost) return lostLease(log);
    retiredRows = retired.value.retiredRows;
  }
  const pace: Pace = { source: deps.paceBy?.(policy) ?? null, dueAt: 0, dueRate: null, unpacedRows: 0, unpacedSince: null, firstTake: null, told: false };
  /** Outside the policy's schedule window nothing more goes out: the run stops at a batch boundary. */
  const scheduleWindowClosed = (): boolean => {
    const inWindow = windowStateAt(policy.window, (deps.now ?? (() => new Date()))());
    if (!inWindow.open) log.info({ opensAt: inWindow.opensAt, cursor: progress.cursor, candidates: progress.candidates }, 'schedule window closed: run stops here and continues in the next window');
    return !inWindow.open;
  };
  for (;;) {
    if (deps.stopping()) return 'stopped';
    // At each window, like the claim.
    if (scheduleWindowClosed()) return 'window-closed';
    const paced = await paceWindow(context, policy, pace);
    if (!paced.ok) return paced.outcome;
    // Again after the pace's wait, which at a low fixed rate can outlast the window (batch ÷ rate seconds).
    if (scheduleWindowClosed()) return 'window-closed';
    const scanned = await attempt('scan', async () => {
      await deps.beforeStep?.('scan');
      return scanWindow(deps, run, policy, target, progress, paced.value.batches);
    });
    if (!scanned.ok) return scanned.outcome;
    if (lease.lost) return lostLease(log);
    // What earlier claims may have published past their checkpoints counts too (runsClaimNext).
    const window = fitWindow(scanned.value, allowance.limit - progress.candidates - run.unconfirmedCandidates - retiredRows);
    if (window.batches.length > 0) {
      const confirmed = await attempt('publish', async () => {
        await deps.beforeStep?.('publish');
        // The claim is checked (and the lease extended) right before the window goes out: a
        // scheduler that lost its claim during a long step publishes nothing more. The window's
        // count is recorded with it: a takeover before its checkpoint counts it as published.
        if (!(await runsBeginWindow(deps.pool, claim, window.candidates, deps.leaseMs))) return false;
        return publishUnconfirmed(deps, run, window);
      });
      if (!confirmed.ok) return confirmed.outcome;
      if (!confirmed.value) return lostLease(log);
      failpoint('scheduler-after-confirm');
      if (paced.value.rate !== null) pace.dueAt = Math.max(pace.dueAt, Date.now()) + (window.candidates / paced.value.rate) * 1000;
      else {
        pace.unpacedRows += window.candidates;
        pace.unpacedSince ??= Date.now();
      }
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
      const recorded = await attempt('checkpoint', async () => {
        await deps.beforeStep?.('checkpoint');
        return runsRecordProgress(deps.pool, {
          claim,
          from: progress.cursor,
          cursor: next.cursor!,
          totals: { candidates: next.candidates, skipped: next.skipped, batchesConfirmed: next.sequence },
          batchIds: window.batches.map((entry) => entry.batchId),
          leaseMs: deps.leaseMs,
        });
      });
      if (!recorded.ok) return recorded.outcome;
      if (!recorded.value) return lostLease(log);
      failpoint('scheduler-after-checkpoint');
      deps.metrics.batchesPublishedTotal.inc({ policy: run.policy }, window.batches.length);
      deps.metrics.candidatesTotal.inc({ policy: run.policy }, window.candidates);
      if (window.skipped > 0) deps.metrics.rowsSkippedTotal.inc({ policy: run.policy }, window.skipped);
      progress = next;
    }
    if (window.overAllowance) {
      // Rows became eligible under the same cutoff since the count (a backdated import, a guard
      // flipped back): what is left needs a decision of its own.
      const counted = await attempt('count for the brake', () => countTotal(context, run, policy, target, progress, allowance.fraction));
      if (!counted.ok) return counted.outcome;
      const measured = counted.value.total + run.unconfirmedCandidates;
      return hold(context, policy, version, { counted: measured, capped: counted.value.capped, reason: `${measured}${counted.value.capped ? '+' : ''} candidates > ${allowance.describe}` });
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

/**
 * An earlier run's batches are still in the broker: this run publishes nothing, says why in its
 * reason, and completes (it has no batch to wait for). The next run scans again.
 */
async function deferToCarryingRun(context: RunContext, carrying: { runId: string; undelivered: number }): Promise<RunOutcome> {
  const { deps, log, claim } = context;
  const note = `published nothing: run ${carrying.runId} still has ${carrying.undelivered}${carrying.undelivered >= UNDELIVERED_COUNT_CAP ? '+' : ''} batch(es) no worker has received`;
  const published = await retrying(context, 'mark published', () => runsMarkPublished(deps.pool, claim, note));
  if (!published.ok) return published.outcome;
  if (!published.value) return lostLease(log);
  deps.metrics.runsDeferredTotal.inc({ policy: context.policy });
  log.info({ carryingRun: carrying.runId, undelivered: carrying.undelivered }, 'run deferred: an earlier run still has batches in the broker');
  await runsCompleteIfAllBatchesDone(deps.pool, claim.runId).catch((error: Error) =>
    log.warn({ err: error.message }, 'completion check failed; the completion pass retries'),
  );
  return 'published';
}

/** A hold's count (published + still to publish) and reason. */
interface Hold {
  counted: number;
  capped: boolean;
  reason: string;
}

/**
 * The run's allowance for this claim, or a hold before anything more is published:
 *  - approved: the approved count plus limits.approvalTolerance; a hold when the policy version
 *    is no longer the approved one (the count is then made under the new version);
 *  - limits, not approved: counted now (bounded, plan.ts planBrakeCount) with what the run already
 *    published; a hold when over maxPerRun or maxFractionPerRun;
 *  - no limits: no count at all, unless someone asked for it (onCounted).
 */
async function startingAllowance(
  context: RunContext,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
  version: string,
): Promise<{ allowance: Allowance } | { hold: Hold }> {
  const limits = policy.limits;
  const progress: Progress = { cursor: run.cursor, candidates: run.candidates, skipped: run.skipped, sequence: run.batchesConfirmed };
  if (run.approvedCandidates !== null) {
    if (run.approvedPolicyVersion !== version) {
      const counted = await countTotal(context, run, policy, target, progress, limits?.maxFractionPerRun !== undefined);
      const measured = counted.total + run.unconfirmedCandidates;
      const reason = `policy version changed since the approval (approved under ${run.approvedPolicyVersion ?? 'unknown'}, now ${version}): ${measured}${counted.capped ? '+' : ''} candidates`;
      return { hold: { counted: measured, capped: counted.capped, reason } };
    }
    const tolerance = limits?.approvalTolerance ?? DEFAULT_APPROVAL_TOLERANCE;
    if (context.deps.onCounted) await countTotal(context, run, policy, target, progress, false);
    return {
      allowance: {
        limit: Math.floor(run.approvedCandidates * (1 + tolerance)),
        describe: `approved ${run.approvedCandidates} + ${Math.round(tolerance * 1000) / 10}% (limits.approvalTolerance)`,
        fraction: false,
      },
    };
  }
  const limited = !!limits && (limits.maxPerRun !== undefined || limits.maxFractionPerRun !== undefined);
  if (!limited && !context.deps.onCounted) return { allowance: UNLIMITED };
  const counted = await countTotal(context, run, policy, target, progress, limits?.maxFractionPerRun !== undefined);
  const allowance = limited ? allowanceOf(policy, counted.guarded) : UNLIMITED;
  // As fitWindow does: a window an earlier claim may have published unconfirmed counts too. The
  // hold shows the number the allowance is measured against, so approving it lets the run finish
  // (holding with the total alone left no room for the first page: an approval loop, issue 40).
  const measured = counted.total + run.unconfirmedCandidates;
  if (measured <= allowance.limit) return { allowance };
  const unconfirmed = run.unconfirmedCandidates > 0 ? ` (${run.unconfirmedCandidates} of them published unconfirmed by an earlier claim)` : '';
  return { hold: { counted: measured, capped: counted.capped, reason: `${measured}${counted.capped ? '+' : ''} candidates${unconfirmed} > ${allowance.describe}` } };
}

/** The smaller of the policy's limits, as an allowance; `guarded` is the base of maxFractionPerRun. */
function allowanceOf(policy: Policy, guarded: number | null): Allowance {
  const { maxPerRun, maxFractionPerRun } = policy.limits ?? {};
  let allowance = UNLIMITED;
  if (maxPerRun !== undefined) allowance = { limit: maxPerRun, describe: `limits.maxPerRun ${maxPerRun}`, fraction: false };
  if (maxFractionPerRun !== undefined && guarded !== null) {
    const limit = Math.floor(maxFractionPerRun * guarded);
    if (limit < allowance.limit) allowance = { limit, describe: `limits.maxFractionPerRun ${maxFractionPerRun} of ${guarded} guarded rows (${limit})`, fraction: true };
  }
  return allowance;
}

/**
 * Counts the run's total, bounded: what it published (its checkpoints) plus what the scan would
 * still publish after its cursor, recorded on the run and told to onCounted. `guarded`: also the
 * base of maxFractionPerRun.
 */
async function countTotal(
  { deps, claim }: RunContext,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
  progress: Progress,
  guarded: boolean,
): Promise<{ total: number; capped: boolean; guarded: number | null }> {
  const counts = await planBrakeCount(deps.pool, target, {
    cutoff: run.cutoff,
    after: progress.cursor,
    unrecordedFor: policy.kind === 'remote-delete' ? policy.name : undefined,
    guarded,
  });
  const total = progress.candidates + counts.candidates;
  await runsRecordCount(deps.pool, claim, total);
  deps.onCounted?.(total);
  return { total, capped: counts.candidatesCapped, guarded: counts.guarded };
}

/** Parks the run in 'awaiting-approval' with its count and reason; conditional on the claim. */
async function hold(context: RunContext, policy: Policy, version: string, held: Hold): Promise<'awaiting-approval' | 'lost-lease' | 'failed' | 'stopped'> {
  const { deps, log, claim } = context;
  const reason = `brake: ${held.reason}`;
  const recorded = await retrying(context, 'hold for approval', () => runsHoldForApproval(deps.pool, claim, { counted: held.counted, reason, policyVersion: version }));
  if (!recorded.ok) return recorded.outcome;
  if (!recorded.value) return lostLease(log);
  deps.metrics.runsAwaitingApprovalTotal.inc({ policy: policy.name });
  log.warn({ counted: held.counted, reason }, 'run over its allowance: awaiting approval (reaper approve / reaper reject)');
  return 'awaiting-approval';
}

function lostLease(log: Logger): 'lost-lease' {
  log.warn('run lease lost to another scheduler; stopping this copy');
  return 'lost-lease';
}

/**
 * Keeps the claim's lease alive on a timer (every third of the lease) for as long as the run
 * executes, whatever step is running: a long count or a slow publish never lets the lease run out
 * while this scheduler is alive. An extension that reports the claim gone sets `lost`; one that
 * fails (the database is down too) is not a verdict: the next one, or the next checkpoint, decides.
 */
interface LeaseKeeper {
  readonly lost: boolean;
  stop(): void;
}

function keepLease(deps: RunExecutorDeps, log: Logger, claim: RunClaim): LeaseKeeper {
  let lost = false;
  let extending = false;
  const confirm = async (): Promise<boolean> => {
    if (!(await runsExtendLease(deps.pool, claim, deps.leaseMs))) lost = true;
    return !lost;
  };
  const timer = setInterval(() => {
    if (extending || lost) return;
    extending = true;
    confirm()
      .catch((error: Error) => log.warn({ err: error.message }, 'run lease extension failed; retrying'))
      .finally(() => {
        extending = false;
      });
  }, Math.max(50, Math.floor(deps.leaseMs / 3)));
  timer.unref();
  return {
    get lost() {
      return lost;
    },
    stop: () => clearInterval(timer),
  };
}

/**
 * Runs `step` until it succeeds. A permanent error fails the run (conditional on the claim) with
 * its reason; a retryable one backs off 0.5 s doubling to 10 s while the lease keeper extends the
 * lease, stopping as soon as the claim is known lost. Unroutable publishes count as permanent once
 * they have lasted `unroutableFailAfterMs` without a break.
 */
async function retrying<T>(context: RunContext, what: string, step: () => Promise<T>): Promise<Step<T>> {
  const { deps, log } = context;
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
    const delay = Math.min(testTimings().runRetryMaxMs ?? RETRY_MAX_MS, RETRY_FIRST_MS * 2 ** failures);
    log.warn({ err: classified.reason, retryInMs: delay }, `run ${what} failed; retrying`);
    const waited = await waitWhileLeased(context, delay);
    if (waited !== 'held') return { ok: false, outcome: waited };
  }
}

/**
 * Sleeps `delayMs` in short slices while the lease keeper extends the lease: a replica waits out a
 * retryable error without its run being taken over, and stops at once when the claim is lost.
 */
async function waitWhileLeased({ deps, log, lease }: RunContext, delayMs: number): Promise<'held' | 'lost-lease' | 'stopped'> {
  const until = Date.now() + delayMs;
  for (;;) {
    if (deps.stopping()) return 'stopped';
    if (lease.lost) return lostLease(log);
    const left = until - Date.now();
    if (left <= 0) return 'held';
    await new Promise((resolve) => setTimeout(resolve, Math.min(100, left)));
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
 * The size of the next window (in batches), after waiting, when paced, until the run is at most
 * PACE_AHEAD_SECONDS ahead of its workers' admitted rate. Unpaced (no paceBy for the policy): the
 * full window (windowBatches, default CONFIRM_WINDOW) at once. Paced (row-delete policies, adaptive
 * or at a fixed rate: scheduler.ts paceBy):
 *  - the rate in force: windows of about PACE_AHEAD_SECONDS of it (at least one batch), each one
 *    published when the rows before it would all be admitted within PACE_AHEAD_SECONDS. At the
 *    adaptive floor (500 rows/s) and batch 500 that is a 500-row scan every second instead of
 *    16,000-row scans back to back at the run's start, while the application is at its busiest
 *    relative to reaper (bench figure 7: the foreground's worst seconds were a run's first).
 *    A fixed rate is in force from the start, so its first window is paced too: unpaced, a 15k-row
 *    run at any fixed rate was scanned, encoded and published whole in its first second, and that
 *    second doubled a 300 statements/s foreground's p99 even at 1 row/s (bench figure 7b,
 *    2026-12-07: the scheduler's Node process 0.08-0.10 of a core, each worker's 0.05-0.07, in
 *    that second; the seconds after it near 1).
 *  - no rate in force, adaptive, at a run's start (nobody stepped the rate lately): nothing is known
 *    yet of the others, and the first window is only PACE_AHEAD_SECONDS of the law's floor (1,000
 *    rows: two batches at batch 500). The scheduler then waits for a take after it (reading the pace
 *    every PACE_FIRST_POLL_MS, at most firstTake.withinMs from the first read after the window went
 *    out: the workers' start look and a margin): others present, their first take (or the step
 *    after it) puts the floor, or the look's rate, in force and the run is paced from there, the
 *    first window's rows counted at it; a take whose own sample saw nobody means alone, and full
 *    windows follow at once. A full first window went out before the workers had looked: the
 *    scan of 16,000 rows, their encoding and publishing, and the workers' decoding of a prefetch of
 *    them, all in a run's first second, which doubled a 300 statements/s foreground's p99 in it
 *    (bench figure 7b, 2026-12-07: 2.17 for the default law, 1.03-1.40 for fixed rates paced from the
 *    start). Alone the cost is the workers' short look (about 0.04 s) before the full windows.
 *  - no rate in force otherwise (adaptive: alone on the database, or the rate went stale during the
 *    run; the first take's wait ran out): full windows at once, and when a rate comes in force the
 *    rows published without one count as published at it.
 * The workers never wait for the scheduler: it stays PACE_AHEAD_SECONDS ahead of what they may take.
 * Reading the pace is best effort: a failed read counts as no rate and no take (the scan that follows
 * meets the same error and retries).
 */
async function paceWindow(context: RunContext, policy: Policy, pace: Pace): Promise<Step<{ batches: number; rate: number | null }>> {
  const full = context.deps.windowBatches ?? CONFIRM_WINDOW;
  const source = pace.source;
  if (source === null) return { ok: true, value: { batches: full, rate: null } };
  for (;;) {
    const reading = await source.read().catch(() => null);
    const rate = reading?.rate ?? null;
    if (rate === null || !(rate > 0)) {
      const first = source.firstTake;
      if (first === null || pace.firstTake === 'decided') return { ok: true, value: { batches: full, rate: null } };
      if (pace.firstTake === null) {
        pace.firstTake = { before: reading === null ? undefined : (reading.lastTakeAt ?? null), since: null };
        return { ok: true, value: { batches: Math.min(full, batchesFor(first.rowsPerSecond, policy.batchSize)), rate: null } };
      }
      const wait = pace.firstTake;
      wait.since ??= Date.now();
      if (wait.before === undefined && reading !== null) wait.before = reading.lastTakeAt ?? null;
      const taken = reading !== null && wait.before !== undefined && (reading.lastTakeAt ?? null) !== wait.before;
      // A take that saw nobody decides "alone". One that saw others but put no rate in force (a rate
      // stepped 5-30 s ago is neither in force nor restarted; the harm law holds until it has
      // durations; a worker that took lately skips its look) is followed by a step: wait for it.
      const alone = taken && reading.lastTakeSawOthers !== true;
      const leftMs = wait.since + first.withinMs - Date.now();
      if (!alone && leftMs > 0) {
        const waited = await waitWhileLeased(context, Math.min(PACE_FIRST_POLL_MS, leftMs));
        if (waited !== 'held') return { ok: false, outcome: waited };
        continue;
      }
      // Alone (or the wait ran out): full windows from here.
      pace.firstTake = 'decided';
      return { ok: true, value: { batches: full, rate: null } };
    }
    pace.firstTake = 'decided';
    // A rate that changed (an operator's override, a step of the adaptive law) moves what is still
    // due: the rows published and not yet admitted are admitted at the new rate from now on. Without
    // this an override raising a fixed rate left the run waiting out the old rate's schedule.
    const now = Date.now();
    if (pace.dueRate !== null && pace.dueRate !== rate && pace.dueAt > now) pace.dueAt = now + ((pace.dueAt - now) * pace.dueRate) / rate;
    pace.dueRate = rate;
    if (pace.unpacedSince !== null && pace.unpacedRows > 0) {
      pace.dueAt = Math.max(pace.dueAt, pace.unpacedSince) + (pace.unpacedRows / rate) * 1000;
      pace.unpacedRows = 0;
      // Counted: rows published unpaced later (the rate stale again) start a stretch of their own.
      pace.unpacedSince = null;
    }
    const aheadMs = pace.dueAt - Date.now() - PACE_AHEAD_SECONDS * 1000;
    if (aheadMs <= 0) {
      const batches = Math.min(full, batchesFor(rate, policy.batchSize));
      if (!pace.told && batches < full) {
        pace.told = true;
        context.log.info({ rowsPerSecond: Math.round(rate), windowBatches: batches }, 'run paced by its admitted rate (a fixed rowsPerSecond, or the adaptive rate while others share the database)');
      }
      return { ok: true, value: { batches, rate } };
    }
    const waited = await waitWhileLeased(context, Math.min(PACE_POLL_MS, aheadMs));
    if (waited !== 'held') return { ok: false, outcome: waited };
  }
}

/** Batches of PACE_AHEAD_SECONDS at `rowsPerSecond`: at least one (a paced window, and an adaptive run's first at the floor). */
export function batchesFor(rowsPerSecond: number, batchSize: number): number {
  return Math.max(1, Math.ceil((rowsPerSecond * PACE_AHEAD_SECONDS) / batchSize));
}

/**
 * Scans the next window after `from` in ONE query (a page per batch, cut in memory; at most
 * `batches` × batchSize rows held) and builds their batches; nothing is published yet.
 * Rows whose key is too long for a message are counted as skipped; the cursor moves past them.
 */
async function scanWindow(
  deps: RunExecutorDeps,
  run: Run,
  policy: Policy,
  target: ResolvedTarget,
  from: { cursor: Run['cursor']; sequence: number },
  batches: number,
): Promise<{ pages: Page[]; reachedEnd: boolean }> {
  const limit = policy.batchSize * batches;
  const rows = await expiringRowsScanPage(deps.pool, target, {
    cutoff: run.cutoff,
    after: from.cursor,
    limit,
    // remote-delete: items that already have an operation are the ledger's to carry, not the scan's
    unrecordedFor: policy.kind === 'remote-delete' ? policy.name : undefined,
  });
  const pages: Page[] = [];
  // One version per window, chosen when it is built: a retried window publishes the same bytes.
  const version = rows.length > 0 ? await deps.batchVersion(run.policy) : 1;
  let sequence = from.sequence;
  const rule = policyVersion(policy);
  for (let start = 0; start < rows.length; start += policy.batchSize) {
    const rowsOfPage = rows.slice(start, start + policy.batchSize);
    const last = rowsOfPage[rowsOfPage.length - 1]!;
    const page: Page = { batches: [], candidates: 0, skipped: 0, rows: rowsOfPage.length, cursor: { expiry: last.observedExpiry, key: last.id } };
    const items = rowsOfPage.filter((item) => item.id.length <= MAX_ID_LENGTH);
    if (items.length < rowsOfPage.length) {
      // Such a key cannot travel in a message (docs/design.md: 1 MiB per message); say so loudly.
      deps.log.error({ runId: run.runId, skipped: rowsOfPage.length - items.length, maxIdLength: MAX_ID_LENGTH }, 'rows with over-long keys skipped');
      page.skipped = rowsOfPage.length - items.length;
    }
    for (const content of encodeWithinLimit(run, items, version, rule)) {
      const batch: Batch = { ...content, batchId: makeBatchId(run.runId, ++sequence, run.claimCount) };
      page.batches.push({ batchId: batch.batchId, content: encodeBatch(batch), confirmed: false });
      page.candidates += batch.items.length;
    }
    pages.push(page);
  }
  return { pages, reachedEnd: rows.length < limit };
}

/**
 * The window to publish: the scanned pages, in order, as long as their candidates fit in `room`
 * (what the run's allowance leaves). A page that does not fit ends the window there, and the
 * window says so (`overAllowance`): the run publishes what fits, checkpoints it, and holds.
 */
function fitWindow(scanned: { pages: Page[]; reachedEnd: boolean }, room: number): Window & { overAllowance: boolean } {
  const window: Window & { overAllowance: boolean } = { batches: [], candidates: 0, skipped: 0, rowsRead: 0, cursor: null, reachedEnd: scanned.reachedEnd, overAllowance: false };
  for (const page of scanned.pages) {
    if (window.candidates + page.candidates > room) {
      window.overAllowance = true;
      window.reachedEnd = false;
      break;
    }
    window.batches.push(...page.batches);
    window.candidates += page.candidates;
    window.skipped += page.skipped;
    window.rowsRead += page.rows;
    window.cursor = page.cursor;
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
  if (batchBytesAtMost(run.policy, items) <= MAX_MESSAGE_BYTES) return [batch];
  // The id is at most 200 characters (contract); measure with the longest one it can get.
  // Measured as text, not encoded into a Buffer that would be thrown away at once.
  const size = Buffer.byteLength(JSON.stringify({ ...batch, batchId: makeBatchId(run.runId, 999_999, run.claimCount) }), 'utf8');
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
        messageId: entry.batchId,
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
