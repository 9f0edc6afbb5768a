import type pg from 'pg';
import { brokerNames } from '../../shared/amqp/topology';
import { runsInsertIfAbsent, type RunState } from '../../shared/db/queries/runs';
import { check, checkFinished, checkSeatRows, reaperEnvironment, throughput, type BenchContext, type Measured, type Throughput } from '../lib/context';
import { CpuMeter, type CpuSplit } from '../lib/cpu';
import { countSeatRows, cutoffAfterCandidates, type Seed, OBSERVER_APPLICATION } from '../lib/database';
import { ROW_POLICY, seatHoldsPolicy, writePolicies } from '../lib/policies';
import { ReaperService, startServices, stopServices, type ReaperEnvironment, type ServiceSpec } from '../lib/services';
import { pollUntil } from '../lib/wait';

/**
 * reaper's row-delete, measured on real processes: one scheduler and two workers started with
 * `bin/reaper`, a run triggered by inserting it into cleanup_runs exactly as `reaper trigger` does,
 * and every time read from the database clock (the run's created_at, started_at, published_at and
 * finished_at, and the batch receipts), so the benchmark's own polling adds nothing to a figure.
 */

export interface ProcessMemory {
  label: string;
  peakRssMb: number;
}

export interface ReaperRun {
  candidates: number;
  batchSize: number;
  /** Trigger (run inserted) to run completed: what an operator waits for. */
  endToEnd: Throughput;
  /** Claimed by the scheduler to completed: the pipeline's throughput without the claim poll. */
  claimedToCompleted: Throughput;
  /** Trigger to claim: the scheduler finds manual runs by polling cleanup_runs. */
  claimWaitSeconds: number;
  /** Claim to published (scan + publish + confirm), overlapping the workers. */
  scanSeconds: number;
  /** Trigger to the first batch transaction begun; null when no batch ran. */
  startupSeconds: number | null;
  /** The last batch transaction begun to completed (its statement and the scheduler's completion pass); null when unfinished. */
  tailSeconds: number | null;
  memory: ProcessMemory[];
  cpu: CpuSplit;
  batches: number;
  duplicateDeliveries: number;
}

export interface StageSplit {
  candidates: number;
  batchSize: number;
  /** Scheduler alone: claim to published, nobody consuming. */
  scheduler: Measured;
  /** Workers alone: from the first batch begun to the last one begun, from a full queue. */
  workers: Measured;
  queueDepth: number;
  /** RSS of the scheduler once started, before the run: what the process costs at rest. */
  schedulerRestRssMb: number;
  schedulerPeakRssMb: number;
  workerPeakRssMb: number[];
}

interface RunTimes {
  state: RunState;
  claimWait: number | null;
  scan: number | null;
  total: number | null;
  claimedTotal: number | null;
  soFar: number;
  drain: number | null;
  /** Trigger (created_at) to the first batch transaction begun: claim, first scan page, first delivery, first admission. */
  startup: number | null;
  /** The last batch transaction begun to the run completed (finished_at): that statement, and the scheduler noticing. */
  tail: number | null;
  deleted: number;
  noop: number;
  receipts: number;
  batchesConfirmed: number;
  candidates: number;
}

async function runTimes(pool: pg.Pool, runId: string): Promise<RunTimes> {
  const row = (
    await pool.query<{
      state: RunState;
      claim_wait: number | null;
      scan: number | null;
      total: number | null;
      claimed_total: number | null;
      so_far: number;
      drain: number | null;
      startup: number | null;
      tail: number | null;
      deleted: number;
      noop: number;
      receipts: number;
      batches_confirmed: number;
      candidates: string;
    }>(
      `SELECT r.state, r.batches_confirmed, r.candidates,
              extract(epoch FROM r.started_at - r.created_at)::float8 AS claim_wait,
              extract(epoch FROM r.published_at - r.started_at)::float8 AS scan,
              extract(epoch FROM r.finished_at - r.created_at)::float8 AS total,
              extract(epoch FROM r.finished_at - r.started_at)::float8 AS claimed_total,
              extract(epoch FROM clock_timestamp() - r.created_at)::float8 AS so_far,
              -- a receipt's completed_at is its transaction's start: from the first to the last batch
              -- begun is the drain (the run's finished_at would add the scheduler's completion poll)
              extract(epoch FROM b.last_begun - b.first_begun)::float8 AS drain,
              extract(epoch FROM b.first_begun - r.created_at)::float8 AS startup,
              extract(epoch FROM r.finished_at - b.last_begun)::float8 AS tail,
              b.deleted, b.noop, b.receipts
       FROM cleanup_runs r,
            LATERAL (SELECT coalesce(sum(deleted), 0)::int AS deleted, coalesce(sum(noop), 0)::int AS noop,
                            count(*)::int AS receipts, min(completed_at) AS first_begun, max(completed_at) AS last_begun
                     FROM cleanup_batches WHERE run_id = r.run_id) b
       WHERE r.run_id = $1`,
      [runId],
    )
  ).rows[0]!;
  return {
    state: row.state,
    claimWait: row.claim_wait,
    scan: row.scan,
    total: row.total,
    claimedTotal: row.claimed_total,
    soFar: row.so_far,
    drain: row.drain,
    startup: row.startup,
    tail: row.tail,
    deleted: row.deleted,
    noop: row.noop,
    receipts: row.receipts,
    batchesConfirmed: row.batches_confirmed,
    candidates: Number(row.candidates),
  };
}

/** Polls the run's state (a primary-key read) until it is one of `states`; undefined at the deadline. */
async function waitForState(pool: pg.Pool, runId: string, states: readonly RunState[], deadline: number): Promise<RunState | undefined> {
  return pollUntil(
    async () => {
      const state = (await pool.query<{ state: RunState }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [runId])).rows[0]!.state;
      if (state === 'failed') throw new Error(`run ${runId} failed`);
      return states.includes(state) ? state : undefined;
    },
    { deadline, everyMs: 100 },
  );
}

/** The audit setting the audit-cost comparison (issue 9) uses: what an operator would set. */
export const AUDIT_ON = { enabled: true, retainDays: 30 } as const;

function rowEnvironment(context: BenchContext, batchSize: number, audit = false): ReaperEnvironment {
  const policy = seatHoldsPolicy(ROW_POLICY, batchSize, undefined, audit ? { audit: AUDIT_ON } : {});
  return reaperEnvironment(context, writePolicies(context.workDir, `row-${batchSize}${audit ? '-audit' : ''}`, [policy]));
}

/**
 * Node flags every reaper service of these figures starts with: a stated heap budget, as a
 * container's memory limit gives one (Node sizes its heap from the cgroup limit; infra/k8s sets
 * 96-384 Mi). Without any, V8 sizes the heap for the whole machine (a 4 GB limit here, heap growing
 * factor 4) and a process's peak RSS creeps up with the length of a run although its live heap stays
 * ~16 MB (issue 18; docs/performance.md "Performance"). BENCH_SERVICE_NODE_ARGS overrides it ('' for none).
 */
export const SERVICE_NODE_ARGS: readonly string[] = (process.env.BENCH_SERVICE_NODE_ARGS ?? '--max-old-space-size=512').split(' ').filter(Boolean);
const SCHEDULER: ServiceSpec = { kind: 'scheduler', id: 'bench-scheduler', nodeArgs: SERVICE_NODE_ARGS };
const workerSpecs = (count: number): ServiceSpec[] => Array.from({ length: count }, (_, i) => ({ kind: 'worker', id: `bench-worker-${i + 1}`, nodeArgs: SERVICE_NODE_ARGS }));

/** The run's own bookkeeping must agree with the table: each candidate deleted once, nothing else. */
function checkRun(context: BenchContext, figure: string, seed: Seed, expected: number, times: RunTimes, counts: Awaited<ReturnType<typeof countSeatRows>>): void {
  check(context, figure, 'run candidates', expected, times.candidates);
  check(context, figure, 'rows deleted per receipts', expected, times.deleted);
  check(context, figure, 'no-ops', 0, times.noop);
  check(context, figure, 'receipts = confirmed batches', times.batchesConfirmed, times.receipts);
  checkSeatRows(context, figure, seed, expected, counts);
}

/**
 * Figure 1 (and the sweep): trigger, scheduler, broker, two workers, commit, ack. `profileDir`
 * runs the scheduler and the first worker under --cpu-prof (used once, never for a figure).
 */
export async function runReaperEndToEnd(
  context: BenchContext,
  seed: Seed,
  options: { batchSize: number; workers?: number; profileDir?: string; audit?: boolean },
): Promise<ReaperRun> {
  await context.databases.fresh();
  await context.broker.preparePhase([ROW_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const profile = (name: string): string[] =>
    options.profileDir ? ['--cpu-prof', `--cpu-prof-dir=${options.profileDir}`, `--cpu-prof-name=${name}.cpuprofile`] : [];
  const specs: ServiceSpec[] = [{ ...SCHEDULER, nodeArgs: [...SERVICE_NODE_ARGS, ...profile('scheduler')] }, ...workerSpecs(options.workers ?? 2)];
  specs[1] = { ...specs[1]!, nodeArgs: [...SERVICE_NODE_ARGS, ...profile('worker-1')] };
  let services: ReaperService[] = [];
  try {
    services = await startServices(rowEnvironment(context, options.batchSize, options.audit), specs);
    const cpu = new CpuMeter(pool, { services, backends: 'reaper-%', includeRabbitmq: true });
    await cpu.start();
    const run = (await runsInsertIfAbsent(pool, { policy: ROW_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const finished = await waitForState(pool, run.runId, ['completed'], Date.now() + context.boundMs);
    for (const service of services) service.assertRunning();
    const times = await runTimes(pool, run.runId);
    const memory = services.map((service) => ({ label: service.label, peakRssMb: service.memory().peakRssMb }));
    let duplicateDeliveries = 0;
    for (const worker of services.slice(1)) duplicateDeliveries += (await worker.metric('reaper_batches_total', 'outcome')).duplicate ?? 0;
    const cpuSplit = await cpu.finish();
    await stopServices(services);
    const bounded = finished === undefined;
    const figure = `reaper end to end${options.audit ? ', audit on' : ''}, batch ${options.batchSize}, ${seed.candidates} candidates`;
    if (checkFinished(context, figure, !bounded)) {
      checkRun(context, figure, seed, seed.candidates, times, await countSeatRows(pool));
      // Audit on: one cleanup_audit row per deleted row of this run, and none for a run without it.
      const audited = (await pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_audit WHERE run_id = $1', [run.runId])).rows[0]!.n;
      check(context, figure, 'audit rows', options.audit ? seed.candidates : 0, audited);
    }
    return {
      candidates: seed.candidates,
      batchSize: options.batchSize,
      endToEnd: bounded ? throughput(times.deleted, times.soFar, true) : throughput(times.deleted, times.total!),
      claimedToCompleted: bounded ? throughput(times.deleted, times.soFar - (times.claimWait ?? 0), true) : throughput(times.deleted, times.claimedTotal!),
      claimWaitSeconds: times.claimWait ?? 0,
      startupSeconds: times.startup,
      tailSeconds: times.tail,
      scanSeconds: times.scan ?? times.soFar,
      memory,
      cpu: cpuSplit,
      batches: times.batchesConfirmed,
      duplicateDeliveries,
    };
  } finally {
    await stopServices(services);
    await pool.end();
  }
}

/**
 * Figure 2 (and the scheduler's memory): the scheduler alone scans, publishes and waits for
 * confirms into a queue nobody consumes; then two workers start and drain it. `candidates` below
 * the seed's makes the run see only the first ones (a cutoff at the n-th expiry).
 */
export async function runStageSplit(context: BenchContext, seed: Seed, options: { batchSize: number; candidates?: number }): Promise<StageSplit> {
  await context.databases.fresh();
  await context.broker.preparePhase([ROW_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const environment = rowEnvironment(context, options.batchSize);
  const expected = options.candidates ?? seed.candidates;
  const services: ReaperService[] = [];
  try {
    services.push(...(await startServices(environment, [SCHEDULER])));
    const schedulerRestRssMb = services[0]!.memory().rssMb;
    const cutoff = options.candidates === undefined ? null : await cutoffAfterCandidates(pool, options.candidates);
    const schedulerCpu = new CpuMeter(pool, { services: [services[0]!], backends: 'reaper-scheduler', includeRabbitmq: true });
    await schedulerCpu.start();
    const run = (await runsInsertIfAbsent(pool, { policy: ROW_POLICY, trigger: 'manual', scheduledFor: null, cutoff }))!;
    const published = await waitForState(pool, run.runId, ['published', 'completed'], Date.now() + context.boundMs);
    services[0]!.assertRunning();
    const afterScan = await runTimes(pool, run.runId);
    const schedulerCpuSplit = await schedulerCpu.finish();
    const schedulerPeakRssMb = services[0]!.memory().peakRssMb;
    const queueDepth = (await context.broker.queueState(brokerNames(context.broker.prefix).workQueue(ROW_POLICY))).messages;
    const scheduler = {
      ...(published === undefined
        ? throughput(afterScan.candidates, afterScan.soFar - (afterScan.claimWait ?? 0), true)
        : throughput(afterScan.candidates, afterScan.scan!)),
      cpu: schedulerCpuSplit,
    };

    const workerServices = await startServices(environment, workerSpecs(2));
    services.push(...workerServices);
    // Started once the workers are ready: their start-up is not part of draining.
    const workersCpu = new CpuMeter(pool, { services: workerServices, backends: 'reaper-worker', includeRabbitmq: true });
    await workersCpu.start();
    const completed = await waitForState(pool, run.runId, ['completed'], Date.now() + context.boundMs);
    for (const service of services) service.assertRunning();
    const times = await runTimes(pool, run.runId);
    const workerPeakRssMb = services.slice(1).map((service) => service.memory().peakRssMb);
    const workersCpuSplit = await workersCpu.finish();
    await stopServices(services);
    const bounded = published === undefined || completed === undefined;
    const figure = `stage split, batch ${options.batchSize}, ${expected} candidates`;
    if (checkFinished(context, figure, !bounded)) checkRun(context, figure, seed, expected, times, await countSeatRows(pool));
    const workers = {
      ...(completed === undefined || times.drain === null ? throughput(times.deleted, times.soFar - afterScan.soFar, true) : throughput(times.deleted, times.drain)),
      cpu: workersCpuSplit,
    };
    return { candidates: expected, batchSize: options.batchSize, scheduler, workers, queueDepth, schedulerRestRssMb, schedulerPeakRssMb, workerPeakRssMb };
  } finally {
    await stopServices(services);
    await pool.end();
  }
}

/**
 * The scheduler's memory for a run of `candidates` (issue 18): the scheduler alone scans, publishes
 * and waits for confirms into a queue nobody consumes (as in the stage split), and its peak RSS is
 * read once the run is published. Nothing is deleted; the queue is purged by the next figure.
 */
export async function runSchedulerAlone(
  context: BenchContext,
  seed: Seed,
  options: { batchSize: number; candidates?: number; nodeArgs?: readonly string[] },
): Promise<{ peakRssMb: number; restRssMb: number }> {
  await context.databases.fresh();
  await context.broker.preparePhase([ROW_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const services: ReaperService[] = [];
  try {
    services.push(...(await startServices(rowEnvironment(context, options.batchSize), [{ ...SCHEDULER, nodeArgs: options.nodeArgs ?? SERVICE_NODE_ARGS }])));
    const restRssMb = services[0]!.memory().rssMb;
    const cutoff = options.candidates === undefined || options.candidates >= seed.candidates ? null : await cutoffAfterCandidates(pool, options.candidates);
    const run = (await runsInsertIfAbsent(pool, { policy: ROW_POLICY, trigger: 'manual', scheduledFor: null, cutoff }))!;
    const published = await waitForState(pool, run.runId, ['published', 'completed'], Date.now() + context.boundMs);
    services[0]!.assertRunning();
    const figure = `scheduler alone, batch ${options.batchSize}, ${options.candidates ?? seed.candidates} candidates`;
    if (checkFinished(context, figure, published !== undefined)) {
      check(context, figure, 'run candidates', options.candidates ?? seed.candidates, (await runTimes(pool, run.runId)).candidates);
    }
    return { peakRssMb: services[0]!.memory().peakRssMb, restRssMb };
  } finally {
    await stopServices(services);
    await pool.end();
  }
}
