/**
 * reaper under its least-privilege PostgreSQL roles (`reaper roles --print`, issue 11): the SQL the
 * CLI prints is applied to this file's database, then a scheduler and a worker connect as
 * reaper_scheduler and reaper_worker and expire a row-delete policy and a remote-delete policy
 * (against the stand-in media API) end to end; the migrator runs `reaper migrate`. The worker's
 * role is refused DROP TABLE and a DELETE on a table no policy names; each role starts its
 * sessions with the timeouts set as role defaults.
 *
 * Role names are cluster-wide: they get a per-run suffix and are dropped in `after`.
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { REAPER_TABLE_GRANTS, type DbRoleNames } from '../../shared/db/queries/roles';
import { eventually } from '../support/eventually';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import { assetStatuses, errorsLogged, mediaPolicyYaml, seedAssets, started, startSchedulerProcess, startWorkerProcess, stopStarted } from '../support/remote-helpers';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { assertNoLeakedProcesses } from '../support/processes';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { databaseUrlAs, dropTestRoles } from '../support/db-roles';

const suffix = randomBytes(4).toString('hex');
const roles: DbRoleNames = { migrator: `reaper_migrator_${suffix}`, scheduler: `reaper_scheduler_${suffix}`, worker: `reaper_worker_${suffix}`, operator: `reaper_operator_${suffix}` };
const TARGETS = ['seat_reservations', 'media_assets'];

let bed: TestBed;
let api: MediaApi;
let policiesPath: string;

const urlAs = (role: string) => databaseUrlAs(bed.databaseUrl, role);

async function asRole<T>(role: string, work: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: urlAs(role) });
  await client.connect();
  try {
    return await work(client);
  } finally {
    await client.end();
  }
}

async function refusal(role: string, sql: string): Promise<string | undefined> {
  return asRole(role, async (client) => {
    try {
      await client.query(sql);
      return undefined;
    } catch (error) {
      return (error as { code?: string }).code;
    }
  });
}

before(async () => {
  bed = await makeTestBed('least_privilege_db');
  api = await startMediaApi({});
  policiesPath = bed.writePolicies(
    combinedPoliciesYaml(
      // archive on: the worker's INSERT into cleanup_archive, the scheduler's retention pass over it
      rowDeletePolicyYaml({ batchSize: 20, archiveRetainDays: 7 }),
      mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 500, burst: 50, concurrency: 8, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 }),
    ),
  );
  // A table no policy names, with a row the worker must not be able to delete.
  await bed.pool.query('CREATE TABLE unrelated_data (id int PRIMARY KEY)');
  await bed.pool.query('INSERT INTO unrelated_data VALUES (1)');
});

after(async () => {
  const failures: unknown[] = [];
  const dropRoles = () => dropTestRoles(bed.pool, Object.values(roles));
  // Every step runs whatever an earlier one did: a leftover role or server would outlive the file.
  for (const step of [() => stopStarted(), () => assertNoLeakedProcesses(), dropRoles, () => api?.close(), () => bed?.close()]) {
    try {
      await step();
    } catch (error) {
      failures.push(error);
    }
  }
  if (failures.length > 0) throw failures[0];
});

test('`reaper roles --print` emits SQL that applies cleanly, twice, and names every table the migrations create', async () => {
  const printed = await runReaperCli(
    ['roles', '--print', '--policies', policiesPath, '--migrator', roles.migrator, '--scheduler', roles.scheduler, '--worker', roles.worker, '--operator', roles.operator],
    { PATH: process.env.PATH },
  );
  assert.equal(printed.code, 0, printed.stdout);
  const sql = printed.stdout;
  assert.match(sql, /GRANT SELECT, DELETE ON "seat_reservations" TO "reaper_worker_/, 'row-delete: the worker may DELETE the target');
  assert.match(sql, /GRANT SELECT, UPDATE ON "media_assets" TO "reaper_worker_/, 'remote-delete with markConfirmed: the worker may UPDATE the target');
  assert.match(sql, /GRANT SELECT ON "seat_reservations" TO "reaper_scheduler_/, 'the scheduler only reads targets');
  await bed.pool.query(sql);
  await bed.pool.query(sql); // idempotent: a re-run after a change leaves exactly the new set

  const tables = await bed.pool.query<{ name: string }>(
    `SELECT table_name AS name FROM information_schema.tables WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1`,
  );
  const reaperTables = tables.rows.map((row) => row.name).filter((name) => !TARGETS.includes(name) && name !== 'unrelated_data');
  assert.deepEqual(reaperTables.sort(), Object.keys(REAPER_TABLE_GRANTS).sort(), 'REAPER_TABLE_GRANTS lists exactly the tables the migrations create');
  const owners = await bed.pool.query<{ owner: string }>(
    `SELECT DISTINCT tableowner AS owner FROM pg_tables WHERE schemaname = 'public' AND tablename = ANY($1::text[])`,
    [reaperTables],
  );
  assert.deepEqual(owners.rows.map((row) => row.owner), [roles.migrator], 'the migrator owns reaper\'s tables');
});

test('the migrator migrates; the scheduler and the worker expire a row-delete and a remote-delete policy end to end', async () => {
  const migrated = await runReaperCli(['migrate'], bed.processEnv({ DATABASE_URL: urlAs(roles.migrator) }));
  assert.equal(migrated.code, 0, migrated.stdout);
  assert.match(migrated.stdout, /up to date/);

  const holds = await seedHolds(bed.pool, { expiredHeld: 30, expiredConfirmed: 5 });
  const assets = await seedAssets(bed.pool, 'lp', 12);
  const scheduler = startSchedulerProcess(bed, 'lp-scheduler', { DATABASE_URL: urlAs(roles.scheduler) });
  const worker = startWorkerProcess(bed, 'lp-worker', { DATABASE_URL: urlAs(roles.worker) });
  await Promise.all([started(scheduler, 'scheduler'), started(worker, 'worker')]);

  const operator = bed.processEnv({ DATABASE_URL: urlAs(roles.scheduler) });
  const rows = await runReaperCli(['trigger', 'seat-holds', '--wait', '--timeout', '60', '--json'], operator);
  assert.equal(rows.code, 0, rows.stdout);
  assert.equal(await countReservations(bed.pool, holds.expiredHeld), 0, 'every expired hold is deleted by reaper_worker');
  const archived = await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_archive WHERE policy = $1', ['seat-holds']);
  assert.equal(archived.rows[0]!.n, 30, 'each deleted row archived by reaper_worker');
  assert.equal(await countReservations(bed.pool, holds.expiredConfirmed), 5, 'confirmed holds stay');

  const remote = await runReaperCli(['trigger', 'media-assets', '--wait', '--timeout', '60', '--json'], operator);
  assert.equal(remote.code, 0, remote.stdout);
  await eventually('every asset confirmed and marked deleted', async () => {
    const statuses = await assetStatuses(bed.pool, assets);
    return [...statuses.values()].every((status) => status === 'deleted') ? statuses : undefined;
  }, { timeoutMs: 30_000 });
  assert.ok(api.calls.length >= assets.length, `the media API was called for each asset (${api.calls.length} calls)`);
  assert.deepEqual(errorsLogged([scheduler, worker]), [], 'no errors: no statement was refused');
  assert.equal((await scheduler.stop()).code, 0);
  assert.equal((await worker.stop()).code, 0);
});

test('the worker role is refused DROP TABLE, a DELETE on a table no policy names, and DDL', async () => {
  const insufficientPrivilege = '42501';
  assert.equal(await refusal(roles.worker, 'DROP TABLE seat_reservations'), insufficientPrivilege, 'DROP TABLE of a target');
  assert.equal(await refusal(roles.worker, 'DROP TABLE cleanup_ledger'), insufficientPrivilege, 'DROP TABLE of reaper\'s own');
  assert.equal(await refusal(roles.worker, 'DELETE FROM unrelated_data'), insufficientPrivilege, 'DELETE on a table no policy names');
  assert.equal(await refusal(roles.worker, 'DELETE FROM cleanup_runs'), insufficientPrivilege, 'DELETE on reaper\'s run history');
  assert.equal(await refusal(roles.worker, 'UPDATE seat_reservations SET status = \'confirmed\''), insufficientPrivilege, 'UPDATE on a row-delete target');
  assert.equal(await refusal(roles.worker, 'CREATE TABLE sneaky (id int)'), insufficientPrivilege, 'CREATE TABLE');
  assert.equal(await refusal(roles.scheduler, 'DELETE FROM seat_reservations'), insufficientPrivilege, 'the scheduler deletes nothing');
  assert.equal((await bed.pool.query('SELECT count(*)::int AS n FROM unrelated_data')).rows[0].n, 1);
});

test('each role starts its sessions with statement, lock and idle-in-transaction timeouts', async () => {
  for (const role of [roles.scheduler, roles.worker, roles.migrator]) {
    const settings = await asRole(role, async (client) => {
      const shown = await client.query<{ name: string; setting: string }>(
        `SELECT name, setting FROM pg_settings WHERE name IN ('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout')`,
      );
      return Object.fromEntries(shown.rows.map((row) => [row.name, Number(row.setting)]));
    });
    for (const [name, value] of Object.entries(settings)) assert.ok(value > 0, `${role}: ${name} is set (${value} ms)`);
    assert.equal(Object.keys(settings).length, 3, `${role}: all three`);
  }
});
