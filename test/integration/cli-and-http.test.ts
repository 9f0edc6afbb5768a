import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli, startReaper } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';

/** The operator's surface: migrations from several processes, exit codes, messages, HTTP endpoints. */
describe('CLI and HTTP', () => {
  let bed: TestBed;

  before(async () => {
    bed = await makeTestBed('cli_http');
  });
  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await bed?.close();
    }
  });

  test('three migrators started at once apply each migration exactly once', async () => {
    const admin = new pg.Client({ connectionString: bed.databaseUrl });
    await admin.connect();
    const fresh = `${(await admin.query<{ db: string }>('SELECT current_database() AS db')).rows[0]!.db}_fresh`;
    await admin.query(`CREATE DATABASE ${fresh}`);
    await admin.end();
    const url = new URL(bed.databaseUrl);
    url.pathname = `/${fresh}`;
    try {
      const results = await Promise.all([1, 2, 3].map(() => runReaperCli(['migrate', '--json'], bed.processEnv({ DATABASE_URL: url.toString(), REAPER_TEST_SUPERUSER_BECAUSE: 'a database the test made, without the printed roles' }))));
      assert.deepEqual(results.map((r) => r.code), [0, 0, 0]);
      const applied = results.flatMap((r) => (JSON.parse(r.stdout) as { applied: string[] }).applied);
      const client = new pg.Client({ connectionString: url.toString() });
      await client.connect();
      const versions = (await client.query<{ version: number }>('SELECT version FROM reaper_schema_migrations ORDER BY version')).rows;
      await client.end();
      assert.equal(applied.length, versions.length, 'each migration reported applied by exactly one migrator');
      assert.equal(new Set(applied).size, applied.length);
      assert.ok(versions.length >= 2);
    } finally {
      const cleanup = new pg.Client({ connectionString: bed.databaseUrl });
      await cleanup.connect();
      await cleanup.query(`DROP DATABASE IF EXISTS ${fresh} WITH (FORCE)`);
      await cleanup.end();
    }
  });

  test('usage errors exit 2 with a message, failures exit 1, never a stack trace', async () => {
    const env = bed.processEnv();
    const usage = await runReaperCli(['replay'], env);
    assert.equal(usage.code, 2);
    assert.match(usage.stdout, /--run <runId>, or --policy <policy> with --cutoff/);
    const badCutoff = await runReaperCli(['replay', '--policy', 'seat-holds', '--cutoff', 'yesterday'], env);
    assert.equal(badCutoff.code, 2);
    assert.match(badCutoff.stdout, /--cutoff: "yesterday"/);
    const unknownCommand = await runReaperCli(['frobnicate'], env);
    assert.equal(unknownCommand.code, 2);
    const unknownPolicy = await runReaperCli(['trigger', 'no-such-policy'], env);
    assert.equal(unknownPolicy.code, 1);
    assert.match(unknownPolicy.stdout, /unknown policy "no-such-policy"; known: seat-holds, media-assets/);
    const badPort = await runReaperCli(['worker'], bed.processEnv({ HTTP_PORT: 'eighty' }));
    assert.equal(badPort.code, 1);
    assert.match(badPort.stdout, /HTTP_PORT="eighty"/);
    for (const output of [usage, badCutoff, unknownPolicy, badPort]) assert.doesNotMatch(output.stdout, /\n\s+at /, 'no stack trace');
  });

  test('a bad policies file names the key and the value', async () => {
    const file = bed.writePolicies(`policies:
  - name: seat-holds
    kind: row-delete
    schedule: "* * * * *"
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
    gaurd: { status: held }
    batchSize: 5000
`);
    const result = await runReaperCli(['worker'], bed.processEnv({ REAPER_POLICIES: file }));
    assert.equal(result.code, 1);
    assert.match(result.stdout, /policies\.0\.batchSize: .*5000/);
    assert.match(result.stdout, /gaurd/);
  });

  test('a policy naming a missing column is refused at start-up', async () => {
    const file = bed.writePolicies(rowDeletePolicyYaml({ expiresAt: 'expiry_time', guard: null }));
    const result = await runReaperCli(['worker'], bed.processEnv({ REAPER_POLICIES: file }));
    assert.equal(result.code, 1);
    assert.match(result.stdout, /policy seat-holds: table "seat_reservations" has no column "expiry_time"/);
  });

  test('a worker serves /livez, /readyz and /metrics, and drains on SIGTERM with exit 0', async () => {
    bed.writePolicies(rowDeletePolicyYaml({ schedule: '* * * * *' }));
    const worker = startReaper('worker', ['worker'], bed.processEnv({ HTTP_PORT: '0' }));
    const started = await worker.waitForLine('started', (line) => line.msg === 'worker started');
    const base = `http://127.0.0.1:${String(started.httpPort)}`;
    assert.equal((await fetch(`${base}/livez`)).status, 200);
    assert.equal((await fetch(`${base}/readyz`)).status, 200);
    const metrics = await (await fetch(`${base}/metrics`)).text();
    assert.match(metrics, /reaper_amqp_connected 1/);
    assert.match(metrics, /# TYPE reaper_items_total counter/);
    assert.equal((await fetch(`${base}/nope`)).status, 404);
    const exit = await worker.stop();
    assert.deepEqual(exit, { code: 0, signal: null });
  });
});
