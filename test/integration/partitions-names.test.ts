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
});
