import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import pg from 'pg';
import { partitionedPolicyYaml, partitionedSuite, runDayEventsUntilEnded } from '../support/partitioned';

/** A partition's name is any identifier: dots and hyphens must not turn it into a qualified name. */
const ODD_NAME = 'ev.2026-01.01';

describe('partitions: names with dots and hyphens', () => {
  const world = partitionedSuite('partitions_names', async (bed) => {
    await bed.pool.query(`ALTER TABLE p_old_b RENAME TO ${pg.escapeIdentifier(ODD_NAME)}`);
  });

  test('a partition named "ev.2026-01.01" is retired, and the run completes', async () => {
    world.bed.writePolicies(partitionedPolicyYaml({ quarantineDays: 0 }));
    const run = await runDayEventsUntilEnded(world.bed);
    assert.equal(run.state, 'completed', run.error ?? '');
    const retired = await world.bed.pool.query<{ name: string }>(`SELECT tablename::text AS name FROM pg_tables WHERE schemaname = 'reaper_retired' ORDER BY 1`);
    assert.deepEqual(retired.rows.map((row) => row.name).sort(), [ODD_NAME, 'p_held', 'p_old_a'].sort(), 'no hold here: p_held is retirable too');
  });

  test('an interrupted retirement whose stored parent_table is not the policy\'s table is kept, its text never run', async () => {
    // A row edited by hand (the text is pasted into DDL): the next run must not execute it.
    await world.bed.pool.query(
      `INSERT INTO cleanup_partitions (policy, run_id, parent_table, source_schema, source_name, retired_name, bound, lower_bound, upper_bound, concurrent, state)
       SELECT 'day-events', gen_random_uuid(), 'events_by_day DETACH PARTITION p_future; SELECT 1', 'public', 'p_future', 'p_future', 'FOR VALUES FROM (MINVALUE) TO (MAXVALUE)', NULL, now(), false, 'detaching'`,
    );
    const run = await runDayEventsUntilEnded(world.bed);
    assert.equal(run.state, 'completed', run.error ?? '');
    const kept = await world.bed.pool.query<{ state: string; reason: string }>(`SELECT state, reason FROM cleanup_partitions WHERE source_name = 'p_future'`);
    assert.equal(kept.rows[0]!.state, 'kept');
    assert.match(kept.rows[0]!.reason, /parent_table .* is not the policy's table/);
    const attached = await world.bed.pool.query(`SELECT 1 FROM pg_inherits WHERE inhrelid = 'p_future'::regclass AND inhparent = 'events_by_day'::regclass`);
    assert.equal(attached.rowCount, 1, 'p_future is still attached');
  });
});
