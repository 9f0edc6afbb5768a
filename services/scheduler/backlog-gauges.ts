import { createTask } from 'node-cron';
import type { Logger } from 'pino';
import pg from 'pg';
import { eventsEnabled, retiresPartitions, type Policy, type PolicySet } from '../../shared/config/policies';
import { transactionOn, withTransaction, type Db } from '../../shared/db/pool';
import { partitionsPolicyReadLockTry } from '../../shared/db/queries/partitions';
import {
  admissionGaugeRead,
  backlogReadWithoutJit,
  ledgerBacklogRead,
  ledgerStateCounts,
  runsCompletedSince,
  runsLastCompleted,
  runStateCounts,
  targetBacklogRead,
  type LastCompletedRun,
  type LedgerBacklog,
  type TargetBacklog,
} from '../../shared/db/queries/backlog';
import type { ResolvedTarget } from '../../shared/db/queries/target';
import { outboxOldestAges } from '../../shared/db/queries/outbox';
import { KNOWN_LABELS, type Metrics } from '../../shared/observability/metrics';
import { CRON_TIMEZONE } from './ticks';

/**
 * The backlog gauges, read from PostgreSQL every `intervalMs` (never per scrape: a scrape reads
 * what the last pass stored). Every scheduler replica exports the same values, read from the same
 * database: aggregate them with `max by (policy)`, never `sum`.
 *
 * A pass that fails keeps the previous values and counts reaper_backlog_refresh_failures_total;
 * reaper_backlog_refresh_timestamp_seconds says how fresh the gauges are.
 */

/** Run states a policy always exports (0 when none), so an alert on one of them has a series. */
const RUN_STATES = ['pending', 'scanning', 'published', 'failed', 'incomplete', 'awaiting-approval'] as const;
const LEDGER_OPEN_STATES = ['pending', 'in_flight'] as const;

export interface PolicyBacklog {
  policy: string;
  kind: Policy['kind'];
  target: TargetBacklog;
  /** remote-delete only. */
  ledger: LedgerBacklog | null;
  lastCompleted: LastCompletedRun | null;
}

/**
 * One read of every policy's backlog: used by the gauges and by `reaper status`.
 * `yieldToRetirement` (the gauges): a policy that retires partitions is read under the shared side
 * of its partition lock (partitionsPolicyReadLockTry) and left out while a scheduler retires its
 * partitions: a read of the table in flight would hold every DETACH ... CONCURRENTLY up until it
 * ends (issue 44: 2.2 s in the bench), and a retirement waits for the reads already in flight.
 */
export async function readBacklog(db: Db, policies: readonly Policy[], targets: ReadonlyMap<string, ResolvedTarget>, options: { yieldToRetirement?: boolean } = {}): Promise<PolicyBacklog[]> {
  const names = policies.map((policy) => policy.name);
  const lastCompleted = new Map((await runsLastCompleted(db, names)).map((run) => [run.policy, run]));
  const result: PolicyBacklog[] = [];
  for (const policy of policies) {
    const target = targets.get(policy.name);
    if (!target) continue;
    const yieldTo = options.yieldToRetirement && retiresPartitions(policy) && target.partitioned ? policy.name : null;
    const targetBacklog = await targetBacklogOf(db, target, policy.kind === 'remote-delete', yieldTo);
    if (targetBacklog === null) continue; // being retired: the gauges keep their previous values
    result.push({
      policy: policy.name,
      kind: policy.kind,
      target: targetBacklog,
      ledger: policy.kind === 'remote-delete' ? await ledgerBacklogRead(db, policy.name, policy.leaseMs) : null,
      lastCompleted: lastCompleted.get(policy.name) ?? null,
    });
  }
  return result;
}

/**
 * The target's backlog, read in a transaction of its own without JIT (backlogReadWithoutJit);
 * with `yieldTo` (a policy's name), under the shared side of its partition lock: null (nothing
 * read) while a retirement of its partitions holds or waits for that lock.
 */
async function targetBacklogOf(db: Db, target: ResolvedTarget, remotePolicy: boolean, yieldTo: string | null): Promise<TargetBacklog | null> {
  const work = async (client: Db): Promise<TargetBacklog | null> => {
    await backlogReadWithoutJit(client);
    if (yieldTo !== null && !(await partitionsPolicyReadLockTry(client, yieldTo))) return null;
    return targetBacklogRead(client, target, undefined, { remotePolicy });
  };
  return db instanceof pg.Pool ? withTransaction(db, work) : transactionOn(db, work);
}

/** Seconds between ticks: the longest gap among the next few (an irregular schedule alerts on its slowest gap). */
export function scheduleIntervalSeconds(schedule: string): number {
  const task = createTask(schedule, () => undefined, { timezone: CRON_TIMEZONE });
  try {
    const runs = task.getNextRuns(8).map((date) => date.getTime());
    let longest = 0;
    for (let index = 1; index < runs.length; index++) longest = Math.max(longest, runs[index]! - runs[index - 1]!);
    return longest / 1000;
  } finally {
    void task.destroy();
  }
}

/**
 * A pass costs the database up to the oldest eligible row: its index walk also steps over the
 * entries of rows deleted since the last vacuum, so during a large cleanup it grows with what was
 * deleted (bench, 2M rows: 150-330 ms a pass, 7% of reaper's database time at a pass every 10 s).
 * The next pass waits at least BACKLOG_PASS_DUTY times as long as this one took: the gauges then
 * never take more than 1/BACKLOG_PASS_DUTY of one connection, however large the backlog. The
 * refresh timestamp gauge says how fresh they are.
 */
export const BACKLOG_PASS_DUTY = 100;

export function backlogPassGapMs(intervalMs: number, passMs: number): number {
  return Math.max(intervalMs, Math.round(passMs * BACKLOG_PASS_DUTY));
}

export interface BacklogGauges {
  /** One pass now (tests and start-up); resolves when the gauges are set or the pass failed. */
  refresh(): Promise<void>;
  /** Call before closing the pool: waits for the pass in progress. */
  stop(): Promise<void>;
}

export function startBacklogGauges(deps: {
  db: Db;
  /** This scheduler's id (cleanup_runs.owner): it observes the durations of the runs it executed. */
  owner: string;
  policies: PolicySet;
  targets: ReadonlyMap<string, ResolvedTarget>;
  metrics: Metrics;
  log: Logger;
  intervalMs: number;
}): BacklogGauges {
  const { db, metrics, log } = deps;
  const policies = [...deps.policies.values()];
  const names = policies.map((policy) => policy.name);
  const remoteNames = policies.filter((policy) => policy.kind === 'remote-delete').map((policy) => policy.name);
  const eventNames = policies.filter(eventsEnabled).map((policy) => policy.name);
  for (const policy of policies) {
    metrics.scheduleIntervalSeconds.set({ policy: policy.name }, scheduleIntervalSeconds(policy.schedule));
    if (policy.kind !== 'remote-delete') continue;
    metrics.leaseSeconds.set({ policy: policy.name }, policy.leaseMs / 1000);
    metrics.admissionRatePerSecond.set({ policy: policy.name }, policy.admission.ratePerSecond);
  }

  // reaper_run_duration_seconds: runs this replica owned that completed since the previous pass
  // (re-read with an overlap, so a run committed just after a pass read its clock is not missed).
  let runsWatermark: number | null = null;
  const observedRuns = new Map<string, number>();
  const OVERLAP_SECONDS = 60;
  async function observeCompletedRuns(): Promise<void> {
    const since = runsWatermark === null ? null : runsWatermark - OVERLAP_SECONDS;
    const { nowSeconds, runs } = await runsCompletedSince(db, deps.owner, names, since);
    for (const run of runs) {
      if (observedRuns.has(run.runId)) continue;
      observedRuns.set(run.runId, run.finishedAtSeconds);
      metrics.runDurationSeconds.observe({ policy: run.policy }, run.seconds);
    }
    for (const [runId, finished] of observedRuns) if (finished < nowSeconds - 2 * OVERLAP_SECONDS) observedRuns.delete(runId);
    runsWatermark = nowSeconds;
  }

  async function pass(): Promise<void> {
    await observeCompletedRuns();
    const backlog = await readBacklog(db, policies, deps.targets, { yieldToRetirement: true });
    const runs = await runStateCounts(db, names);
    const ledger = remoteNames.length > 0 ? await ledgerStateCounts(db, remoteNames) : [];
    const admission = remoteNames.length > 0 ? await admissionGaugeRead(db, remoteNames) : [];
    const outbox = eventNames.length > 0 ? await outboxOldestAges(db, eventNames) : [];
    // Everything read: set the gauges in one synchronous step, so a scrape sees one pass, not half of two.
    for (const entry of backlog) {
      const policy = entry.policy;
      metrics.oldestEligibleAgeSeconds.set({ policy }, entry.target.oldestEligibleAgeSeconds);
      metrics.eligibleRows.set({ policy }, entry.target.eligibleRows);
      metrics.heldRows.set({ policy }, entry.target.heldRows);
      metrics.reviewRows.set({ policy }, entry.target.reviewRows);
      // row-delete holds no lease (one autocommitted statement per batch): its oldest lease is 0.
      metrics.oldestLeasedAgeSeconds.set({ policy }, entry.ledger?.oldestLeasedAgeSeconds ?? 0);
      if (entry.ledger) metrics.oldestRunnableAgeSeconds.set({ policy }, entry.ledger.oldestRunnableAgeSeconds);
      if (entry.lastCompleted) metrics.lastCompletedRunTimestampSeconds.set({ policy }, entry.lastCompleted.finishedAtSeconds);
    }
    for (const policy of names) for (const state of RUN_STATES) metrics.runs.set({ policy, state }, 0);
    for (const row of runs) metrics.runs.set({ policy: row.policy, state: row.state }, row.count);
    for (const policy of remoteNames) {
      for (const state of LEDGER_OPEN_STATES) metrics.ledgerOperations.set({ policy, state, outcome: '' }, 0);
      for (const outcome of KNOWN_LABELS.ledgerOutcomes) metrics.ledgerOperations.set({ policy, state: 'done', outcome }, 0);
      metrics.admissionPaused.set({ policy }, 0);
      metrics.admissionBlockedUntilTimestampSeconds.set({ policy }, 0);
    }
    for (const row of ledger) metrics.ledgerOperations.set({ policy: row.policy, state: row.state, outcome: row.outcome }, row.count);
    for (const row of admission) {
      metrics.admissionPaused.set({ policy: row.policy }, row.paused ? 1 : 0);
      metrics.admissionBlockedUntilTimestampSeconds.set({ policy: row.policy }, row.blockedUntilSeconds);
    }
    for (const row of outbox) metrics.outboxOldestAgeSeconds.set({ policy: row.policy }, row.oldestAgeSeconds);
    metrics.backlogRefreshTimestampSeconds.set(Date.now() / 1000);
  }

  let running: Promise<void> | null = null;
  function refresh(): Promise<void> {
    // One pass at a time: a slow database makes passes later, never piles them up.
    running ??= pass()
      .catch((error: Error) => {
        metrics.backlogRefreshFailuresTotal.inc();
        log.warn({ err: error.message }, 'backlog gauges not refreshed; keeping the previous values');
      })
      .finally(() => {
        running = null;
      });
    return running;
  }

  let stopped = false;
  let timer: NodeJS.Timeout | null = null;
  const loop = (): void => {
    const started = performance.now();
    void refresh().then(() => {
      if (!stopped) timer = setTimeout(loop, backlogPassGapMs(deps.intervalMs, performance.now() - started));
    });
  };
  loop();

  return {
    refresh,
    async stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
      await running;
    },
  };
}
