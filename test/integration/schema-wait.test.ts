import assert from 'node:assert/strict';
import { after, afterEach, before, test } from 'node:test';
import pg from 'pg';
import { wantedSchemaVersion } from '../../shared/db/migrate';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli, startReaper, type ReaperProcess } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * `reaper schema wait` (issue 42 item 2), the Deployments' init container: against the real
 * PostgreSQL, logged in as the worker's role as the init container is, it waits while the schema is
 * behind, missing or not yet readable, says each time what it waits for, and exits 0 as soon as the
 * migrate Job's commit makes the schema current; at the timeout it exits 1 naming what it waited for.
 * The migrate Job is played by the bed's superuser: the last migration's row is taken away and put
 * back, the version table renamed and restored, its grant revoked and given back.
 */
let bed: TestBed;
const wanted = wantedSchemaVersion();

before(async () => {
  bed = await makeTestBed('schema-wait');
});

afterEach(assertNoLeakedProcesses);

after(async () => {
  await bed?.close();
});

/** The bed's environment, logged in as the worker role (the init container's credentials). */
function asWorker(): NodeJS.ProcessEnv {
  const env = bed.processEnv();
  const url = new URL(env.DATABASE_URL!);
  url.username = bed.roles!.worker;
  url.password = '';
  return { ...env, DATABASE_URL: url.toString() };
}

function startWait(args: string[] = []): ReaperProcess {
  return startReaper('schema wait', ['schema', 'wait', '--every', '0.2', '--timeout', '60', ...args], asWorker());
}

async function sawLine(wait: ReaperProcess, pattern: RegExp): Promise<void> {
  await eventually(`schema wait prints ${pattern}`, () => wait.output.some((line) => pattern.test(line)), { describe: () => wait.output.slice(-4) });
}

test('a current schema: ready at once, exit 0', async () => {
  const result = await runReaperCli(['schema', 'wait', '--json'], asWorker());
  assert.equal(result.code, 0, result.stdout);
  assert.deepEqual(JSON.parse(result.stdout), { wanted, current: wanted });
});

test('behind by one migration: waits, saying so, and starts the moment the migration commits', async () => {
  const last = await bed.pool.query<{ name: string }>('DELETE FROM reaper_schema_migrations WHERE version = $1 RETURNING name', [wanted]);
  assert.equal(last.rowCount, 1);
  const wait = startWait();
  try {
    await sawLine(wait, new RegExp(`^waiting for schema version ${wanted} \\(database at ${wanted - 1}\\): is the migrate Job done\\?$`));
    assert.ok(wait.running, 'still waiting');
  } finally {
    await bed.pool.query('INSERT INTO reaper_schema_migrations (version, name) VALUES ($1, $2)', [wanted, last.rows[0]!.name]);
  }
  const { code } = await wait.exitWithin(10_000);
  assert.equal(code, 0, wait.output.join('\n'));
  assert.match(wait.output.at(-1)!, new RegExp(`^schema at version ${wanted} \\(this reaper needs ${wanted}\\): ready$`));
});

test('no version table yet (before the first migrate): waits at version 0', async () => {
  await bed.pool.query('ALTER TABLE reaper_schema_migrations RENAME TO reaper_schema_migrations_away');
  const wait = startWait();
  try {
    await sawLine(wait, new RegExp(`^waiting for schema version ${wanted} \\(database at 0\\)`));
  } finally {
    await bed.pool.query('ALTER TABLE reaper_schema_migrations_away RENAME TO reaper_schema_migrations');
  }
  assert.equal((await wait.exitWithin(10_000)).code, 0, wait.output.join('\n'));
});

test('not readable by the role yet (migrate grants last): waits, naming the error', async () => {
  const worker = pg.escapeIdentifier(bed.roles!.worker);
  await bed.pool.query(`REVOKE SELECT ON reaper_schema_migrations FROM ${worker}`);
  const wait = startWait();
  try {
    await sawLine(wait, new RegExp(`^waiting for schema version ${wanted} \\(database not readable: permission denied for table reaper_schema_migrations\\): is PostgreSQL up at DATABASE_URL, and the migrate Job done\\?$`));
  } finally {
    await bed.pool.query(`GRANT SELECT ON reaper_schema_migrations TO ${worker}`);
  }
  assert.equal((await wait.exitWithin(10_000)).code, 0, wait.output.join('\n'));
});

test('at the timeout: exit 1, naming the versions; a bad --timeout is a usage error', async () => {
  const last = await bed.pool.query<{ name: string }>('DELETE FROM reaper_schema_migrations WHERE version = $1 RETURNING name', [wanted]);
  try {
    const result = await runReaperCli(['schema', 'wait', '--every', '0.2', '--timeout', '1'], asWorker());
    assert.equal(result.code, 1, result.stdout);
    assert.match(result.stdout, new RegExp(`reaper: gave up after 1 s waiting for schema version ${wanted} \\(database at ${wanted - 1}\\)`));
  } finally {
    await bed.pool.query('INSERT INTO reaper_schema_migrations (version, name) VALUES ($1, $2)', [wanted, last.rows[0]!.name]);
  }
  const usage = await runReaperCli(['schema', 'wait', '--timeout', '10m'], asWorker());
  assert.equal(usage.code, 2);
  assert.match(usage.stdout, /--timeout: "10m" is not a positive number of seconds/);
});
