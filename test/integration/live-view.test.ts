/**
 * Live views (issue 20 item 2): `reaper migrate --views --grant-to <role>` creates
 * seat_reservations_live, owned by the migrating role, and `reaper sql live-view` prints the same
 * SQL. The view leaves out every row reaper would delete now (expired, guard holds, no active hold),
 * by the scan's own condition: a row disappears the moment it expires, before any run; a held, a
 * renewed and a confirmed row stay; the rows it hides are exactly the ones the scan finds; a keyed
 * lookup through it uses the primary key's index. A reader granted only the view reads it.
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { expiringRowsScanPage } from '../../shared/db/queries/expiring-rows';
import { targetResolve } from '../../shared/db/queries/target';
import { loadPolicies, requirePolicy } from '../../shared/config/policies';
import { eventually } from '../support/eventually';
import { runReaperCli, assertNoLeakedProcesses } from '../support/processes';
import { rowDeletePolicyYaml, databaseIsoIn } from '../support/fixtures';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

const reader = `reaper_live_reader_${randomBytes(4).toString('hex')}`;
let bed: TestBed;
let policiesPath: string;

before(async () => {
  bed = await makeTestBed('live_view');
  policiesPath = bed.writePolicies(rowDeletePolicyYaml({ batchSize: 20 }));
  await bed.pool.query(`CREATE ROLE ${pg.escapeIdentifier(reader)} LOGIN`);
  await bed.pool.query(`GRANT USAGE ON SCHEMA public TO ${pg.escapeIdentifier(reader)}`);
});

after(async () => {
  const failures: unknown[] = [];
  const dropReader = async () => {
    await bed.pool.query(`DROP OWNED BY ${pg.escapeIdentifier(reader)}`);
    await bed.pool.query(`DROP ROLE IF EXISTS ${pg.escapeIdentifier(reader)}`);
  };
  for (const step of [() => assertNoLeakedProcesses(), dropReader, () => bed?.close()]) {
    try {
      await step();
    } catch (error) {
      failures.push(error);
    }
  }
  if (failures.length > 0) throw failures[0];
});

const visible = async (ids: readonly string[]): Promise<Set<string>> => {
  const result = await bed.pool.query<{ id: string }>('SELECT reservation_id::text AS id FROM seat_reservations_live WHERE reservation_id = ANY($1::uuid[])', [ids]);
  return new Set(result.rows.map((row) => row.id));
};

test('`reaper migrate --views --grant-to` creates the live view; `reaper sql live-view` prints the same SQL', async () => {
  const printed = await runReaperCli(['sql', 'live-view', 'seat-holds', '--policies', policiesPath, '--grant-to', reader], { PATH: process.env.PATH });
  assert.equal(printed.code, 0, printed.stdout);
  assert.match(printed.stdout, /CREATE OR REPLACE VIEW "seat_reservations_live" AS/);
  assert.match(printed.stdout, /t."status" = 'held'/, 'the guard');
  assert.match(printed.stdout, /cleanup_holds hold WHERE hold.policy = 'seat-holds'/, 'the holds');
  assert.match(printed.stdout, new RegExp(`GRANT SELECT ON "seat_reservations_live" TO "${reader}"`));

  const migrated = await runReaperCli(['migrate', '--views', '--grant-to', reader], bed.processEnv());
  assert.equal(migrated.code, 0, migrated.stdout);
  assert.match(migrated.stdout, /live views: seat_reservations_live \(SELECT to /);
  const seed = await seedHolds(bed.pool, { expiredHeld: 1, futureHeld: 1 });
  // The reader has no right on the table itself, only on the view (the view reads as its owner).
  const url = new URL(bed.databaseUrl);
  url.username = reader;
  url.password = '';
  const client = new pg.Client({ connectionString: url.toString() });
  await client.connect();
  try {
    const rows = await client.query<{ id: string }>('SELECT reservation_id::text AS id FROM seat_reservations_live');
    assert.deepEqual(rows.rows.map((row) => row.id), seed.futureHeld, 'the reader sees the live row, not the expired one');
    await assert.rejects(client.query('SELECT 1 FROM seat_reservations'), /permission denied/);
  } finally {
    await client.end();
  }
});

test('a row leaves the view the moment it expires, before any run; held, renewed and confirmed rows stay', async () => {
  await bed.pool.query('TRUNCATE seat_reservations');
  const insert = async (status: string, expiresIn: string): Promise<string> =>
    (await bed.pool.query<{ id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat) VALUES (gen_random_uuid(), $1, clock_timestamp() + $2::interval, 's') RETURNING reservation_id::text AS id`,
      [status, expiresIn],
    )).rows[0]!.id;
  const expiring = await insert('held', '3 seconds');
  const held = await insert('held', '-1 hour');
  const renewed = await insert('held', '-1 hour');
  const confirmed = await insert('confirmed', '-1 hour');
  const gone = await insert('held', '-1 hour');
  await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('seat-holds', $1, 'legal', 'test')`, [held]);
  await bed.pool.query(`UPDATE seat_reservations SET expires_at = clock_timestamp() + interval '1 day' WHERE reservation_id = $1`, [renewed]);

  const all = [expiring, held, renewed, confirmed, gone];
  assert.deepEqual(await visible(all), new Set([expiring, held, renewed, confirmed]), 'only the expired, unheld, guarded row is hidden');
  // Polled: the row is in the view while its expiry is ahead and out of it once passed, with no run in between.
  const at = await eventually('the expiring row leaves the view', async () => {
    const row = (await bed.pool.query<{ shown: boolean; expired: boolean }>(
      `SELECT EXISTS (SELECT 1 FROM seat_reservations_live WHERE reservation_id = $1) AS shown,
              (SELECT expires_at <= statement_timestamp() FROM seat_reservations WHERE reservation_id = $1) AS expired`,
      [expiring],
    )).rows[0]!;
    assert.equal(row.shown, !row.expired, 'shown exactly while not expired (one statement, one clock)');
    return row.expired ? row : undefined;
  }, { timeoutMs: 20_000, intervalMs: 100 });
  assert.equal(at.shown, false);
  assert.equal((await bed.pool.query('SELECT 1 FROM seat_reservations WHERE reservation_id = $1', [expiring])).rowCount, 1, 'still in the table: no run deleted it');
  assert.equal((await bed.pool.query('SELECT count(*)::int AS n FROM cleanup_runs')).rows[0].n, 0, 'no run at all');

  // A hold that lapses hides the row again; removing the hold too.
  await bed.pool.query(`UPDATE cleanup_holds SET held_until = clock_timestamp() - interval '1 second' WHERE key = $1`, [held]);
  assert.equal((await visible([held])).size, 0, 'a lapsed hold no longer keeps the row visible');
});

test('the view hides exactly the rows the scan finds', async () => {
  await bed.pool.query('TRUNCATE seat_reservations');
  await bed.pool.query('DELETE FROM cleanup_holds');
  const seeded = await seedHolds(bed.pool, { expiredHeld: 40, futureHeld: 10, expiredConfirmed: 10 });
  await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) SELECT 'seat-holds', k, 'legal', 'test' FROM unnest($1::text[]) k`, [seeded.expiredHeld.slice(0, 5)]);
  const target = await targetResolve(bed.pool, requirePolicy(loadPolicies(policiesPath), 'seat-holds'));
  const scanned = await expiringRowsScanPage(bed.pool, target, { cutoff: await databaseIsoIn(bed.pool, '0 seconds'), after: null, limit: 1000 });
  const hidden = await bed.pool.query<{ id: string }>(
    'SELECT reservation_id::text AS id FROM seat_reservations EXCEPT SELECT reservation_id::text FROM seat_reservations_live',
  );
  assert.equal(scanned.length, 35);
  assert.deepEqual(new Set(hidden.rows.map((row) => row.id)), new Set(scanned.map((item) => item.id)));
});

test('a keyed lookup through the view uses the primary key index', async () => {
  await bed.pool.query(
    `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
     SELECT gen_random_uuid(), 'held', now() + i * interval '1 second', 's' FROM generate_series(1, 20000) i`,
  );
  await bed.pool.query('ANALYZE seat_reservations');
  const id = (await bed.pool.query<{ id: string }>('SELECT reservation_id::text AS id FROM seat_reservations LIMIT 1')).rows[0]!.id;
  const plan = await bed.pool.query<{ 'QUERY PLAN': unknown }>(`EXPLAIN (FORMAT JSON) SELECT * FROM seat_reservations_live WHERE reservation_id = '${id}'::uuid`);
  const text = JSON.stringify(plan.rows[0]!['QUERY PLAN']);
  type PlanNode = { 'Node Type': string; 'Relation Name'?: string; 'Index Name'?: string; Plans?: PlanNode[] };
  const nodes = (node: PlanNode): PlanNode[] => [node, ...(node.Plans ?? []).flatMap(nodes)];
  const onTable = nodes((plan.rows[0]!['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan).filter((node) => node['Relation Name'] === 'seat_reservations');
  assert.deepEqual(onTable.map((node) => [node['Node Type'], node['Index Name']]), [['Index Scan', 'seat_reservations_pkey']], text);
});
