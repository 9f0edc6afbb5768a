import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { partitionedPolicyYaml, partitionedSuite, runDayEventsUntilEnded } from '../support/partitioned';

/**
 * Issue 44: a retired table the database refuses to drop (a view depends on it: 2BP01, permanent)
 * must not fail every run of its policy: the run leaves it quarantined, drops the others, and goes
 * on with classification, retiring and the row path.
 */
describe('partitions: a retired table that cannot be dropped', () => {
  const world = partitionedSuite('partitions_undroppable', (bed) => void bed.writePolicies(partitionedPolicyYaml({ quarantineDays: 0 })));

  test('a view on a quarantined table whose quarantine ended: the run completes, deletes its row-path rows, the table stays', async () => {
    const first = await runDayEventsUntilEnded(world.bed);
    assert.equal(first.state, 'completed', first.error ?? '');
    // The application's view (created by the superuser, the application's setup) on one retired table.
    await world.bed.pool.query('CREATE VIEW old_a_report AS SELECT count(*) AS n FROM reaper_retired.p_old_a');
    // A row for the row path of the next run.
    await world.bed.pool.query(`INSERT INTO events_by_day (id, status, expires_at) VALUES (6100, 'open', now() - interval '1 minute')`);

    const second = await runDayEventsUntilEnded(world.bed);
    assert.equal(second.state, 'completed', second.error ?? '');
    assert.equal((await world.bed.pool.query('SELECT 1 FROM events_by_day WHERE id = 6100')).rowCount, 0, 'the row path ran');
    const states = await world.bed.pool.query<{ source_name: string; state: string }>(`SELECT source_name, state FROM cleanup_partitions WHERE source_name IN ('p_old_a', 'p_old_b') ORDER BY 1`);
    assert.deepEqual(states.rows, [
      { source_name: 'p_old_a', state: 'quarantined' },
      { source_name: 'p_old_b', state: 'dropped' },
    ]);
    assert.equal((await world.bed.pool.query(`SELECT to_regclass('reaper_retired.p_old_a')::text AS t`)).rows[0].t, 'reaper_retired.p_old_a', 'the table stays');
  });
});
