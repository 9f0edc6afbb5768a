/**
 * Issue 20 items 4 and 5, under the roles `reaper roles --print` creates (suffixed: role names are
 * cluster-wide, dropped in `after`):
 *  - a release that adds a table needs no manual step: `reaper migrate` grants REAPER_TABLE_GRANTS
 *    at the end of every run, so a table a later migration creates is usable by the scheduler and
 *    the worker as soon as the migrator applied it, without re-running `roles --print`;
 *  - reaper_operator runs every operator command (trigger, execute, approve, reject, pause, resume,
 *    hold, admission, dlq, audit, plan, status) as real CLI processes, and cannot ALTER or DROP;
 *  - the migrator owns the live views (`migrate --views`) and reads the targets for them.
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { migrate } from '../../shared/db/migrate';
import { REAPER_TABLE_GRANTS, type DbRoleNames } from '../../shared/db/queries/roles';
import { runReaperCli, assertNoLeakedProcesses } from '../support/processes';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { MEDIA_POLICY, mediaPolicyYaml } from '../support/remote-helpers';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { databaseUrlAs, dropTestRoles, sqlStateAs } from '../support/db-roles';

const suffix = randomBytes(4).toString('hex');
const roles: DbRoleNames = {
  migrator: `reaper_migrator_op_${suffix}`,
  scheduler: `reaper_scheduler_op_${suffix}`,
  worker: `reaper_worker_op_${suffix}`,
  operator: `reaper_operator_op_${suffix}`,
};
const INSUFFICIENT_PRIVILEGE = '42501';
let bed: TestBed;
let policiesPath: string;

const urlAs = (role: string) => databaseUrlAs(bed.databaseUrl, role);
const sqlStateAsRole = (role: string, sql: string) => sqlStateAs(bed.databaseUrl, role, sql);

before(async () => {
  bed = await makeTestBed('least_privilege_operator');
  // The remote-delete policy is never run here (nothing listens at its URL): `pause` needs one.
  policiesPath = bed.writePolicies(
    combinedPoliciesYaml(
      rowDeletePolicyYaml({ batchSize: 20, audit: true, limits: { maxPerRun: 3 } }),
      mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 5, burst: 5, concurrency: 1 }),
    ),
  );
  const printed = await runReaperCli(
    ['roles', '--print', '--policies', policiesPath, ...Object.entries(roles).flatMap(([purpose, role]) => [`--${purpose}`, role])],
    { PATH: process.env.PATH },
  );
  assert.equal(printed.code, 0, printed.stdout);
  await bed.pool.query(printed.stdout);
});

after(async () => {
  const failures: unknown[] = [];
  const dropRoles = () => dropTestRoles(bed.pool, Object.values(roles));
  for (const step of [() => assertNoLeakedProcesses(), dropRoles, () => bed?.close()]) {
    try {
      await step();
    } catch (error) {
      failures.push(error);
    }
  }
  if (failures.length > 0) throw failures[0];
});

test('a table a later migration adds is usable by the scheduler and the worker right after `migrate`, without roles --print', async () => {
  const release = mkdtempSync(path.join(tmpdir(), 'reaper-release-'));
  writeFileSync(path.join(release, '9001_release_adds_a_table.sql'), 'CREATE TABLE cleanup_release_added (id int PRIMARY KEY, note text);\n');
  const tableGrants = { ...REAPER_TABLE_GRANTS, cleanup_release_added: { scheduler: ['SELECT', 'INSERT'], worker: ['SELECT'] } } as const;
  const result = await migrate(urlAs(roles.migrator), { extraDirectories: [release], tableGrants, grantTo: roles });
  assert.deepEqual(result.applied, ['9001_release_adds_a_table.sql']);
  assert.ok(result.granted.tables.includes('cleanup_release_added'), JSON.stringify(result.granted));

  assert.equal(await sqlStateAsRole(roles.scheduler, `INSERT INTO cleanup_release_added VALUES (1, 'scheduler')`), undefined, 'the scheduler inserts');
  assert.equal(await sqlStateAsRole(roles.worker, 'SELECT * FROM cleanup_release_added'), undefined, 'the worker reads');
  assert.equal(await sqlStateAsRole(roles.worker, 'DELETE FROM cleanup_release_added'), INSUFFICIENT_PRIVILEGE, 'exactly what is listed, no more');
  assert.equal(await sqlStateAsRole(roles.operator, 'SELECT * FROM cleanup_release_added'), INSUFFICIENT_PRIVILEGE, 'the operator: nothing unless listed');
  const owner = await bed.pool.query<{ owner: string }>(`SELECT tableowner AS owner FROM pg_tables WHERE tablename = 'cleanup_release_added'`);
  assert.equal(owner.rows[0]!.owner, roles.migrator);

  // The migrate command does the same on every run: grants changed by hand come back.
  await bed.pool.query(`REVOKE ALL ON cleanup_runs FROM ${pg.escapeIdentifier(roles.scheduler)}`);
  const cli = await runReaperCli(
    ['migrate', '--scheduler', roles.scheduler, '--worker', roles.worker, '--operator', roles.operator],
    bed.processEnv({ DATABASE_URL: urlAs(roles.migrator) }),
  );
  assert.equal(cli.code, 0, cli.stdout);
  assert.match(cli.stdout, /granted \d+ tables to /);
  assert.equal(await sqlStateAsRole(roles.scheduler, 'SELECT 1 FROM cleanup_runs'), undefined, 'the scheduler reads its runs again');
});

test('reaper_operator runs every operator command', async () => {
  const seeded = await seedHolds(bed.pool, { expiredHeld: 8, futureHeld: 2 });
  const env = bed.processEnv({ DATABASE_URL: urlAs(roles.operator), REAPER_OPERATOR: 'op-test' });
  const ok = async (args: string[], expectedCode = 0): Promise<string> => {
    const result = await runReaperCli(args, env);
    assert.equal(result.code, expectedCode, `reaper ${args.join(' ')}: ${result.stdout}`);
    assert.doesNotMatch(result.stdout, /permission denied/, `reaper ${args.join(' ')}`);
    return result.stdout;
  };
  const runIdOf = (output: string): string => /"runId":\s*"([0-9a-f-]{36})"/.exec(output)?.[1] ?? assert.fail(`no run id in ${output}`);

  await ok(['plan', 'seat-holds', '--json']);
  await ok(['hold', 'add', 'seat-holds', seeded.expiredHeld[0]!, '--reason', 'legal']);
  await ok(['hold', 'list']);
  await ok(['hold', 'remove', 'seat-holds', seeded.expiredHeld[0]!]);
  // 8 candidates > maxPerRun 3: the run stops for approval (exit 1), the operator decides.
  const rejected = runIdOf(await ok(['trigger', 'seat-holds', '--execute', '--json'], 1));
  await ok(['reject', rejected]);
  const approved = runIdOf(await ok(['trigger', 'seat-holds', '--execute', '--json'], 1));
  await ok(['approve', approved]);
  await ok(['execute', approved, '--json']);
  await ok(['trigger', 'seat-holds', '--json']);
  await ok(['pause', MEDIA_POLICY]);
  await ok(['resume', MEDIA_POLICY]);
  await ok(['admission', 'set', 'seat-holds', '--rate', '50']);
  await ok(['admission', 'show']);
  await ok(['admission', 'reset', 'seat-holds']);
  // No worker runs here: the audit row a worker would write for the approved run's first batch.
  await bed.pool.query(
    `INSERT INTO cleanup_audit (policy, key, observed_expiry, run_id, batch_id, policy_version) VALUES ('seat-holds', $1, now(), $2::uuid, $2::text || ':1', 'v')`,
    [seeded.expiredHeld[1], approved],
  );
  assert.match(await ok(['audit', 'seat-holds', '--id', seeded.expiredHeld[1]!]), new RegExp(approved));
  await ok(['audit', '--run', approved]);
  await ok(['runs']);
  await ok(['status']);
  await ok(['events', 'status']);
  await ok(['dlq', 'list']);
});

test('reaper_operator cannot ALTER, DROP, create, or delete rows', async () => {
  for (const sql of [
    'ALTER TABLE cleanup_runs ADD COLUMN sneaky int',
    'DROP TABLE cleanup_runs',
    'ALTER TABLE seat_reservations ADD COLUMN sneaky int',
    'DROP TABLE seat_reservations',
    'DELETE FROM seat_reservations',
    'DELETE FROM cleanup_runs',
    'CREATE TABLE sneaky (id int)',
  ]) {
    assert.equal(await sqlStateAsRole(roles.operator, sql), INSUFFICIENT_PRIVILEGE, sql);
  }
});

test('the migrator owns the live views it creates; a role granted one reads through it', async () => {
  const created = await runReaperCli(['migrate', '--views', '--grant-to', roles.operator], bed.processEnv({ DATABASE_URL: urlAs(roles.migrator) }));
  assert.equal(created.code, 0, created.stdout);
  const owner = await bed.pool.query<{ owner: string }>(`SELECT viewowner AS owner FROM pg_views WHERE viewname = 'seat_reservations_live'`);
  assert.equal(owner.rows[0]?.owner, roles.migrator);
  // The view reads the table and the holds with the migrator's rights (roles --print grants it SELECT on the targets).
  assert.equal(await sqlStateAsRole(roles.operator, 'SELECT count(*) FROM seat_reservations_live'), undefined);
  assert.equal(await sqlStateAsRole(roles.worker, 'SELECT count(*) FROM seat_reservations_live'), INSUFFICIENT_PRIVILEGE, 'only the roles named');
});
