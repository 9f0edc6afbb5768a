import path from 'node:path';
import PgBoss from 'pg-boss';
import { expiringRowsScanPage } from '../../shared/db/queries/expiring-rows';
import { targetResolve } from '../../shared/db/queries/target';
import { checkFinished, checkSeatRows, throughput, type BenchContext, type Measured } from '../lib/context';
import { CpuMeter } from '../lib/cpu';
import { countSeatRows, databaseNowIso, type Seed } from '../lib/database';
import { seatHoldsPolicy } from '../lib/policies';
import { startNodeScript, stopServices, type ChildService } from '../lib/services';
import { pollUntil } from '../lib/wait';
import type { BatchJobData, RowJobData } from './sql';

/**
 * pg-boss 10 doing reaper's job: the enqueuer (this process, in reaper's scheduler role) runs the
 * same keyset scan as reaper (the product's own query) and inserts jobs, while worker processes
 * (pgboss-worker.ts, in reaper's workers' role) are already draining. Timed like reaper's run:
 * from the start of the scan to the last job completed, both on the database clock.
 */

/**
 * Scan pages per insert: the same window reaper publishes before it waits for confirms. The scan
 * mirrors reaper's scanWindow (one query per page); if that changes, change this with it.
 */
const PAGES_PER_INSERT = 32;
/** Rows per scan page in one-job-per-row mode (one job each). */
const ROW_MODE_PAGE = 1000;
const WORKER_SCRIPT = path.join(__dirname, 'pgboss-worker.js');

export interface PgBossOptions {
  /** batch: one job per `batchSize` rows; row: one job per row (the common design). */
  mode: 'batch' | 'row';
  batchSize: number;
  workers: number;
  /** Concurrent fetch loops (each with its own connection) per worker process. */
  loopsPerWorker: number;
  /** Jobs per fetch(). */
  fetchSize: number;
  /** Only the first `limitRows` candidates (one-job-per-row mode is slow); rows/s is measured on them. */
  limitRows?: number;
}

export interface PgBossResult extends Measured {
  jobs: number;
  enqueueSeconds: number;
  workerPeakRssMb: number[];
}

export async function runPgBoss(context: BenchContext, seed: Seed, options: PgBossOptions): Promise<PgBossResult> {
  await context.databases.fresh();
  const queue = options.mode === 'batch' ? 'bench-batches' : 'bench-rows';
  const boss = new PgBoss({ connectionString: context.databases.url, supervise: false, schedule: false, migrate: true, max: 2, application_name: 'bench-pgboss-enqueuer' });
  boss.on('error', (error) => context.progress(`pg-boss error: ${error.message}`));
  await boss.start();
  await boss.createQueue(queue);
  const pool = context.databases.pool(2, 'bench-pgboss-scan');
  const workers: ChildService[] = [];
  try {
    const spec = seatHoldsPolicy('pgboss', options.batchSize);
    const target = await targetResolve(pool, spec);
    for (let i = 1; i <= options.workers; i++) {
      workers.push(
        startNodeScript(`pgboss-worker-${i}`, WORKER_SCRIPT, {
          DATABASE_URL: context.databases.url,
          BENCH_PGBOSS_QUEUE: queue,
          BENCH_PGBOSS_MODE: options.mode,
          BENCH_PGBOSS_LOOPS: String(options.loopsPerWorker),
          BENCH_PGBOSS_FETCH: String(options.fetchSize),
        }),
      );
    }
    await Promise.all(workers.map((worker) => worker.waitForOutput('ready')));

    const cpu = new CpuMeter(pool, { services: workers, backends: 'bench-pgboss-%', includeSelf: true });
    await cpu.start();
    const limit = options.limitRows ?? seed.candidates;
    const started = (await pool.query<{ at: number }>('SELECT extract(epoch FROM clock_timestamp())::float8 AS at')).rows[0]!.at;
    const cutoff = await databaseNowIso(pool);
    const deadline = Date.now() + context.boundMs;
    let after: { expiry: string; key: string } | null = null;
    let rows = 0;
    let jobs = 0;
    let scanned = false;
    while (!scanned && rows < limit && Date.now() < deadline) {
      const window: PgBoss.JobInsert<BatchJobData | RowJobData>[] = [];
      // One scan query per insert, cut into jobs in memory: the same way reaper's scheduler reads
      // a window, so both enqueue from an identical scan.
      const pageSize = options.mode === 'batch' ? options.batchSize : ROW_MODE_PAGE;
      const windowRows = Math.min(pageSize * (options.mode === 'batch' ? PAGES_PER_INSERT : 1), limit - rows);
      const scannedRows = await expiringRowsScanPage(pool, target, { cutoff, after, limit: windowRows });
      if (scannedRows.length < windowRows) scanned = true;
      if (scannedRows.length > 0) {
        const last = scannedRows[scannedRows.length - 1]!;
        after = { expiry: last.observedExpiry, key: last.id };
        rows += scannedRows.length;
      }
      for (let start = 0; start < scannedRows.length; start += pageSize) {
        const items = scannedRows.slice(start, start + pageSize);
        if (options.mode === 'batch') window.push({ name: queue, data: { cutoff, items } });
        else for (const item of items) window.push({ name: queue, data: { cutoff, ...item } });
      }
      if (window.length > 0) await boss.insert(window);
      jobs += window.length;
    }
    const enqueueSeconds = (await pool.query<{ at: number }>('SELECT extract(epoch FROM clock_timestamp())::float8 AS at')).rows[0]!.at - started;

    const done = await pollUntil(
      async () => {
        const { completed, failed } = (
          await pool.query<{ completed: number; failed: number }>(
            `SELECT count(*) FILTER (WHERE state = 'completed')::int AS completed, count(*) FILTER (WHERE state = 'failed')::int AS failed
             FROM pgboss.job WHERE name = $1`,
            [queue],
          )
        ).rows[0]!;
        if (failed > 0) throw new Error(`pg-boss: ${failed} jobs failed`);
        return completed >= jobs ? completed : undefined;
      },
      { deadline, everyMs: 100 },
    );
    const workerPeakRssMb = workers.map((worker) => worker.memory().peakRssMb);
    const cpuSplit = await cpu.finish();
    const figure = `pg-boss ${options.mode === 'batch' ? `${options.batchSize}-row batch jobs` : 'one job per row'}, ${rows} rows`;
    if (!checkFinished(context, figure, done !== undefined)) {
      const progress = (
        await pool.query<{ completed: number; at: number }>(
          `SELECT count(*)::int AS completed, extract(epoch FROM clock_timestamp())::float8 AS at FROM pgboss.job WHERE name = $1 AND state = 'completed'`,
          [queue],
        )
      ).rows[0]!;
      const rowsDone = options.mode === 'batch' ? Math.round((progress.completed / Math.max(1, jobs)) * rows) : progress.completed;
      return { ...throughput(rowsDone, progress.at - started, true), cpu: cpuSplit, jobs, enqueueSeconds, workerPeakRssMb };
    }
    const finished = (
      await pool.query<{ at: number }>(`SELECT extract(epoch FROM max(completed_on))::float8 AS at FROM pgboss.job WHERE name = $1`, [queue])
    ).rows[0]!.at;
    checkSeatRows(context, figure, seed, rows, await countSeatRows(pool));
    return { ...throughput(rows, finished - started), cpu: cpuSplit, jobs, enqueueSeconds, workerPeakRssMb };
  } finally {
    await stopServices(workers);
    await boss.stop({ graceful: false, wait: true }).catch(() => undefined); // its pool may already be gone
    await pool.end();
  }
}
