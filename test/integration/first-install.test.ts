import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { makeBrokerUsers } from '../support/broker-admin';
import { stampedSuffix } from '../support/sweeper';
import { makeTestBed, type TestBed } from '../support/testbed';

const SCRIPT = path.resolve(__dirname, '..', '..', '..', 'infra', 'first-install.sh');

/**
 * Issue 42 item 2: the first install in the order docs/deploying.md gives, proven against the local
 * servers. The database is new and unmigrated (the application's tables exist, reaper's do not),
 * and infra/first-install.sh applies the printed roles, migrates as the migrator, runs the services
 * as their roles until ready and ends with `reaper doctor` as the operator. The bed itself makes no
 * roles (superuserBecause): the script is what makes them, as an operator's first install would.
 */
describe('first install, in order, on a new database', () => {
  let bed: TestBed;
  let removeBrokerUsers: (() => Promise<void>) | undefined;
  const rolePrefix = `reaper_t_fi_${stampedSuffix()}`;
  const roles = ['migrator', 'scheduler', 'worker', 'operator'].map((role) => `${rolePrefix}_${role}`);

  before(async () => {
    bed = await makeTestBed('first_install', {
      migrate: async () => undefined, // a new database: reaper's tables are the install's to make
      superuserBecause: 'the first-install script creates and applies the printed roles itself',
    });
    // The broker users come from the deployment's definitions import (docs/deploying.md), not from the script: doctor checks them.
    removeBrokerUsers = await makeBrokerUsers(bed.prefix);
  });

  after(async () => {
    await removeBrokerUsers?.();
    await bed?.close();
    // After the database: the migrator owned reaper's tables there, which went with it.
    const adminUrl = new URL(bed.databaseUrl);
    adminUrl.pathname = '/postgres';
    const admin = new pg.Client({ connectionString: adminUrl.href });
    await admin.connect();
    try {
      for (const role of roles) await admin.query(`DROP ROLE IF EXISTS ${pg.escapeIdentifier(role)}`);
    } finally {
      await admin.end();
    }
  });

  test('roles as printed, migrate as the migrator, services as their roles, doctor: each step in order, exit 0', async () => {
    const env = bed.processEnv({ ADMIN_DATABASE_URL: bed.databaseUrl, REAPER_ROLE_PREFIX: rolePrefix });
    delete env.DATABASE_URL; // each step makes its own role's URL
    const run = await new Promise<{ code: number | null; output: string }>((resolve, reject) => {
      const child = spawn('bash', [SCRIPT], { env, stdio: ['ignore', 'pipe', 'pipe'] });
      let output = '';
      child.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
      child.stderr.on('data', (chunk: Buffer) => (output += chunk.toString()));
      child.on('error', reject);
      child.on('close', (code) => resolve({ code, output }));
    });
    assert.equal(run.code, 0, run.output);
    const steps = [...run.output.matchAll(/^== step (\d):/gm)].map((match) => Number(match[1]));
    assert.deepEqual(steps, [1, 2, 3, 4, 5], run.output);
    assert.match(run.output, /scheduler ready/);
    assert.match(run.output, /worker ready/);

    // What the steps left: reaper's tables owned by the migrator, the services' grants in place.
    const owners = await bed.pool.query<{ owner: string; tables: number }>(
      `SELECT tableowner AS owner, count(*)::int AS tables FROM pg_tables WHERE schemaname = 'public' AND (tablename LIKE 'cleanup\\_%' OR tablename = 'reaper_schema_migrations') GROUP BY 1`,
    );
    assert.deepEqual(owners.rows.map((row) => row.owner), [`${rolePrefix}_migrator`], 'every reaper table belongs to the migrator');
    const granted = await bed.pool.query<{ can: boolean }>(`SELECT has_table_privilege($1, 'cleanup_outbox', 'UPDATE') AS can`, [`${rolePrefix}_scheduler`]);
    assert.equal(granted.rows[0]!.can, true, 'the scheduler was granted what migrate created after the roles were applied');
  });
});
