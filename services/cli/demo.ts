import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, rmdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type { Channel } from 'amqplib';
import pg from 'pg';
import { DEMO_POLICIES_PATH, loadEnv, type Env } from '../../shared/config/env';
import { loadPolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import { demoTablesCreate, serviceSessionUsers } from '../../shared/db/queries/demo-tables';
import { migrate } from '../../shared/db/migrate';
import { makeTopology } from '../../shared/amqp/topology';
import { runsGetSummary, runsInsertIfAbsent, type Run, type RunSummary } from '../../shared/db/queries/runs';
import type { MediaApi } from '../../tools/media-api/server';
import { OBJECTS_POLICY, startObjectStorageDemo } from './demo-s3';
import { appendPartitionPolicy, createPartitionedDemoTable, PARTITION_POLICY, retiredCount, summarisePartitions } from './demo-partitions';
import { rolesSql, type DbRoleNames } from '../../shared/db/queries/roles';
import { policiesForRoles } from './roles';
import { connectBroker, explainDatabaseError } from './connections';
import { outputWidth, wrap } from './output';

/**
 * `npm run demo`: both demo policies end to end on the real servers, in a database of their own.
 *  - seat-holds (row-delete): holds expired, future and confirmed; some expired holds are renewed
 *    AFTER the scan published their batches and before any worker saw them.
 *  - media-assets (remote-delete): expired assets deleted through a stand-in media API on
 *    127.0.0.1:8081 that enforces its own rate limit, throttles for a moment (429 + Retry-After),
 *    fails a few calls (503) and permanently rejects a few assets (403).
 *  - media-objects (remote-delete, remote.kind s3; demo-s3.ts): archived assets' objects deleted
 *    from an in-process S3 server in DeleteObjects batches; the store refuses a few (AccessDenied).
 *  - day-events (row-delete, partitions.retire; demo-partitions.ts): a table partitioned by day;
 *    its wholly expired partitions are retired (moved to reaper_retired), a partition with a held
 *    row and one half expired go through the row path, a future one is left alone.
 * One scheduler and two workers run as separate processes. Exits 1 if any count is wrong.
 * What it made stays for a look (the summary prints the environment that shows it) until
 * `reaper demo --clean` removes it.
 */

/** Everything the demo makes under a name of its own: `reaper demo --clean` removes exactly these. */
export interface DemoNames {
  database: string;
  /** REAPER_AMQP_PREFIX of the demo's services: its queues and exchanges. */
  prefix: string;
  /** `reaper roles --print` names for the demo's policies (cluster-wide). */
  roles: DbRoleNames;
  /** The demo's policies file (REAPER_POLICIES of its services), kept for `reaper status` after the demo. */
  policiesFile: string;
  /** Owner role of the demo's partitioned table (cluster-wide; the DETACH needs the table's owner). */
  tableOwner: string;
}

export const DEMO_NAMES: DemoNames = {
  database: 'reaper_demo',
  prefix: 'reaper-demo',
  roles: { migrator: 'reaper_demo_migrator', scheduler: 'reaper_demo_scheduler', worker: 'reaper_demo_worker', operator: 'reaper_demo_operator' },
  policiesFile: path.join(tmpdir(), 'reaper-demo', 'policies.yaml'),
  tableOwner: 'reaper_demo_app_owner',
};
const HOLDS = { expiredHeld: 12_000, futureHeld: 5_000, expiredConfirmed: 3_000, renewAfterScan: 500 };
const MEDIA = { expiredActive: 600, futureActive: 100, rejected: 5, failingCalls: 5, throttleMs: 1_500 };
const STAND_IN_PORT = 8081; // the demo policies file points media-assets here
const BIN = path.resolve(__dirname, '..', '..', '..', 'bin', 'reaper');

function say(text: string): void {
  process.stdout.write(`${text}\n`);
}

/**
 * The stand-in, loaded on demand: the `runtime` image target leaves tools/ out (only the `demo`
 * target of infra/Dockerfile carries it), so a static import would break every command there.
 */
function loadStandIn(): typeof import('../../tools/media-api/server') {
  try {
    return require('../../tools/media-api/server') as typeof import('../../tools/media-api/server');
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== 'MODULE_NOT_FOUND') throw error;
    throw new Error('demo: this image has no stand-in media API; build the demo target (docker build -f infra/Dockerfile --target demo .) or run `npm run demo` from the source tree');
  }
}

export async function runDemo(names: DemoNames = DEMO_NAMES): Promise<number> {
  const started = Date.now();
  const { startMediaApi } = loadStandIn(); // before any side effect: fails at once in the runtime image
  const env = loadEnv();
  const demoUrl = demoDatabaseUrl(env, names);
  const policies = loadPolicies(DEMO_POLICIES_PATH);
  const media = policies.get('media-assets') as RemoteDeletePolicy;

  say(`1. creating database ${names.database} and applying migrations`);
  const pool = await prepareDemoDatabase(env, names);
  await resetBroker(env, names.prefix, [...policies.keys(), PARTITION_POLICY]);
  say(`2. seeding ${HOLDS.expiredHeld} expired holds, ${HOLDS.futureHeld} held until tomorrow, ${HOLDS.expiredConfirmed} expired but confirmed;`);
  say(`   ${MEDIA.expiredActive} media assets past retention (${MEDIA.rejected} of which the API will refuse), ${MEDIA.futureActive} still retained;`);
  say('   a table partitioned by day: 3 days wholly expired, one with a row under a legal hold, one half expired, one in the future');
  await seed(pool);
  const objects = await startObjectStorageDemo(names.policiesFile);
  await objects?.seed(pool);
  if (objects) await resetBroker(env, names.prefix, [OBJECTS_POLICY]);

  let api: MediaApi;
  try {
    api = await startMediaApi({ port: STAND_IN_PORT, ratePerSecond: media.admission.ratePerSecond, burst: media.admission.burst * 2 });
  } catch (error) {
    await pool.end();
    throw new Error(`demo: cannot start the stand-in media API on 127.0.0.1:${STAND_IN_PORT} (${(error as Error).message}); is something else using the port?`);
  }
  api.configure({
    throttleUntil: Date.now() + 60_000, // rate limited until the workers start (reset below)
    failNext: MEDIA.failingCalls,
    rejectIds: new Set(Array.from({ length: MEDIA.rejected }, (_, i) => `asset-${i * 97 + 1}`)),
  });

  const roleUrl = await demoRoles(pool, demoUrl, names);
  const children: ChildProcess[] = [];
  const serviceEnv = {
    ...process.env,
    DATABASE_URL: demoUrl.toString(),
    REAPER_AMQP_PREFIX: names.prefix,
    REAPER_POLICIES: names.policiesFile,
    ...objects?.env,
    LOG_LEVEL: process.env.LOG_LEVEL ?? 'warn',
  };
  const startService = (args: string[], workerId: string): void => {
    children.push(spawn(process.execPath, [BIN, ...args], { env: demoServiceEnv(serviceEnv, roleUrl, args, workerId), stdio: ['ignore', 'inherit', 'inherit', 'ipc'] })); // ipc: a service stops when the demo is gone (runService)
  };
  try {
    say('3. starting one scheduler; triggering a run of each policy (cutoff = database clock now)');
    startService(['scheduler'], 'demo-scheduler');
    const holdsRun = (await runsInsertIfAbsent(pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const mediaRun = (await runsInsertIfAbsent(pool, { policy: 'media-assets', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const objectsRun = objects ? (await runsInsertIfAbsent(pool, { policy: OBJECTS_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))! : null;
    const partitionsRun = (await runsInsertIfAbsent(pool, { policy: PARTITION_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    for (const run of [holdsRun, mediaRun, ...(objectsRun ? [objectsRun] : []), partitionsRun]) {
      const published = await waitFor(pool, run.runId, (r) => r.state !== 'pending' && r.state !== 'scanning', 120_000);
      const retired = run === partitionsRun ? `${await retiredCount(pool, run.runId)} partitions retired first, then ` : '';
      say(`   ${run.policy}: ${retired}${published.candidates} candidates in ${published.batchesConfirmed} batches, confirmed by the broker`);
    }

    say(`4. renewing ${HOLDS.renewAfterScan} expired holds AFTER the scan (their batches are already queued)`);
    const renewedIds = await renewSomeHolds(pool, holdsRun);

    say('5. starting two workers; the media API throttles (429) for the first moments, fails a few calls (503), refuses a few assets (403)');
    api.configure({ throttleUntil: Date.now() + MEDIA.throttleMs });
    const remoteStarted = Date.now();
    startService(['worker'], 'demo-worker-1');
    startService(['worker'], 'demo-worker-2');
    const holdsDone = await waitFor(pool, holdsRun.runId, finished, 300_000);
    let lastProgress = '';
    const mediaDone = await waitFor(pool, mediaRun.runId, finished, 300_000, (r) => {
      const progress = `   media-assets: ${r.batchesDone}/${r.batchesConfirmed} batches finished, ${r.deleted} confirmed`;
      if (progress !== lastProgress) say(progress);
      lastProgress = progress;
    });
    const remoteSeconds = (Date.now() - remoteStarted) / 1000;
    const objectsDone = objectsRun ? await waitFor(pool, objectsRun.runId, finished, 120_000) : null;
    const partitionsDone = await waitFor(pool, partitionsRun.runId, finished, 120_000);

    // While the services still run: who their sessions log in as.
    const logins = await serviceLogins(pool, names, roleUrl('worker') === demoUrl.toString()); // fell back: demoRoles said so
    say(logins.line);
    const holdsOk = await summariseHolds(pool, holdsRun, holdsDone, renewedIds);
    const mediaOk = await summariseMedia(pool, api, media, mediaDone, remoteSeconds);
    const objectsOk = objects && objectsDone ? await objects.summarise(pool, objectsDone) : true;
    const partitionsOk = await summarisePartitions(pool, partitionsRun.runId, partitionsDone);
    say(`\nseconds in all: ${((Date.now() - started) / 1000).toFixed(1)}`);
    const ok = holdsOk && mediaOk && objectsOk && partitionsOk && logins.ok;
    say(
      ok
        ? 'OK: every expired, unrenewed, unconfirmed hold and every expired asset was deleted, once, and nothing else; the wholly expired partitions were retired, the others kept.'
        : 'FAILED: see the counts above.',
    );
    say('');
    for (const line of wayInAndOut(names, roleUrl('operator'))) say(line);
    return ok ? 0 : 1;
  } finally {
    for (const child of children) child.kill('SIGTERM');
    await Promise.all(children.map((child) => new Promise((resolve) => (child.exitCode !== null ? resolve(null) : child.once('exit', resolve)))));
    await api.close();
    await objects?.close();
    await pool.end();
  }
}

/**
 * As deployed (issue 40): the demo's scheduler and workers log in as the least-privilege roles
 * `reaper roles --print` makes for its policies (cluster-wide names, re-applied by every demo), and
 * the environment it prints for a look afterwards as the operator's. Where that cannot be (the
 * demo's DATABASE_URL may not create roles, or the roles cannot log in without a password), they
 * run as that URL's user, and the demo says so.
 */
export async function demoRoles(pool: pg.Pool, demoUrl: URL, names: DemoNames): Promise<(role: keyof DbRoleNames) => string> {
  const asGiven = () => demoUrl.toString();
  try {
    await pool.query(rolesSql(policiesForRoles(names.policiesFile), names.roles));
    const urlOf = (role: keyof DbRoleNames) => {
      const url = new URL(demoUrl.toString());
      url.username = names.roles[role];
      url.password = '';
      return url.toString();
    };
    const probe = new pg.Client({ connectionString: urlOf('worker') });
    await probe.connect();
    await probe.end();
    say(`   the scheduler and the workers log in as ${names.roles.scheduler} and ${names.roles.worker} (reaper roles --print)`);
    return urlOf;
  } catch (error) {
    say(`   note: the services run as the DATABASE_URL's user: the least-privilege roles could not be used here (${(error as Error).message})`);
    return asGiven;
  }
}

/** A demo service's environment: the scheduler's or the workers' role URL (demoRoles) as DATABASE_URL. */
export function demoServiceEnv(base: NodeJS.ProcessEnv, roleUrl: (role: keyof DbRoleNames) => string, args: readonly string[], workerId: string): NodeJS.ProcessEnv {
  return { ...base, DATABASE_URL: roleUrl(args[0] === 'worker' ? 'worker' : 'scheduler'), REAPER_WORKER_ID: workerId };
}

/**
 * Who the running scheduler and workers log in as (pg_stat_activity): ok only when each is its
 * role of `reaper roles --print`, so a demo that fell back to the DATABASE_URL's user (the
 * superuser) says so and does not end OK. A fallback demoRoles announced is allowed.
 */
export async function serviceLogins(pool: pg.Pool, names: DemoNames, fellBack = false): Promise<{ ok: boolean; scheduler: string[]; worker: string[]; line: string }> {
  const users = await serviceSessionUsers(pool);
  const scheduler = users.get('reaper-scheduler') ?? [];
  const worker = users.get('reaper-worker') ?? [];
  const asRoles = scheduler.join() === names.roles.scheduler && worker.join() === names.roles.worker;
  const shown = (list: string[]) => (list.length > 0 ? list.join(', ') : '(no session)');
  return {
    ok: asRoles || fellBack,
    scheduler,
    worker,
    line: `   checked: the scheduler's sessions log in as ${shown(scheduler)}, the workers' as ${shown(worker)}${asRoles ? ' (their roles)' : `, not as ${names.roles.scheduler} and ${names.roles.worker}`}`,
  };
}

/** DATABASE_URL with the demo's database. */
export function demoDatabaseUrl(env: Pick<Env, 'databaseUrl'>, names: DemoNames): URL {
  const url = new URL(env.databaseUrl);
  url.pathname = `/${encodeURIComponent(names.database)}`;
  return url;
}

/**
 * The demo's database made anew (an earlier demo's dropped), migrated, with the demo's tables, and
 * its policies file written where the printed environment points; returns a pool on it.
 */
export async function prepareDemoDatabase(env: Pick<Env, 'databaseUrl'>, names: DemoNames): Promise<pg.Pool> {
  await withAdmin(env, names, async (admin) => {
    await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(names.database)} WITH (FORCE)`);
    await admin.query(`CREATE DATABASE ${pg.escapeIdentifier(names.database)}`);
  });
  const demoUrl = demoDatabaseUrl(env, names).toString();
  await migrate(demoUrl).catch((error: unknown) => {
    throw explainDatabaseError(demoUrl, error);
  });
  // Named as reaper's own: the adaptive admission's start look leaves it out, so the demo's own
  // seeding and checks do not read as an application and its runs go at full speed.
  const pool = new pg.Pool({ connectionString: demoUrl, max: 2, application_name: 'reaper-demo' });
  await demoTablesCreate(pool);
  await createPartitionedDemoTable(pool, names.tableOwner);
  writeDemoPolicies(names.policiesFile);
  appendPartitionPolicy(names.policiesFile);
  return pool;
}

/**
 * A client on DATABASE_URL for creating and dropping the demo's database and roles. When that URL
 * names the demo's database itself (the environment the demo printed), the server's maintenance
 * database `postgres` instead: a database cannot be dropped from inside.
 */
async function withAdmin<T>(env: Pick<Env, 'databaseUrl'>, names: DemoNames, work: (admin: pg.Client) => Promise<T>): Promise<T> {
  const url = new URL(env.databaseUrl);
  if (decodeURIComponent(url.pathname.slice(1)) === names.database) url.pathname = '/postgres';
  const admin = new pg.Client({ connectionString: url.toString() });
  try {
    await admin.connect();
    return await work(admin);
  } catch (error) {
    throw explainDatabaseError(url.toString(), error);
  } finally {
    await admin.end().catch(() => undefined); // never connected, or already gone: nothing to close
  }
}

/** The demo's policies (the shipped file; demo-s3.ts adds its third) where the printed environment points. */
function writeDemoPolicies(file: string): void {
  mkdirSync(path.dirname(file), { recursive: true });
  writeFileSync(file, `${readFileSync(DEMO_POLICIES_PATH, 'utf8').trimEnd()}\n`);
}

/**
 * The summary's last lines: the environment that shows what the demo made (as the printed operator
 * role when the demo could make it; a password in DATABASE_URL is not repeated) and how to remove it.
 */
export function wayInAndOut(names: DemoNames, operatorUrl: string): string[] {
  const url = new URL(operatorUrl);
  const hidden = url.password !== '';
  if (hidden) url.password = '***';
  return [
    wrap(`what the demo made is left in place: database ${names.database}, queues and exchanges ${names.prefix}.*, roles ${[...Object.values(names.roles), names.tableOwner].join(', ')}, policies file ${names.policiesFile}`, outputWidth(), 2),
    `  look at it:  ${inspectEnvironment(names, url.toString())} npx reaper status${hidden ? '   (your password in place of ***)' : ''}`,
    '  remove it:   npx reaper demo --clean',
  ];
}

/** `DATABASE_URL=… REAPER_AMQP_PREFIX=… REAPER_POLICIES=…`: a shell prefix that points reaper at the demo. */
export function inspectEnvironment(names: DemoNames, databaseUrl: string): string {
  return `DATABASE_URL=${shellWord(databaseUrl)} REAPER_AMQP_PREFIX=${shellWord(names.prefix)} REAPER_POLICIES=${shellWord(names.policiesFile)}`;
}

/** A value as one shell word: as it is when it is plain, else in single quotes. */
function shellWord(value: string): string {
  return /^[\w@%+=:,./-]+$/.test(value) ? value : `'${value.replace(/'/g, `'\\''`)}'`;
}

const finished = (run: RunSummary): boolean => ['completed', 'failed', 'incomplete', 'rejected', 'awaiting-approval'].includes(run.state);

async function seed(pool: pg.Pool): Promise<void> {
  await pool.query(
    `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat, holder)
     SELECT gen_random_uuid(), kind.status, kind.base + (random() * interval '50 minutes'), 'seat-' || i, 'guest-' || i
     FROM (VALUES ('held', now() - interval '1 hour', $1::int), ('held', now() + interval '1 day', $2::int),
                  ('confirmed', now() - interval '1 hour', $3::int)) AS kind(status, base, n),
          LATERAL generate_series(1, kind.n) i`,
    [HOLDS.expiredHeld, HOLDS.futureHeld, HOLDS.expiredConfirmed],
  );
  await pool.query(
    `INSERT INTO media_assets (asset_id, status, retention_expires_at, url, metadata)
     SELECT 'asset-' || i, 'active',
            CASE WHEN i <= $1::int THEN now() - interval '1 day' + (random() * interval '1 hour') ELSE now() + interval '30 days' END,
            'https://media.example/originals/' || i || '.jpg', jsonb_build_object('bytes', 1000 + i, 'owner', 'user-' || (i % 50))
     FROM generate_series(1, $1::int + $2::int) i`,
    [MEDIA.expiredActive, MEDIA.futureActive],
  );
}

async function renewSomeHolds(pool: pg.Pool, run: Run): Promise<string[]> {
  const renewed = await pool.query<{ reservation_id: string }>(
    `UPDATE seat_reservations SET expires_at = now() + interval '15 minutes', updated_at = now()
     WHERE reservation_id IN (SELECT reservation_id FROM seat_reservations WHERE status = 'held' AND expires_at <= $1::timestamptz LIMIT $2)
     RETURNING reservation_id`,
    [run.cutoff, HOLDS.renewAfterScan],
  );
  return renewed.rows.map((row) => row.reservation_id);
}

async function summariseHolds(pool: pg.Pool, run: Run, done: RunSummary, renewedIds: string[]): Promise<boolean> {
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
  const expectedDeleted = HOLDS.expiredHeld - renewedIds.length;
  say('');
  say('seat-holds (row-delete)');
  say(`  candidates found by the scan    ${done.candidates}`);
  say(`  deleted                         ${done.deleted}   (expected ${expectedDeleted})`);
  say(`  no-ops (changed since the scan) ${done.noop}`);
  say(`  renewed after the scan, kept    ${counts.renewed_kept} of ${renewedIds.length}`);
  say(`  confirmed, kept                 ${counts.confirmed_kept} of ${HOLDS.expiredConfirmed}`);
  say(`  not yet expired, kept           ${counts.future_kept} of ${HOLDS.futureHeld}`);
  say(`  expired holds left behind       ${counts.expired_held_left}`);
  return (
    done.state === 'completed' &&
    done.deleted === expectedDeleted &&
    counts.expired_held_left === 0 &&
    counts.renewed_kept === renewedIds.length &&
    counts.confirmed_kept === HOLDS.expiredConfirmed &&
    counts.future_kept === HOLDS.futureHeld
  );
}

async function summariseMedia(pool: pg.Pool, api: MediaApi, policy: RemoteDeletePolicy, done: RunSummary, seconds: number): Promise<boolean> {
  const ledger = (
    await pool.query<{ confirmed: number; rejected: number; gave_up: number; retried: number; payload_left: number; still_active_expired: number; future_active: number }>(
      `SELECT (SELECT count(*) FROM cleanup_ledger WHERE policy = 'media-assets' AND outcome = 'confirmed')::int AS confirmed,
              (SELECT count(*) FROM cleanup_ledger WHERE policy = 'media-assets' AND outcome = 'rejected')::int AS rejected,
              (SELECT count(*) FROM cleanup_ledger WHERE policy = 'media-assets' AND outcome = 'gave-up')::int AS gave_up,
              (SELECT count(*) FROM cleanup_ledger WHERE policy = 'media-assets' AND attempt_count > 1)::int AS retried,
              (SELECT count(*) FROM cleanup_ledger WHERE outcome = 'confirmed' AND payload IS NOT NULL)::int AS payload_left,
              (SELECT count(*) FROM media_assets WHERE status = 'active' AND retention_expires_at <= now())::int AS still_active_expired,
              (SELECT count(*) FROM media_assets WHERE status = 'active' AND retention_expires_at > now())::int AS future_active`,
    )
  ).rows[0]!;
  const rateLimited = api.calls.filter((call) => call.status === 429).length;
  const duplicates = [...api.executionsByKey().values()].filter((n) => n > 1).length;
  const executed = api.calls.filter((call) => call.executed).length;
  const { ratePerSecond, burst, concurrency } = policy.admission;
  const maxWindow = api.maxCallsInWindow(1000);
  say('');
  say(`media-assets (remote-delete; limit ${ratePerSecond}/s, burst ${burst}, ${concurrency} at once, across all workers)`);
  say(`  confirmed deleted               ${ledger.confirmed}   (expected ${MEDIA.expiredActive - MEDIA.rejected})`);
  say(`  rejected by the API, kept       ${ledger.rejected}   (expected ${MEDIA.rejected}; left for review with their payload)`);
  say(`  gave up                         ${ledger.gave_up}`);
  say(`  rate limited calls (429)        ${rateLimited}`);
  say(`  operations retried              ${ledger.retried}`);
  say(`  calls in all / executed         ${api.calls.length} / ${executed}; keys executed twice: ${duplicates}`);
  say(`  calls per second                ${(executed / seconds).toFixed(1)} over ${seconds.toFixed(1)} s; most in any second ${maxWindow} (limit + burst ${ratePerSecond + burst})`);
  say(`  most calls at once              ${api.maxConcurrent()} (cap ${concurrency})`);
  say(`  retained assets, kept           ${ledger.future_active} of ${MEDIA.futureActive}`);
  return (
    done.state === 'completed' &&
    ledger.confirmed === MEDIA.expiredActive - MEDIA.rejected &&
    ledger.rejected === MEDIA.rejected &&
    ledger.gave_up === 0 &&
    ledger.payload_left === 0 &&
    ledger.still_active_expired === MEDIA.rejected &&
    ledger.future_active === MEDIA.futureActive &&
    duplicates === 0 &&
    api.maxConcurrent() <= concurrency
  );
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

/**
 * The demo's queues and exchanges, as the services declare them for these policies: the demo's
 * own and, when its kept policies file is there, every policy in it.
 */
function demoTopology(env: Pick<Env, 'deliveryLimit'>, names: DemoNames) {
  const policies = new Set([...loadPolicies(DEMO_POLICIES_PATH).keys(), PARTITION_POLICY, OBJECTS_POLICY]);
  if (existsSync(names.policiesFile)) for (const name of loadPolicies(names.policiesFile).keys()) policies.add(name);
  return makeTopology({ prefix: names.prefix, policies: [...policies], deliveryLimit: env.deliveryLimit });
}

/** Deletes the demo's queues so an earlier, interrupted demo leaves nothing to count twice. */
async function resetBroker(env: Env, prefix: string, policies: string[]): Promise<void> {
  const connection = await connectBroker(env);
  const channel = await connection.createChannel();
  const topology = makeTopology({ prefix, policies, deliveryLimit: 20 });
  for (const queue of topology.queues) await channel.deleteQueue(queue.name);
  await channel.close();
  await connection.close();
}

/**
 * `reaper demo --clean`: removes what the demo made — its database, its queues and exchanges, its
 * roles and its policies file — and says what it found. Safe to run again (nothing left: says so).
 * Returns the lines it printed; throws when something could not be removed (named).
 */
export async function cleanDemo(env: Env, names: DemoNames = DEMO_NAMES): Promise<string[]> {
  const said: string[] = [];
  const tell = (line: string) => {
    said.push(line);
    say(line);
  };
  const topology = demoTopology(env, names);
  const { database, roles } = await withAdmin(env, names, async (admin) => {
    const found = await admin.query('SELECT 1 FROM pg_database WHERE datname = $1', [names.database]);
    await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(names.database)} WITH (FORCE)`);
    // In the roles' own order (migrator, scheduler, worker, operator), whatever order pg_roles returns.
    // The partitioned table's owner role last: it owned objects only in the demo's database, now gone.
    const all = [...Object.values(names.roles), names.tableOwner];
    const present = new Set((await admin.query<{ rolname: string }>('SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])', [all])).rows.map((row) => row.rolname));
    const existing = all.filter((role) => present.has(role));
    // After the database: the roles' grants were there. A role still owning something elsewhere
    // makes DROP ROLE fail with its reason, and the rest is still removed.
    for (const role of existing) await admin.query(`DROP ROLE IF EXISTS ${pg.escapeIdentifier(role)}`);
    return { database: found.rowCount === 1, roles: existing };
  });
  tell(database ? `removed database ${names.database}` : `no database ${names.database}`);
  tell(roles.length > 0 ? `removed roles ${roles.join(', ')}` : `no roles ${[...Object.values(names.roles), names.tableOwner].join(', ')}`);
  const broker = await deleteBrokerObjects(env, topology);
  tell(`removed ${broker.queues} queue(s) and ${broker.exchanges} exchange(s) named ${names.prefix}.*`);
  const directory = path.dirname(names.policiesFile);
  if (existsSync(names.policiesFile)) {
    rmSync(names.policiesFile);
    tell(`removed ${names.policiesFile}`);
  }
  try {
    rmdirSync(directory);
  } catch {
    // Not there, or something else was put in it: the folder is left alone (only our file was ours).
  }
  return said;
}

/** Deletes the topology's queues and exchanges that exist; returns how many of each there were. */
async function deleteBrokerObjects(env: Env, topology: ReturnType<typeof makeTopology>): Promise<{ queues: number; exchanges: number }> {
  const connection = await connectBroker(env);
  try {
    // A check of a missing object closes its channel (404): each check on a channel of its own.
    const exists = async (check: (channel: Channel) => Promise<unknown>): Promise<boolean> => {
      const channel = await connection.createChannel();
      channel.on('error', () => undefined); // the 404 closing it is the answer, not a failure
      const found = await check(channel).then(() => true, () => false);
      if (found) await channel.close();
      return found;
    };
    const channel = await connection.createChannel();
    let queues = 0;
    for (const queue of topology.queues) {
      if (!(await exists((probe) => probe.checkQueue(queue.name)))) continue;
      await channel.deleteQueue(queue.name);
      queues += 1;
    }
    let exchanges = 0;
    for (const exchange of topology.exchanges) {
      if (!(await exists((probe) => probe.checkExchange(exchange.name)))) continue;
      await channel.deleteExchange(exchange.name);
      exchanges += 1;
    }
    await channel.close();
    return { queues, exchanges };
  } finally {
    await connection.close().catch(() => undefined); // already closed by the broker: nothing to do
  }
}
