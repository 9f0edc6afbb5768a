import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, test } from 'node:test';
import pg from 'pg';
import { partitionRestore, partitionRetirementBegin } from '../../shared/db/queries/partitions';
import { runReaperCli } from '../support/processes';
import { HELD_ID, partitionedPolicyYaml, partitionedSuite, partitionOwnerRole, runDayEventsUntilEnded } from '../support/partitioned';

/**
 * `reaper restore --partition` (issue 44 review, item 2, and item 3's narrowed grant): any name of
 * a table in reaper_retired recorded in cleanup_partitions (hyphens too, quoted or not); one row in
 * the restore log (who, what, bound, rows); the stored parent_table checked against the policy's
 * table; a CHECK of the bound before the ATTACH (PostgreSQL skips the partition's scan); a restored
 * partition stays attached (blocked, with how to release it) until `reaper partitions --release`.
 * The CLI runs as the printed operator role.
 */
describe('partitions: restoring a retired partition', () => {
  const world = partitionedSuite('partitions_restore', async (bed) => {
    bed.writePolicies(partitionedPolicyYaml({ quarantineDays: 7 }));
    // A partition whose name is not a plain identifier (an application naming by date: "events-2026-01-01").
    await bed.pool.query('ALTER TABLE p_old_a RENAME TO "p-old-a"');
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', $1, 'litigation 44', 'test')`, [HELD_ID]);
  });
  const pool = () => world.bed.pool;
  const cli = (args: string[]) => runReaperCli(args, world.bed.processEnv({ REAPER_OPERATOR: 'alice@test' }));
  const attached = async () =>
    (await pool().query<{ name: string }>(`SELECT c.relname::text AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'events_by_day'::regclass ORDER BY 1`)).rows.map((row) => row.name);
  const retired = async () => (await pool().query<{ name: string }>(`SELECT tablename::text AS name FROM pg_tables WHERE schemaname = 'reaper_retired' ORDER BY 1`)).rows.map((row) => row.name);
  const states = async () => (await pool().query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions ORDER BY retirement_id')).rows;

  test('a hyphenated name restores, quoted or not; the restore is logged (who, what, bound, rows)', async () => {
    const run = await runDayEventsUntilEnded(world.bed);
    assert.equal(run.state, 'completed', run.error ?? '');
    assert.deepEqual(await retired(), ['p-old-a', 'p_old_b']);

    const missing = await cli(['restore', '--partition', 'reaper_retired.no-such-table']);
    assert.notEqual(missing.code, 0);
    assert.match(missing.stdout, /no retired partition reaper_retired\.no-such-table/);

    const restored = await cli(['restore', '--partition', 'reaper_retired."p-old-a"', '--json']);
    assert.equal(restored.code, 0, restored.stdout);
    assert.equal((JSON.parse(restored.stdout) as { partition: string; rows: number }).partition, 'public."p-old-a"');
    assert.ok((await attached()).includes('p-old-a'));
    assert.equal((await pool().query<{ n: number }>('SELECT count(*)::int AS n FROM events_by_day WHERE id BETWEEN 2001 AND 2006')).rows[0]!.n, 6, 'every row is back');
    const logged = await pool().query<{ key: string; operator: string; outcome: string; row_count: string; partition_bound: string; archive_id: string | null; same_run: boolean }>(
      `SELECT r.key, r.operator, r.outcome, r.row_count::text, r.partition_bound, r.archive_id::text, r.run_id = p.run_id AS same_run
       FROM cleanup_restores r JOIN cleanup_partitions p ON p.retirement_id = r.retirement_id`,
    );
    assert.equal(logged.rows.length, 1, 'one restore-log row');
    const row = logged.rows[0]!;
    assert.deepEqual([row.key, row.operator, row.outcome, row.row_count, row.archive_id, row.same_run], ['partition:reaper_retired.p-old-a', 'alice@test', 'restored', '6', null, true]);
    assert.match(row.partition_bound, /^FOR VALUES FROM \('.*'\) TO \('.*'\)$/);
    // The constraint added for the ATTACH is gone again (the partition constraint says the same).
    const checks = await pool().query<{ n: number }>(`SELECT count(*)::int AS n FROM pg_constraint WHERE conrelid = 'public."p-old-a"'::regclass AND contype = 'c'`);
    assert.equal(checks.rows[0]!.n, 0);
  });

  test("a stored parent_table that is not the policy's table is refused, nothing attached", async () => {
    // Another partitioned table the stored text could name (same columns, same owner).
    await pool().query(`CREATE TABLE events_elsewhere (LIKE events_by_day) PARTITION BY RANGE (expires_at)`);
    await pool().query(`ALTER TABLE events_elsewhere OWNER TO ${pg.escapeIdentifier(partitionOwnerRole(world.bed))}`);
    await pool().query(`UPDATE cleanup_partitions SET parent_table = 'events_elsewhere' WHERE source_name = 'p_old_b'`);
    try {
      const refused = await cli(['restore', '--partition', 'reaper_retired.p_old_b']);
      assert.equal(refused.code, 1, refused.stdout);
      assert.match(refused.stdout, /does not match the policy \(parent_table "events_elsewhere" is not the policy's table "?events_by_day"?\)/);
      assert.ok((await retired()).includes('p_old_b'), 'still in quarantine');
      assert.equal((await pool().query<{ n: number }>(`SELECT count(*)::int AS n FROM pg_inherits WHERE inhparent = 'events_elsewhere'::regclass`)).rows[0]!.n, 0);
    } finally {
      await pool().query(`UPDATE cleanup_partitions SET parent_table = 'events_by_day' WHERE source_name = 'p_old_b'`);
      await pool().query('DROP TABLE events_elsewhere');
    }
  });

  test("the ATTACH does not scan the partition: a CHECK of its bound is there first", async () => {
    // In process, to read the server's DEBUG1 notices of the restoring session.
    const client = await pool().connect();
    const notices: string[] = [];
    const listen = (notice: { message?: string }) => notices.push(notice.message ?? '');
    client.on('notice', listen);
    try {
      await client.query('BEGIN');
      await client.query('SET LOCAL client_min_messages = debug1');
      const table = (await client.query<{ parent_table: string }>(`SELECT parent_table FROM cleanup_partitions WHERE source_name = 'p_old_b'`)).rows[0]!.parent_table;
      const outcome = await partitionRestore(client, { retiredName: 'p_old_b', table, expiresAt: 'expires_at', restoreId: randomUUID(), operator: 'test' });
      assert.equal(outcome.kind, 'restored');
      await client.query('ROLLBACK'); // left in quarantine for the tests after this one
    } finally {
      client.off('notice', listen);
      client.release();
    }
    assert.ok(notices.some((text) => /partition constraint for table "p_old_b" is implied by existing constraints/.test(text)), `no scan of p_old_b under the ATTACH's locks: ${JSON.stringify(notices)}`);
  });

  test('a restored partition stays attached (blocked, with how to release it) until released; then a run retires it again', async () => {
    const listed = await cli(['partitions', 'day-events', '--json']);
    assert.equal(listed.code, 0, listed.stdout);
    const entry = (JSON.parse(listed.stdout) as { partitions: Array<{ partition: string; class: string; reason: string }> }).partitions.find((item) => item.partition === 'public."p-old-a"')!;
    assert.equal(entry.class, 'blocked');
    assert.match(entry.reason, /^restored on \d{4}-\d\d-\d\dT[^;]+; `reaper partitions day-events --release public\."p-old-a"` lets reaper retire it again$/);

    const run = await runDayEventsUntilEnded(world.bed);
    assert.equal(run.state, 'completed', run.error ?? '');
    assert.ok((await attached()).includes('p-old-a'), 'still attached after a run');
    assert.deepEqual((await states()).filter((row) => row.source_name === 'p-old-a'), [{ source_name: 'p-old-a', state: 'restored' }], 'not retired again');
    // A run that classified the partition before the restore committed: its begin step refuses it (review finding: two reads, no state check).
    const stored = (await pool().query<{ parent_table: string; source_schema: string; bound: string; lower_bound: string | null; upper_bound: string }>(
      `SELECT parent_table, source_schema, bound, reaper_iso(lower_bound) AS lower_bound, reaper_iso(upper_bound) AS upper_bound FROM cleanup_partitions WHERE source_name = 'p-old-a'`,
    )).rows[0]!;
    const begun = await partitionRetirementBegin(pool(), {
      policy: 'day-events',
      runId: randomUUID(),
      parentTable: stored.parent_table,
      schema: stored.source_schema,
      name: 'p-old-a',
      bound: stored.bound,
      lower: stored.lower_bound,
      upper: stored.upper_bound,
      concurrent: true,
    });
    assert.equal(begun, null, 'a restored partition is never begun again');

    const notRestored = await cli(['partitions', 'day-events', '--release', 'public.p_future']);
    assert.notEqual(notRestored.code, 0);
    const released = await cli(['partitions', 'day-events', '--release', 'public."p-old-a"']);
    assert.equal(released.code, 0, released.stdout);
    assert.equal((await pool().query<{ reason: string }>(`SELECT reason FROM cleanup_partitions WHERE source_name = 'p-old-a'`)).rows[0]!.reason, 'released by alice@test');
    const again = await runDayEventsUntilEnded(world.bed);
    assert.equal(again.state, 'completed', again.error ?? '');
    assert.deepEqual((await states()).filter((row) => row.source_name === 'p-old-a'), [
      { source_name: 'p-old-a', state: 'released' },
      { source_name: 'p-old-a', state: 'quarantined' },
    ]);
  });

  test('the operator may change only the columns restore and release set on cleanup_partitions', async () => {
    const url = new URL(world.bed.databaseUrl);
    url.username = world.bed.roles!.operator;
    const operator = new pg.Client({ connectionString: url.toString() });
    await operator.connect();
    try {
      await assert.rejects(operator.query(`UPDATE cleanup_partitions SET quarantine_until = now() + interval '100 years'`), /permission denied/);
      await assert.rejects(operator.query(`UPDATE cleanup_partitions SET parent_table = 'x'`), /permission denied/);
      await operator.query('BEGIN');
      await operator.query(`SELECT retirement_id FROM cleanup_partitions WHERE state = 'quarantined' FOR UPDATE`); // restore's lock
      await operator.query(`UPDATE cleanup_partitions SET state = state, reason = reason, updated_at = updated_at WHERE false`);
      await operator.query('ROLLBACK');
    } finally {
      await operator.end();
    }
  });
});
