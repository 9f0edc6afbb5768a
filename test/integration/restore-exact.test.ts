import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { stopAllCleanly } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli, startReaper, stopLeftovers, type ReaperProcess } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 40, item 5: restore, as deployed and exact. Archived with to_jsonb and put back with
 * jsonb_populate_record, a json value `{"b":1,"a":2,"a":3}` came back `{"a": 3, "b": 1}` and an
 * int[] with lower bound 0 came back with bound 1; and no printed role could restore at all
 * (`permission denied for table cleanup_archive` as reaper_operator). Now each archived row keeps
 * its record's text, read back through the table's own row type, and `reaper restore` runs as
 * reaper_operator (the bed is as deployed: every process logs in as its printed role).
 */
let bed: TestBed;
const started: ReaperProcess[] = [];

const TABLE = `CREATE DOMAIN positive_amount AS numeric CHECK (VALUE > 0);
CREATE TYPE hold_kind AS ENUM ('soft', 'hard');
CREATE TABLE odd_rows (
  id          int PRIMARY KEY,
  status      text NOT NULL,
  expires_at  timestamptz NOT NULL,
  doc         json,
  slots       int[],
  blob        bytea,
  amount      numeric,
  precise_at  timestamptz,
  span        interval,
  price       positive_amount,
  kind        hold_kind
);
CREATE INDEX ON odd_rows (expires_at, id);`;

const POLICIES = `policies:
  - name: odd-rows
    kind: row-delete
    schedule: "0 0 1 1 *"
    table: odd_rows
    key: id
    expiresAt: expires_at
    guard: { status: held }
    batchSize: 10
    archive: { enabled: true, retainDays: 7 }
`;

before(async () => {
  bed = await makeTestBed('restore_exact');
  await bed.pool.query(TABLE);
  bed.writePolicies(POLICIES); // the printed roles are applied for this file (the table exists now)
});

after(async () => {
  await stopLeftovers(started.splice(0), 5_000);
  await assertNoLeakedProcesses();
  await bed?.close();
});

test('restore as reaper_operator puts every column back exactly, json keys and array bounds included', async () => {
  await bed.pool.query(
    `INSERT INTO odd_rows VALUES
       (1, 'held', now() - interval '1 hour', '{"b":1,"a":2,"a":3}', '[0:2]={10,20,30}', '\\x00ff10', 1.50000, '2026-01-02 03:04:05.123456+00', '1 mon 2 days 03:04:05.678901', 12.5, 'hard'),
       (2, 'held', now() - interval '1 hour', '[ 1,  2 ]', '{}', '\\x', -0.0, '2026-06-30 23:59:59.999999+00', '-1 days +02:00:00', 0.01, 'soft'),
       (3, 'held', now() - interval '1 hour', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)`,
  );
  const before = (await bed.pool.query<{ row: string }>('SELECT t::text AS row FROM odd_rows t ORDER BY id')).rows.map((row) => row.row);

  const scheduler = startReaper('exact-scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'exact-scheduler' }));
  const worker = startReaper('exact-worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'exact-worker' }));
  started.push(scheduler, worker);
  await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
  const run = await runReaperCli(['trigger', 'odd-rows', '--wait', '--timeout', '60', '--json'], bed.processEnv());
  assert.equal(run.code, 0, run.stdout);
  const runId = (JSON.parse(run.stdout.slice(run.stdout.indexOf('{'))) as { runId: string }).runId;
  assert.equal((await bed.pool.query('SELECT 1 FROM odd_rows')).rowCount, 0, 'deleted by the worker role');

  const restore = await runReaperCli(['restore', '--run', runId, '--json'], bed.processEnv());
  assert.equal(restore.code, 0, `reaper_operator restores: ${restore.stdout}`);
  const after = (await bed.pool.query<{ row: string }>('SELECT t::text AS row FROM odd_rows t ORDER BY id')).rows.map((row) => row.row);
  assert.deepEqual(after, before, 'every column exactly as it was');
  const doc = await bed.pool.query<{ doc: string; lower: number }>('SELECT doc::text AS doc, array_lower(slots, 1) AS lower FROM odd_rows WHERE id = 1');
  assert.deepEqual(doc.rows[0], { doc: '{"b":1,"a":2,"a":3}', lower: 0 });
  await stopAllCleanly([scheduler, worker]);
});
