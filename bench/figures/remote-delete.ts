import { monitorEventLoopDelay } from 'node:perf_hooks';
import { bucketShape } from '../../shared/admission/controller';
import { brokerNames, DELAY_TIERS_MS } from '../../shared/amqp/topology';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { check, checkFinished, reaperEnvironment, type BenchContext } from '../lib/context';
import { seedExpiredAssets, OBSERVER_APPLICATION } from '../lib/database';
import { REMOTE_POLICY, NEVER, writePolicies } from '../lib/policies';
import { startServices, stopServices, type ReaperService } from '../lib/services';
import { pollUntil, sleep } from '../lib/wait';

/**
 * Figure 5: remote-delete against the stand-in media API (in this process; it records every call),
 * which enforces the same rate R and burst as the policy's admission, so any call over the global
 * budget shows up as a 429. Three workers share one budget through PostgreSQL. The API answers
 * after `slowMs`, like a real remote, so the concurrency cap has something to hold.
 */

export interface RemoteFigure {
  ratePerSecond: number;
  burst: number;
  concurrency: number;
  workers: number;
  backlog: number;
  slowMs: number;
  /** Executed deletions per second from the first to the last one (the backlog existed all along). */
  achievedPerSecond: number;
  achievedRatio: number;
  /** The same between the 10th and the 90th percentile of executions: the start and the tail left out. */
  steadyPerSecond: number;
  /** Executed deletions in each second from the first call: where the rate was lost. */
  executedPerSecond: number[];
  /** Most calls (any answer) starting in any one-second window. */
  maxCallsInOneSecond: number;
  maxWindowRatio: number;
  peakConcurrency: number;
  concurrencyRatio: number;
  calls: number;
  rateLimited: number;
  /** When each 429 was answered, ms after the first executed call (a 429 blocks the policy for its Retry-After, 1 s here). */
  rateLimitedAtMs: number[];
  /**
   * This process's event-loop delay while the figure ran (the stand-in API lives here and stamps a
   * call's arrival when its handler runs, so a stall here bunches arrivals as the network would).
   */
  apiLoopDelayMs: { p99: number; max: number };
  /**
   * Where the concurrency cap went, sampled every 100 ms while the backlog drained: operations in
   * flight by the ledger (live leases: what admission counts against the cap, from the claim to the
   * outcome's write) and calls open at the API (arrival to answer); the share of samples with the
   * ledger at the cap; the mean time of an executed call at the API (arrival to answer).
   */
  slots: { ledgerMean: number; apiMean: number; atCapShare: number; samples: number; apiCallMs: number };
  /**
   * The share of the same samples in which the admission bucket was full (its refill thrown away:
   * nobody asked for the tokens), and in which some operation was due but not in flight (work
   * waiting in the ledger, not just in the broker).
   */
  bucketFullShare: number;
  /** Of the samples with the bucket full: those in which the ledger held due operations nobody had claimed (a worker could have asked), the rest had none due (the work was in the broker, or done). */
  bucketFullWithDueShare: number;
  duplicates: number;
  /** The workers' reaper_operations_total by result (confirmed, rate-limited, grant-expired, ...). */
  operations: Record<string, number>;
  seconds: number;
  bounded: boolean;
}

const mean = (values: readonly number[]): number => (values.length === 0 ? 0 : values.reduce((sum, value) => sum + value, 0) / values.length);

export async function runRemoteDelete(
  context: BenchContext,
  options: { ratePerSecond: number; burst: number; concurrency: number; backlog: number; slowMs: number; workers: number },
): Promise<RemoteFigure> {
  await context.databases.fresh();
  await context.broker.preparePhase([REMOTE_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  let api: MediaApi | null = null;
  let services: ReaperService[] = [];
  const loopDelay = monitorEventLoopDelay({ resolution: 5 });
  // The in-flight sampler (below): stopped and awaited in `finally` too, so it never queries a pool that has ended.
  let sampling = false;
  let sampler: Promise<void> = Promise.resolve();
  try {
    await seedExpiredAssets(pool, { prefix: 'asset-', count: options.backlog, url: true });
    api = await startMediaApi({ ratePerSecond: options.ratePerSecond, burst: options.burst });
    api.configure({ slowMs: options.slowMs });
    const policiesPath = writePolicies(context.workDir, 'remote', [
      {
        name: REMOTE_POLICY,
        kind: 'remote-delete',
        schedule: NEVER,
        table: 'media_assets',
        key: 'asset_id',
        expiresAt: 'retention_expires_at',
        guard: { status: 'active' },
        batchSize: 100,
        remote: { baseUrl: api.url, path: '/assets/{id}', timeoutMs: 5000 },
        admission: { ratePerSecond: options.ratePerSecond, burst: options.burst, concurrency: options.concurrency },
        retry: { maxAttempts: 10 },
      },
    ]);
    services = await startServices(reaperEnvironment(context, policiesPath), [
      { kind: 'scheduler', id: 'bench-scheduler' },
      ...Array.from({ length: options.workers }, (_, i) => ({ kind: 'worker' as const, id: `bench-worker-${i + 1}` })),
    ]);
    loopDelay.enable();
    const run = (await runsInsertIfAbsent(pool, { policy: REMOTE_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const deadline = Date.now() + Math.min(context.boundMs, ((3 * options.backlog) / options.ratePerSecond + 30) * 1000);
    const slotSamples: Array<{ ledger: number; api: number; full: boolean; due: number }> = [];
    const capacity = bucketShape(options.ratePerSecond, options.burst).capacity;
    sampling = true;
    sampler = (async () => {
      const openAtApi = (): number => api!.calls.filter((call) => call.finishedAt === 0).length;
      while (sampling) {
        const { n: ledger, tokens, due } = (
          await pool.query<{ n: number; tokens: number | null; due: number }>(
            `SELECT (SELECT count(*)::int FROM cleanup_ledger WHERE policy = $1 AND state = 'in_flight' AND lease_expires_at >= clock_timestamp()) AS n,
                    (SELECT count(*)::int FROM cleanup_ledger WHERE policy = $1 AND state = 'pending' AND not_before <= clock_timestamp()) AS due,
                    (SELECT tokens + $2 * extract(epoch FROM clock_timestamp() - refilled_at) FROM cleanup_admission WHERE policy = $1)::float8 AS tokens`,
            [REMOTE_POLICY, options.ratePerSecond],
          )
        ).rows[0]!;
        if (api!.calls.length > 0) slotSamples.push({ ledger, api: openAtApi(), full: tokens !== null && tokens >= capacity, due });
        await sleep(100);
      }
    })();
    const done = await pollUntil(
      async () => {
        const state = (await pool.query<{ state: string }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [run.runId])).rows[0]!.state;
        return state === 'completed' ? state : undefined;
      },
      { deadline, everyMs: 250 },
    );
    sampling = false;
    await sampler;
    for (const service of services) service.assertRunning();
    const operations: Record<string, number> = {};
    for (const worker of services.slice(1)) {
      for (const [result, n] of Object.entries(await worker.metric('reaper_operations_total', 'result'))) operations[result] = (operations[result] ?? 0) + n;
    }
    await stopServices(services);

    const executed = api.calls.filter((call) => call.executed).map((call) => call.startedAt).sort((a, b) => a - b);
    const spanSeconds = executed.length > 1 ? (executed[executed.length - 1]! - executed[0]!) / 1000 : 0;
    const achievedPerSecond = spanSeconds > 0 ? (executed.length - 1) / spanSeconds : 0;
    const [p10, p90] = [Math.floor(executed.length * 0.1), Math.floor(executed.length * 0.9)];
    const steadySeconds = executed.length > 10 ? (executed[p90]! - executed[p10]!) / 1000 : 0;
    const steadyPerSecond = steadySeconds > 0 ? (p90 - p10) / steadySeconds : 0;
    const executedPerSecond: number[] = [];
    for (const at of executed) {
      const second = Math.floor((at - executed[0]!) / 1000);
      while (executedPerSecond.length <= second) executedPerSecond.push(0);
      executedPerSecond[second]! += 1;
    }
    const maxCallsInOneSecond = api.maxCallsInWindow(1000);
    const duplicates = [...api.executionsByKey().values()].filter((count) => count > 1).length;
    const figure = `remote-delete, R=${options.ratePerSecond}, backlog ${options.backlog}, ${options.workers} workers`;
    const ledger = (
      await pool.query<{ confirmed: number; left: number }>(
        `SELECT (SELECT count(*)::int FROM cleanup_ledger WHERE outcome = 'confirmed') AS confirmed, (SELECT count(*)::int FROM media_assets) AS left`,
      )
    ).rows[0]!;
    check(context, figure, 'duplicate executions at the remote', 0, duplicates);
    if (checkFinished(context, figure, done !== undefined)) {
      check(context, figure, 'assets deleted at the remote', options.backlog, api.deletedIds().size);
      check(context, figure, 'ledger operations confirmed', options.backlog, ledger.confirmed);
      check(context, figure, 'media_assets rows left', 0, ledger.left);
    }
    return {
      ratePerSecond: options.ratePerSecond,
      burst: options.burst,
      concurrency: options.concurrency,
      workers: options.workers,
      backlog: options.backlog,
      slowMs: options.slowMs,
      achievedPerSecond,
      achievedRatio: achievedPerSecond / options.ratePerSecond,
      steadyPerSecond,
      executedPerSecond,
      maxCallsInOneSecond,
      maxWindowRatio: maxCallsInOneSecond / (options.ratePerSecond + options.burst),
      peakConcurrency: api.maxConcurrent(),
      concurrencyRatio: api.maxConcurrent() / options.concurrency,
      calls: api.calls.length,
      rateLimited: api.calls.filter((call) => call.status === 429).length,
      rateLimitedAtMs: api.calls.filter((call) => call.status === 429).map((call) => Math.round(call.startedAt - (executed[0] ?? call.startedAt))),
      apiLoopDelayMs: { p99: loopDelay.percentile(99) / 1e6, max: loopDelay.max / 1e6 },
      slots: {
        ledgerMean: mean(slotSamples.map((sample) => sample.ledger)),
        apiMean: mean(slotSamples.map((sample) => sample.api)),
        atCapShare: slotSamples.filter((sample) => sample.ledger >= options.concurrency).length / Math.max(1, slotSamples.length),
        samples: slotSamples.length,
        apiCallMs: mean(api.calls.filter((call) => call.executed && call.finishedAt > 0).map((call) => call.finishedAt - call.startedAt)),
      },
      bucketFullShare: slotSamples.filter((sample) => sample.full).length / Math.max(1, slotSamples.length),
      bucketFullWithDueShare: slotSamples.filter((sample) => sample.full && sample.due > 0).length / Math.max(1, slotSamples.filter((sample) => sample.full).length),
      duplicates,
      operations,
      seconds: spanSeconds,
      bounded: done === undefined,
    };
  } finally {
    loopDelay.disable();
    sampling = false;
    await sampler.catch(() => undefined);
    await stopServices(services);
    await api?.close();
    await pool.end();
  }
}

/**
 * Figure 5b (issue 7, item 10): a remote backlog that takes far longer to drain than the schedule
 * interval. `assets` expired assets, the policy's run every `runEverySeconds` throughout the drain,
 * three workers sharing one budget. It shows that the ledger, not the broker, carries the waiting
 * work: messages published in all (scheduler + delay tiers + ledger sweeper) stay within a small
 * multiple of one scan's batches, queue depth never grows past the first scan's, the rate at the
 * remote holds, nothing is executed twice; and how long workers waited for the admission lock.
 */
export interface RemoteBacklogFigure {
  assets: number;
  ratePerSecond: number;
  burst: number;
  concurrency: number;
  workers: number;
  runEverySeconds: number;
  runs: number;
  firstScanBatches: number;
  /** Batches the scheduler published, copies sent to delay tiers, batches the ledger sweeper sent. */
  published: { scheduler: number; delayTiers: number; sweeper: number; total: number };
  publishedRatio: number;
  /** Most messages in the work queue plus every delay tier at any sample (every 500 ms). */
  maxQueueDepth: number;
  achievedPerSecond: number;
  achievedRatio: number;
  /** The same between the 10th and the 90th percentile of executions (start and tail left out). */
  steadyRatio: number;
  /** Executed deletions in each second from the first call: where the rate was lost. */
  executedPerSecond: number[];
  duplicates: number;
  rateLimited: number;
  maxCallsInOneSecond: number;
  /** The workers' reaper_admission_lock_wait_seconds: p50 and p99 as bucket upper bounds (ms), and grants. */
  lockWait: { p50Ms: number; p99Ms: number; grants: number };
  operations: Record<string, number>;
  seconds: number;
  bounded: boolean;
}

function histogramQuantileMs(buckets: Record<string, number>, quantile: number): number {
  const ordered = Object.entries(buckets)
    .map(([le, count]) => ({ le: le === '+Inf' ? Infinity : Number(le), count }))
    .sort((a, b) => a.le - b.le);
  const total = ordered.at(-1)?.count ?? 0;
  const found = ordered.find((bucket) => bucket.count >= quantile * total);
  return found ? found.le * 1000 : 0;
}

export async function runRemoteBacklog(
  context: BenchContext,
  options: { assets: number; ratePerSecond: number; burst: number; concurrency: number; workers: number; runEverySeconds: number; slowMs: number },
): Promise<RemoteBacklogFigure> {
  await context.databases.fresh();
  await context.broker.preparePhase([REMOTE_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const names = brokerNames(context.broker.prefix);
  const queues = [names.workQueue(REMOTE_POLICY), ...DELAY_TIERS_MS.map((ms) => names.delayQueue(ms))];
  let api: MediaApi | null = null;
  let services: ReaperService[] = [];
  try {
    await seedExpiredAssets(pool, { prefix: 'asset-', count: options.assets, url: true });
    api = await startMediaApi({ ratePerSecond: options.ratePerSecond, burst: options.burst });
    api.configure({ slowMs: options.slowMs });
    const policiesPath = writePolicies(context.workDir, 'remote-backlog', [
      {
        name: REMOTE_POLICY,
        kind: 'remote-delete',
        schedule: `*/${options.runEverySeconds} * * * * *`,
        table: 'media_assets',
        key: 'asset_id',
        expiresAt: 'retention_expires_at',
        guard: { status: 'active' },
        batchSize: 100,
        remote: { baseUrl: api.url, path: '/assets/{id}', timeoutMs: 5000 },
        admission: { ratePerSecond: options.ratePerSecond, burst: options.burst, concurrency: options.concurrency },
        retry: { maxAttempts: 10 },
      },
    ]);
    services = await startServices(reaperEnvironment(context, policiesPath), [
      { kind: 'scheduler', id: 'bench-scheduler' },
      ...Array.from({ length: options.workers }, (_, i) => ({ kind: 'worker' as const, id: `bench-worker-${i + 1}` })),
    ]);
    const started = Date.now();
    const deadline = started + Math.min(context.boundMs, ((1.5 * options.assets) / options.ratePerSecond + 60) * 1000);
    let maxQueueDepth = 0;
    const done = await pollUntil(
      async () => {
        let depth = 0;
        for (const queue of queues) depth += (await context.broker.queueState(queue).catch(() => ({ messages: 0 }))).messages;
        maxQueueDepth = Math.max(maxQueueDepth, depth);
        return api!.deletedIds().size >= options.assets ? true : undefined;
      },
      { deadline, everyMs: 500 },
    );
    for (const service of services) service.assertRunning();
    const sum = (values: Record<string, number>) => Object.values(values).reduce((a, b) => a + b, 0);
    const scheduler = sum(await services[0]!.metric('reaper_batches_published_total'));
    let delayTiers = 0;
    let sweeper = 0;
    const operations: Record<string, number> = {};
    const lockBuckets: Record<string, number> = {};
    for (const worker of services.slice(1)) {
      delayTiers += (await worker.metric('reaper_batches_total', 'outcome')).retry ?? 0;
      sweeper += sum(await worker.metric('reaper_ledger_sweep_batches_published_total'));
      for (const [result, n] of Object.entries(await worker.metric('reaper_operations_total', 'result'))) operations[result] = (operations[result] ?? 0) + n;
      for (const [le, n] of Object.entries(await worker.metric('reaper_admission_lock_wait_seconds_bucket', 'le'))) lockBuckets[le] = (lockBuckets[le] ?? 0) + n;
    }
    await stopServices(services);
    const runs = await pool.query<{ run_id: string; batches: number }>(
      `SELECT r.run_id, (SELECT count(*)::int FROM cleanup_run_batches b WHERE b.run_id = r.run_id) AS batches
       FROM cleanup_runs r WHERE r.policy = $1 ORDER BY r.created_at, r.run_id`,
      [REMOTE_POLICY],
    );
    const firstScanBatches = runs.rows.find((row) => row.batches > 0)?.batches ?? 0;
    const executed = api.calls.filter((call) => call.executed).map((call) => call.startedAt).sort((a, b) => a - b);
    const spanSeconds = executed.length > 1 ? (executed[executed.length - 1]! - executed[0]!) / 1000 : 0;
    const achievedPerSecond = spanSeconds > 0 ? (executed.length - 1) / spanSeconds : 0;
    const [p10, p90] = [Math.floor(executed.length * 0.1), Math.floor(executed.length * 0.9)];
    const steadySeconds = executed.length > 10 ? (executed[p90]! - executed[p10]!) / 1000 : 0;
    const steadyRatio = steadySeconds > 0 ? (p90 - p10) / steadySeconds / options.ratePerSecond : 0;
    const executedPerSecond: number[] = [];
    for (const at of executed) {
      const second = Math.floor((at - executed[0]!) / 1000);
      while (executedPerSecond.length <= second) executedPerSecond.push(0);
      executedPerSecond[second]! += 1;
    }
    const duplicates = [...api.executionsByKey().values()].filter((count) => count > 1).length;
    const figure = `remote backlog, ${options.assets} assets, R=${options.ratePerSecond}, a run every ${options.runEverySeconds} s`;
    check(context, figure, 'duplicate executions at the remote', 0, duplicates);
    if (checkFinished(context, figure, done !== undefined)) {
      check(context, figure, 'assets deleted at the remote', options.assets, api.deletedIds().size);
    }
    const total = scheduler + delayTiers + sweeper;
    return {
      assets: options.assets,
      ratePerSecond: options.ratePerSecond,
      burst: options.burst,
      concurrency: options.concurrency,
      workers: options.workers,
      runEverySeconds: options.runEverySeconds,
      runs: runs.rows.length,
      firstScanBatches,
      published: { scheduler, delayTiers, sweeper, total },
      publishedRatio: firstScanBatches > 0 ? total / firstScanBatches : 0,
      maxQueueDepth,
      achievedPerSecond,
      achievedRatio: achievedPerSecond / options.ratePerSecond,
      steadyRatio,
      executedPerSecond,
      duplicates,
      rateLimited: api.calls.filter((call) => call.status === 429).length,
      maxCallsInOneSecond: api.maxCallsInWindow(1000),
      lockWait: { p50Ms: histogramQuantileMs(lockBuckets, 0.5), p99Ms: histogramQuantileMs(lockBuckets, 0.99), grants: lockBuckets['+Inf'] ?? 0 },
      operations,
      seconds: (Date.now() - started) / 1000,
      bounded: done === undefined,
    };
  } finally {
    await stopServices(services);
    await api?.close();
    await pool.end();
  }
}
