/**
 * A pg-boss 10 worker process for the comparison (started by pgboss.ts, one process per worker,
 * like reaper's workers). It drains jobs with pg-boss's own fetch() and complete(), the calls
 * work() makes, in a tight loop: work() sleeps the polling interval (at least 0.5 s) after every
 * fetch that finished sooner, which caps a worker at one fetch per half second. Driving the same
 * calls directly is pg-boss at its best.
 *
 * Environment: DATABASE_URL, BENCH_PGBOSS_QUEUE, BENCH_PGBOSS_MODE (batch | row),
 * BENCH_PGBOSS_LOOPS (concurrent fetch loops), BENCH_PGBOSS_FETCH (jobs per fetch).
 * Prints "ready" once it consumes; stops on SIGTERM.
 */
import PgBoss from 'pg-boss';
import pg from 'pg';
import { DELETE_BATCH_SQL, DELETE_ROW_SQL, type BatchJobData, type RowJobData } from './sql';

/** How long an idle loop waits before fetching again (the queue may still be filling). */
const IDLE_MS = 20;

function required(name: string): string {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
}

async function main(): Promise<void> {
  const databaseUrl = required('DATABASE_URL');
  const queue = required('BENCH_PGBOSS_QUEUE');
  const mode = required('BENCH_PGBOSS_MODE');
  if (mode !== 'batch' && mode !== 'row') throw new Error(`BENCH_PGBOSS_MODE must be batch or row (got ${mode})`);
  const loops = Number(required('BENCH_PGBOSS_LOOPS'));
  const fetchSize = Number(required('BENCH_PGBOSS_FETCH'));

  // Maintenance and cron are pg-boss background duties that do not belong in a 10-second drain.
  const boss = new PgBoss({ connectionString: databaseUrl, supervise: false, schedule: false, migrate: false, max: loops + 1, application_name: 'bench-pgboss-worker' });
  boss.on('error', (error) => process.stderr.write(`pg-boss error: ${error.message}\n`));
  await boss.start();
  const deletes = new pg.Pool({ connectionString: databaseUrl, max: loops, application_name: 'bench-pgboss-worker' });

  let stopping = false;
  process.once('SIGTERM', () => (stopping = true));

  /** One transaction per job, as reaper commits one transaction per batch. */
  async function runBatchJob(client: pg.PoolClient, data: BatchJobData): Promise<void> {
    await client.query('BEGIN');
    await client.query(DELETE_BATCH_SQL, [data.items.map((item) => item.id), data.items.map((item) => item.observedExpiry), data.cutoff]);
    await client.query('COMMIT');
  }

  async function loop(): Promise<void> {
    const client = await deletes.connect();
    try {
      while (!stopping) {
        if (mode === 'batch') {
          const jobs = await boss.fetch<BatchJobData>(queue, { batchSize: fetchSize });
          if (jobs.length === 0) {
            await new Promise((resolve) => setTimeout(resolve, IDLE_MS));
            continue;
          }
          for (const job of jobs) await runBatchJob(client, job.data);
          await boss.complete(queue, jobs.map((job) => job.id));
        } else {
          const jobs = await boss.fetch<RowJobData>(queue, { batchSize: fetchSize });
          if (jobs.length === 0) {
            await new Promise((resolve) => setTimeout(resolve, IDLE_MS));
            continue;
          }
          // One job, one row, one autocommitted DELETE: the common design.
          for (const job of jobs) await client.query(DELETE_ROW_SQL, [job.data.id, job.data.observedExpiry, job.data.cutoff]);
          await boss.complete(queue, jobs.map((job) => job.id));
        }
      }
    } finally {
      client.release();
    }
  }

  const running = Array.from({ length: loops }, () => loop());
  process.stdout.write('ready\n');
  await Promise.all(running);
  await boss.stop({ graceful: false, wait: true });
  await deletes.end();
}

main().then(
  () => process.exit(0),
  (error: unknown) => {
    process.stderr.write(`${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`);
    process.exit(1);
  },
);
