import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { partitionRetiredRoutingKey, type PartitionRetiredEventV1 } from '../../shared/contracts/expiry-event';
import { outboxClaimOldest } from '../../shared/db/queries/outbox';
import { runReaperCli } from '../support/processes';
import { HELD_ID, OUT_OF_GUARD_ID, partitionedPolicyYaml, partitionedSuite, runDayEventsUntilEnded } from '../support/partitioned';

/**
 * Issue 44 steps 3 and 4, as deployed (the scheduler and the worker log in as their printed roles;
 * the scheduler is a member of the table's owner role, as `reaper roles` grants): a run retires
 * exactly the retirable partitions (into reaper_retired, audited with count, bound and checksum),
 * the row path deletes the eligible rows of the others, the held / out-of-guard / FK-referenced /
 * default ones stay attached; a later run drops a retired partition whose quarantine is over;
 * `reaper restore --partition` attaches one back, refused on overlap or after the quarantine.
 */
describe('partitions: retiring', () => {
  const world = partitionedSuite('partitions_retire');

  async function runToCompletion(): Promise<string> {
    const run = await runDayEventsUntilEnded(world.bed);
    assert.equal(run.state, 'completed', run.error ?? '');
    return run.runId;
  }

  const attached = async () =>
    (await world.bed.pool.query<{ name: string }>(`SELECT c.relname::text AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'events_by_day'::regclass ORDER BY 1`)).rows.map((row) => row.name);
  const retired = async () => (await world.bed.pool.query<{ name: string }>(`SELECT tablename::text AS name FROM pg_tables WHERE schemaname = 'reaper_retired' ORDER BY 1`)).rows.map((row) => row.name);
  const remaining = async (partition: string) => (await world.bed.pool.query<{ id: string }>(`SELECT id::text FROM ONLY ${partition} WHERE expires_at <= now() ORDER BY id`)).rows.map((row) => row.id);

  test('a run retires exactly the retirable partitions; the row path handles the rest; holds, guard, FK and default stay with reasons', async () => {
    world.bed.writePolicies(partitionedPolicyYaml({ quarantineDays: 0, extra: '    events: { enabled: true }' }));
    const hold = await runReaperCli(['hold', 'add', 'day-events', HELD_ID, '--reason', 'litigation 44'], world.bed.processEnv());
    assert.equal(hold.code, 0, hold.stdout);
    const runId = await runToCompletion();

    assert.deepEqual(await retired(), ['p_old_a', 'p_old_b']);
    assert.deepEqual(await attached(), ['p_default', 'p_fk', 'p_future', 'p_guard', 'p_held', 'p_today']);
    const rows = (await world.bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM reaper_retired.p_old_a')).rows[0]!.n;
    assert.equal(rows, 6, 'the retired table is the archive: every row is still in it');
    // The row path: expired eligible rows of the attached partitions are gone; the held and out-of-guard rows stay.
    assert.deepEqual(await remaining('p_held'), [HELD_ID]);
    assert.deepEqual(await remaining('p_guard'), [OUT_OF_GUARD_ID]);
    assert.deepEqual(await remaining('p_fk'), [], 'the FK-referenced partition is not retired; its rows go row by row');
    assert.deepEqual(await remaining('p_default'), []);
    assert.deepEqual(await remaining('p_today'), []);

    const states = await world.bed.pool.query<{ source_name: string; state: string; row_count: string; run_id: string }>(
      'SELECT source_name, state, row_count::text, run_id::text FROM cleanup_partitions ORDER BY source_name',
    );
    assert.deepEqual(states.rows, [
      { source_name: 'p_old_a', state: 'quarantined', row_count: '6', run_id: runId },
      { source_name: 'p_old_b', state: 'quarantined', row_count: '6', run_id: runId },
    ]);
    const audit = await world.bed.pool.query<{ key: string; row_count: string; partition_bound: string; key_checksum: string }>(
      `SELECT key, row_count::text, partition_bound, key_checksum FROM cleanup_audit WHERE outcome = 'partition-retired' ORDER BY key`,
    );
    assert.equal(audit.rows.length, 2);
    assert.equal(audit.rows[0]!.key, 'partition:reaper_retired.p_old_a');
    assert.equal(audit.rows[0]!.row_count, '6');
    assert.match(audit.rows[0]!.partition_bound, /^FOR VALUES FROM \('.*'\) TO \('.*'\)$/);
    assert.match(audit.rows[0]!.key_checksum, /^[0-9a-f]+$/);
    // The checksum is the one of the rows kept in quarantine.
    const sum = await world.bed.pool.query<{ c: string }>(
      `SELECT to_hex((coalesce(sum(hashtextextended(id::text, timestamp_hash_extended(expires_at AT TIME ZONE 'UTC', 0)) & 1152921504606846975), 0) % 9223372036854775807)::bigint) AS c FROM reaper_retired.p_old_a`,
    );
    assert.equal(audit.rows[0]!.key_checksum, sum.rows[0]!.c);
    // events on: one partition-retired event per retired partition, as the relay reads it (count, bound, checksum).
    const entries = await outboxClaimOldest(world.bed.pool, { eventLimit: 1000, owner: 'test', leaseMs: 1000 });
    const retiredEvents = entries.filter((entry) => entry.kind === 'partition-retired').map((entry) => entry.event as PartitionRetiredEventV1);
    assert.deepEqual(retiredEvents.map((event) => [event.partition, event.rowCount, event.keyChecksum === audit.rows.find((row) => row.key === `partition:${event.partition}`)!.key_checksum]), [
      ['reaper_retired.p_old_a', 6, true],
      ['reaper_retired.p_old_b', 6, true],
    ]);
    assert.equal(partitionRetiredRoutingKey('day-events'), 'day-events.partition-retired');
    assert.ok(entries.some((entry) => entry.kind === 'expired'), 'the row path\'s deletions have their own expiry events');
    assert.ok(!entries.some((entry) => entry.kind === 'expired' && entry.events.some((event) => /^200[1-6]$|^300[1-6]$/.test(event.key))), 'no row event for a retired partition\'s rows');
  });

  test('restore --partition attaches a quarantined partition back; refused clearly on overlap and after the quarantine', async () => {
    const listed = await runReaperCli(['partitions', 'day-events', '--json'], world.bed.processEnv());
    assert.deepEqual((JSON.parse(listed.stdout) as { quarantined: Array<{ partition: string; from: string; rows: number }> }).quarantined.map((entry) => [entry.partition, entry.from, entry.rows]), [
      ['reaper_retired.p_old_b', 'public.p_old_b', 6],
      ['reaper_retired.p_old_a', 'public.p_old_a', 6],
    ], 'reaper partitions lists what is in quarantine');
    // quarantineDays 0: p_old_a's quarantine is over already.
    const ended = await runReaperCli(['restore', '--partition', 'reaper_retired.p_old_a'], world.bed.processEnv());
    assert.equal(ended.code, 1, ended.stdout);
    assert.match(ended.stdout, /quarantine of reaper_retired\.p_old_a ended at .*: it is dropped/);
    await world.bed.pool.query(`UPDATE cleanup_partitions SET quarantine_until = now() + interval '1 day' WHERE state = 'quarantined'`);
    // An overlapping partition now attached where p_old_b was: refused, nothing changes.
    const bound = (await world.bed.pool.query<{ bound: string }>(`SELECT bound FROM cleanup_partitions WHERE source_name = 'p_old_b'`)).rows[0]!.bound;
    await world.bed.pool.query(`CREATE TABLE p_new_b PARTITION OF events_by_day ${bound}`);
    const overlap = await runReaperCli(['restore', '--partition', 'reaper_retired.p_old_b'], world.bed.processEnv());
    assert.equal(overlap.code, 1, overlap.stdout);
    assert.match(overlap.stdout, /overlaps the attached partition\(s\) public\.p_new_b/);
    assert.ok((await retired()).includes('p_old_b'));
    const restored = await runReaperCli(['restore', '--partition', 'reaper_retired.p_old_a', '--json'], world.bed.processEnv());
    assert.equal(restored.code, 0, restored.stdout);
    assert.ok((await attached()).includes('p_old_a'));
    assert.deepEqual(await retired(), ['p_old_b']);
    assert.equal((await world.bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM events_by_day WHERE id BETWEEN 2001 AND 2006')).rows[0]!.n, 6, 'every row is back');
    assert.equal((await world.bed.pool.query<{ state: string }>(`SELECT state FROM cleanup_partitions WHERE source_name = 'p_old_a'`)).rows[0]!.state, 'restored');
  });

  test('a later run drops a retired partition whose quarantine is over, once', async () => {
    await world.bed.pool.query(`UPDATE cleanup_partitions SET quarantine_until = now() - interval '1 second' WHERE state = 'quarantined'`);
    await world.bed.pool.query('DROP TABLE p_new_b');
    // p_old_a was restored: it stays attached (blocked) until an operator releases it, never retired again by itself.
    await runToCompletion();
    const states = await world.bed.pool.query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions ORDER BY retirement_id');
    assert.deepEqual(states.rows, [
      { source_name: 'p_old_a', state: 'restored' },
      { source_name: 'p_old_b', state: 'dropped' },
    ]);
    assert.deepEqual(await retired(), []);
    assert.ok((await attached()).includes('p_old_a'));
  });
});
