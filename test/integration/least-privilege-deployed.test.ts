/**
 * Issue 40, items 1, 2 and 7: what gave way under the printed least-privilege roles while every
 * test ran as the superuser.
 *  - the relay under the scheduler's role (as the README deploys it) claimed its outbox rows with
 *    `FOR UPDATE`, which needs UPDATE: every pass was refused and no event was ever published;
 *  - the scheduler's webhook-signature pruning takes `FOR UPDATE` with the same grants;
 *  - adaptive admission (the default) reads other sessions' state in pg_stat_activity, hidden from
 *    a role without pg_read_all_stats: the worker saw nobody and admitted without a rate. The
 *    printed roles now grant it, the worker refuses to start without it, and a session it cannot
 *    see into counts as present;
 *  - the relay waited for the broker's confirms inside its transaction (row locks held, idle in
 *    transaction): now it claims with a lease in a short statement and waits with none open.
 * Each test fails on the code before issue 40 (see its closing note).
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import amqp from 'amqplib';
import pg from 'pg';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type { DbRoleNames } from '../../shared/db/queries/roles';
import { webhookSignaturesDeleteExpired } from '../../shared/db/queries/webhooks';
import { admissionOthersSample, admissionOverrideSet, admissionRowsEnsure } from '../../shared/db/queries/admission';
import { makePool } from '../../shared/db/pool';
import { parsePolicies } from '../../shared/config/policies';
import { paceFor } from '../../services/scheduler/scheduler';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli, startReaper, stopLeftovers, type ReaperProcess } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { seedHolds, countReservations } from '../support/seed';
import { databaseUrlAs, dropTestRoles } from '../support/db-roles';
import { TcpProxy } from '../support/tcp-proxy';
import { openTestBroker } from '../support/broker';
import { brokerNames } from '../../shared/amqp/topology';

const suffix = randomBytes(4).toString('hex');
const roles: DbRoleNames = { migrator: `reaper_migrator_${suffix}`, scheduler: `reaper_scheduler_${suffix}`, worker: `reaper_worker_${suffix}`, operator: `reaper_operator_${suffix}` };
/** A role of the application's own (table grants only): its sessions are what adaptive admission must see. */
const application = `reaper_test_app_${suffix}`;
/** A role with the worker's table grants but not pg_read_all_stats (what the printed roles made before). */
const blindWorker = `reaper_blind_worker_${suffix}`;

let bed: TestBed;
let policiesPath: string;
let eventsQueue: string;
const started: ReaperProcess[] = [];

const urlAs = (role: string) => databaseUrlAs(bed.databaseUrl, role);

before(async () => {
  bed = await makeTestBed('least_privilege_deployed');
  policiesPath = bed.writePolicies(rowDeletePolicyYaml({ batchSize: 20, events: true }));
  const printed = await runReaperCli(
    ['roles', '--print', '--policies', policiesPath, '--migrator', roles.migrator, '--scheduler', roles.scheduler, '--worker', roles.worker, '--operator', roles.operator],
    { PATH: process.env.PATH },
  );
  assert.equal(printed.code, 0, printed.stdout);
  await bed.pool.query(printed.stdout);
  await bed.pool.query(`CREATE ROLE ${pg.escapeIdentifier(application)} LOGIN; GRANT CONNECT ON DATABASE ${pg.escapeIdentifier(new URL(bed.databaseUrl).pathname.slice(1))} TO ${pg.escapeIdentifier(application)}`);
  // The worker's grants under another name, then without pg_read_all_stats: the printed worker
  // role as it was before issue 40.
  const blind = await runReaperCli(
    ['roles', '--print', '--policies', policiesPath, '--migrator', roles.migrator, '--scheduler', roles.scheduler, '--worker', blindWorker, '--operator', roles.operator],
    { PATH: process.env.PATH },
  );
  assert.equal(blind.code, 0, blind.stdout);
  await bed.pool.query(blind.stdout);
  await bed.pool.query(`REVOKE pg_read_all_stats FROM ${pg.escapeIdentifier(blindWorker)}`);
  // A consumer's queue for the events (an unroutable event is never confirmed), under the bed's prefix.
  eventsQueue = `${bed.prefix}.events-check`;
  const connection = await amqp.connect(bed.amqpUrl);
  try {
    const channel = await connection.createChannel();
    await channel.assertExchange(brokerNames(bed.prefix).eventsExchange, 'topic', { durable: true });
    await channel.assertQueue(eventsQueue, { durable: true });
    await channel.bindQueue(eventsQueue, brokerNames(bed.prefix).eventsExchange, '*.expired');
  } finally {
    await connection.close();
  }
});

after(async () => {
  const failures: unknown[] = [];
  for (const step of [
    () => stopLeftovers(started.splice(0), 5_000),
    () => assertNoLeakedProcesses(),
    () => dropTestRoles(bed.pool, [...Object.values(roles), application, blindWorker]),
    () => bed?.close(),
  ]) {
    try {
      await step();
    } catch (error) {
      failures.push(error);
    }
  }
  if (failures.length > 0) throw failures[0];
});

function start(label: string, command: 'scheduler' | 'worker' | 'relay', role: string, env: Record<string, string> = {}): ReaperProcess {
  const process = startReaper(label, [command], bed.processEnv({ REAPER_WORKER_ID: label, DATABASE_URL: urlAs(role), ...env }));
  started.push(process);
  return process;
}

test('the printed roles grant what the relay and adaptive admission read', async () => {
  const printed = await runReaperCli(['roles', '--print', '--policies', policiesPath, '--worker', roles.worker, '--scheduler', roles.scheduler], { PATH: process.env.PATH });
  assert.match(printed.stdout, /GRANT SELECT, INSERT, UPDATE, DELETE ON "cleanup_outbox" TO "reaper_scheduler_/, "the relay claims (UPDATE) and deletes; the scheduler inserts a retired partition's event");
  assert.match(printed.stdout, /GRANT SELECT, INSERT, UPDATE, DELETE ON "cleanup_webhook_signatures" TO "reaper_scheduler_/, 'the prune locks (UPDATE) and deletes');
  assert.match(printed.stdout, /adaptive admission \(other sessions' state\)[^\n]*\nGRANT pg_read_all_stats TO "reaper_worker_/, 'an adaptive row-delete policy (the default) gets pg_read_all_stats');
  // Not through bed.writePolicies: that would make this file the services' policies.
  const fixed = path.join(mkdtempSync(path.join(tmpdir(), 'reaper-fixed-rate-')), 'policies.yaml');
  writeFileSync(fixed, rowDeletePolicyYaml({ batchSize: 20 }).replace('batchSize: 20', 'batchSize: 20\n    admission: { adaptive: false }'));
  const withoutAdaptive = await runReaperCli(['roles', '--print', '--policies', fixed], { PATH: process.env.PATH });
  assert.equal(withoutAdaptive.code, 0, withoutAdaptive.stdout);
  assert.doesNotMatch(withoutAdaptive.stdout, /pg_read_all_stats/, 'nothing to read: no grant');
});

test('worker, scheduler and relay under the printed roles: rows deleted and every event published', async () => {
  const holds = await seedHolds(bed.pool, { expiredHeld: 60 });
  const broker = await openTestBroker(bed.amqpUrl);
  try {
    const scheduler = start('dep-scheduler', 'scheduler', roles.scheduler);
    const worker = start('dep-worker', 'worker', roles.worker);
    await Promise.all([scheduler.waitForLine('started', (line) => line.msg === 'scheduler started'), worker.waitForLine('started', (line) => line.msg === 'worker started')]);
    const relay = start('dep-relay', 'relay', roles.scheduler);
    const triggered = await runReaperCli(['trigger', 'seat-holds', '--wait', '--timeout', '60', '--json'], bed.processEnv({ DATABASE_URL: urlAs(roles.operator) }));
    assert.equal(triggered.code, 0, triggered.stdout);
    assert.equal(await countReservations(bed.pool, holds.expiredHeld), 0, 'every expired hold deleted by the worker role');
    await eventually('every event published and the outbox empty', async () => (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_outbox')).rows[0]!.n === 0, {
      timeoutMs: 20_000,
      describe: async () => relay.lines.filter((line) => Number(line.level) >= 40).slice(-3),
    });
    assert.equal(await broker.messageCount(eventsQueue), 60, 'one event per deleted row');
    const refused = [scheduler, worker, relay].flatMap((p) => p.lines.filter((line) => /permission denied/.test(JSON.stringify(line))).map((line) => `${p.label}: ${JSON.stringify(line)}`));
    assert.deepEqual(refused, [], 'no statement was refused');
    for (const p of [relay, worker, scheduler]) assert.equal((await p.stop()).code, 0, `${p.label} exits 0`);
  } finally {
    await broker.close();
  }
});

test('the scheduler role prunes expired webhook signatures', async () => {
  await bed.pool.query(`INSERT INTO cleanup_webhook_signatures (signature, policy, expires_at) VALUES ('old-1', 'p', now() - interval '1 hour'), ('new-1', 'p', now() + interval '1 hour')`);
  const client = new pg.Client({ connectionString: urlAs(roles.scheduler) });
  await client.connect();
  try {
    assert.equal(await webhookSignaturesDeleteExpired(client as unknown as Parameters<typeof webhookSignaturesDeleteExpired>[0]), 1);
  } finally {
    await client.end();
  }
  const left = await bed.pool.query<{ signature: string }>('SELECT signature FROM cleanup_webhook_signatures ORDER BY 1');
  assert.deepEqual(left.rows.map((row) => row.signature), ['new-1']);
});

test("the scheduler role reads what it paces runs by: an operator's override of a fixed rate, and the adaptive rate's row", async () => {
  // paceFor's override read falls back to the file's rate on any error, a refused SELECT included:
  // only the override's own rate (4,000, not the file's 250) shows the read went through.
  const policies = parsePolicies(
    combinedPoliciesYaml(
      rowDeletePolicyYaml({ name: 'paced-fixed' }).replace(/\n$/, '\n    admission: { adaptive: false, rowsPerSecond: 250 }\n'),
      rowDeletePolicyYaml({ name: 'paced-adaptive' }),
    ),
    'paced.yaml',
    {},
  );
  await admissionOverrideSet(bed.pool, { policy: 'paced-fixed', rate: 4_000, setBy: 'least-privilege test' });
  await admissionRowsEnsure(bed.pool, 'paced-adaptive', 500);
  const schedulerPool = makePool(urlAs(roles.scheduler), 1, 'reaper-scheduler-pace-test');
  try {
    assert.equal((await paceFor(schedulerPool, policies.get('paced-fixed')!)!.read()).rate, 4_000, "the override, read as the scheduler's role");
    assert.deepEqual(await paceFor(schedulerPool, policies.get('paced-adaptive')!)!.read(), { rate: null, lastTakeAt: null, lastTakeSawOthers: null }, "the adaptive row, read as the scheduler's role");
  } finally {
    await schedulerPool.end();
  }
  // A role that may not read the overrides (the application's: no grant on reaper's tables): the
  // read is refused, and the run is paced by the file's rate, not published in full windows at once.
  const refusedPool = makePool(urlAs(application), 1, 'reaper-scheduler-pace-refused');
  try {
    await assert.rejects(refusedPool.query('SELECT 1 FROM cleanup_admission_overrides'), /permission denied/, 'the role cannot read the overrides');
    assert.equal((await paceFor(refusedPool, policies.get('paced-fixed')!)!.read()).rate, 250, "a failed read of the overrides paces by the file's rate");
  } finally {
    await refusedPool.end();
  }
});

test('adaptive admission as deployed: the worker refuses to start when it cannot see other sessions, and an unseen session is present', async () => {
  // The application is in a transaction (as a busy application mostly is).
  const app = new pg.Client({ connectionString: urlAs(application) });
  await app.connect();
  const blind = new pg.Client({ connectionString: urlAs(blindWorker) });
  await blind.connect();
  try {
    await app.query('BEGIN; SELECT 1');
    const seen = await admissionOthersSample(blind as unknown as Parameters<typeof admissionOthersSample>[0]);
    assert.ok(seen.present >= 1, `a session this role cannot see into counts as present (${JSON.stringify(seen)})`);
  } finally {
    await app.query('ROLLBACK').catch(() => undefined);
    await app.end();
    await blind.end();
  }
  const worker = start('dep-blind-worker', 'worker', blindWorker);
  const exit = await worker.exited;
  assert.equal(exit.code, 1, 'the worker refuses to start');
  assert.match(worker.output.join('\n'), new RegExp(`GRANT pg_read_all_stats TO \\\\?"${blindWorker}\\\\?"`), 'and names the GRANT');
});

test('the relay holds no transaction open while it waits for the broker', async () => {
  const amqpTarget = new URL(bed.amqpUrl);
  const proxy = await TcpProxy.start({ targetHost: amqpTarget.hostname, targetPort: Number(amqpTarget.port || 5672) });
  try {
    const relay = start('dep-relay-stalled', 'relay', roles.scheduler, { AMQP_URL: proxy.urlFor(bed.amqpUrl) });
    // Connected (the proxy carries its broker connection), then every byte of it is held back.
    await relay.waitForLine('relay started', (line) => line.msg === 'relay started', 20_000);
    proxy.stallAll();
    // Rows in the outbox (as a deletion writes them) once no confirm can arrive.
    await bed.pool.query(
      `INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, policy_version) SELECT 'seat-holds', 'stall-' || i, now(), now(), 'v' FROM generate_series(1, 5) i`,
    );
    await eventually('the relay to claim the rows while the broker is stalled', async () =>
      (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_outbox WHERE key LIKE 'stall-%' AND claimed_by IS NOT NULL`)).rows[0]!.n === 5,
    { timeoutMs: 20_000 });
    const sessions = await bed.pool.query<{ state: string }>(
      `SELECT state FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-relay' AND state LIKE 'idle in transaction%'`,
    );
    assert.deepEqual(sessions.rows, [], 'no relay session is idle in a transaction while it waits for confirms');
    const locked = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM (SELECT 1 FROM cleanup_outbox WHERE key LIKE 'stall-%' FOR UPDATE NOWAIT) x`);
    assert.equal(locked.rows[0]!.n, 5, 'the rows are not locked meanwhile');
    proxy.heal();
    await eventually('the stalled rows published once the broker answers', async () =>
      (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_outbox WHERE key LIKE 'stall-%'`)).rows[0]!.n === 0,
    { timeoutMs: 30_000 });
    assert.equal((await relay.stop()).code, 0);
  } finally {
    proxy.heal();
    await proxy.close();
  }
});
