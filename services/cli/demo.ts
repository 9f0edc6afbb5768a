import { spawn, type ChildProcess } from 'node:child_process';
import path from 'node:path';
import amqp from 'amqplib';
import pg from 'pg';
import { loadEnv } from '../../shared/config/env';
import { loadPolicies } from '../../shared/config/policies';
import { migrate } from '../../shared/db/migrate';
import { makeTopology } from '../../shared/amqp/topology';
import { runsGetSummary, runsInsertIfAbsent, type RunSummary } from '../../shared/db/queries/runs';

/**
 * `npm run demo`: the main job end to end on the real servers. Creates and migrates the
 * reaper_demo database, seeds holds, starts one scheduler and two workers as separate processes,
 * triggers a run, renews some expired holds after the scan and before the workers see them, waits
 * for the queue to drain and prints what happened. Exits 1 if any hold was wrongly kept or deleted.
 */

const DEMO_DATABASE = 'reaper_demo';
const DEMO_PREFIX = 'reaper-demo';
const SEED = { expiredHeld: 12_000, futureHeld: 5_000, expiredConfirmed: 3_000, renewAfterScan: 500 };
const BIN = path.resolve(__dirname, '..', '..', '..', 'bin', 'reaper');

function say(text: string): void {
  process.stdout.write(`${text}\n`);
}

export async function runDemo(): Promise<number> {
  const started = Date.now();
  const env = loadEnv();
  const adminUrl = env.databaseUrl;
  const demoUrl = new URL(adminUrl);
  demoUrl.pathname = `/${DEMO_DATABASE}`;

  say(`1. creating database ${DEMO_DATABASE} and applying migrations`);
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${DEMO_DATABASE} WITH (FORCE)`);
  await admin.query(`CREATE DATABASE ${DEMO_DATABASE}`);
  await admin.end();
  await migrate(demoUrl.toString());
  const pool = new pg.Pool({ connectionString: demoUrl.toString(), max: 2 });

  const policies = loadPolicies(env.policiesPath);
  await resetBroker(env.amqpUrl, [...policies.keys()]);

  say(`2. seeding ${SEED.expiredHeld + SEED.futureHeld + SEED.expiredConfirmed} holds: ${SEED.expiredHeld} expired and held, ${SEED.futureHeld} held until tomorrow, ${SEED.expiredConfirmed} expired but confirmed`);
  await pool.query(
    `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat, holder)
     SELECT gen_random_uuid(), kind.status, kind.base + (random() * interval '50 minutes'), 'seat-' || i, 'guest-' || i
     FROM (VALUES ('held', now() - interval '1 hour', $1::int), ('held', now() + interval '1 day', $2::int),
                  ('confirmed', now() - interval '1 hour', $3::int)) AS kind(status, base, n),
          LATERAL generate_series(1, kind.n) i`,
    [SEED.expiredHeld, SEED.futureHeld, SEED.expiredConfirmed],
  );

  const children: ChildProcess[] = [];
  const serviceEnv = { ...process.env, DATABASE_URL: demoUrl.toString(), REAPER_AMQP_PREFIX: DEMO_PREFIX, LOG_LEVEL: process.env.LOG_LEVEL ?? 'warn' };
  const startService = (args: string[], workerId: string): void => {
    const child = spawn(process.execPath, [BIN, ...args], { env: { ...serviceEnv, REAPER_WORKER_ID: workerId }, stdio: ['ignore', 'inherit', 'inherit'] });
    children.push(child);
  };
  try {
    say('3. starting one scheduler; triggering a run (cutoff = database clock now)');
    startService(['scheduler'], 'demo-scheduler');
    const run = (await runsInsertIfAbsent(pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const published = await waitFor(pool, run.runId, (r) => r.state !== 'pending' && r.state !== 'scanning', 120_000);
    say(`   run ${run.runId}: ${published.candidates} candidates in ${published.batchesConfirmed} batches, confirmed by the broker`);

    say(`4. renewing ${SEED.renewAfterScan} expired holds AFTER the scan (their batches are already queued)`);
    const renewed = await pool.query<{ reservation_id: string }>(
      `UPDATE seat_reservations SET expires_at = now() + interval '15 minutes', updated_at = now()
       WHERE reservation_id IN (SELECT reservation_id FROM seat_reservations WHERE status = 'held' AND expires_at <= $1::timestamptz LIMIT $2)
       RETURNING reservation_id`,
      [run.cutoff, SEED.renewAfterScan],
    );
    const renewedIds = renewed.rows.map((row) => row.reservation_id);

    say('5. starting two workers; waiting for the queue to drain');
    startService(['worker'], 'demo-worker-1');
    startService(['worker'], 'demo-worker-2');
    const done = await waitFor(pool, run.runId, (r) => r.state === 'completed' || r.state === 'failed', 300_000, (r) =>
      process.stdout.write(`   ${r.batchesDone}/${r.batchesConfirmed} batches, ${r.deleted} deleted, ${r.noop} no-op\r`),
    );
    process.stdout.write('\n');

    const counts = (
      await pool.query<{ expired_held_left: number; renewed_kept: number; confirmed_kept: number; future_kept: number }>(
        `SELECT count(*) FILTER (WHERE status = 'held' AND expires_at <= $1::timestamptz)::int AS expired_held_left,
                count(*) FILTER (WHERE reservation_id = ANY($2::uuid[]))::int AS renewed_kept,
                count(*) FILTER (WHERE status = 'confirmed')::int AS confirmed_kept,
                count(*) FILTER (WHERE status = 'held' AND expires_at > now() + interval '1 hour')::int AS future_kept
         FROM seat_reservations`,
        [run.cutoff, renewedIds],
      )
    ).rows[0]!;
    const seconds = (Date.now() - started) / 1000;
    const expectedDeleted = SEED.expiredHeld - renewedIds.length;
    const correct =
      done.state === 'completed' &&
      done.deleted === expectedDeleted &&
      counts.expired_held_left === 0 &&
      counts.renewed_kept === renewedIds.length &&
      counts.confirmed_kept === SEED.expiredConfirmed &&
      counts.future_kept === SEED.futureHeld;

    say('');
    say('summary (seat-holds)');
    say(`  candidates found by the scan    ${done.candidates}`);
    say(`  deleted                         ${done.deleted}   (expected ${expectedDeleted})`);
    say(`  no-ops (changed since the scan) ${done.noop}`);
    say(`  renewed after the scan, kept    ${counts.renewed_kept} of ${renewedIds.length}`);
    say(`  confirmed, kept                 ${counts.confirmed_kept} of ${SEED.expiredConfirmed}`);
    say(`  not yet expired, kept           ${counts.future_kept} of ${SEED.futureHeld}`);
    say(`  expired holds left behind       ${counts.expired_held_left}`);
    say(`  seconds                         ${seconds.toFixed(1)}`);
    say(correct ? 'OK: every expired, unrenewed, unconfirmed hold was deleted, and no other.' : 'FAILED: see the counts above.');
    return correct ? 0 : 1;
  } finally {
    for (const child of children) child.kill('SIGTERM');
    await Promise.all(children.map((child) => new Promise((resolve) => (child.exitCode !== null ? resolve(null) : child.once('exit', resolve)))));
    await pool.end();
  }
}

async function waitFor(
  pool: pg.Pool,
  runId: string,
  until: (run: RunSummary) => boolean,
  timeoutMs: number,
  progress?: (run: RunSummary) => void,
): Promise<RunSummary> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const run = (await runsGetSummary(pool, runId))!;
    progress?.(run);
    if (until(run)) return run;
    if (Date.now() > deadline) throw new Error(`demo: run ${runId} did not get there in ${timeoutMs / 1000} s (state ${run.state})`);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

/** Deletes the demo's queues so an earlier, interrupted demo leaves nothing to count twice. */
async function resetBroker(amqpUrl: string, policies: string[]): Promise<void> {
  const connection = await amqp.connect(amqpUrl);
  const channel = await connection.createChannel();
  const topology = makeTopology({ prefix: DEMO_PREFIX, policies, deliveryLimit: 20 });
  for (const queue of topology.queues) await channel.deleteQueue(queue.name);
  await channel.close();
  await connection.close();
}
