import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, test } from 'node:test';
import pg from 'pg';
import { loadPolicies, retiresPartitions } from '../../shared/config/policies';
import { partitionRetirementBegin, partitionWhereabouts } from '../../shared/db/queries/partitions';
import { targetResolve } from '../../shared/db/queries/target';
import { retirePartitions } from '../../services/scheduler/partition-retirement';
import { testLog } from '../support/fixtures';
import { databaseNowIso } from '../support/seed';
import { partitionedPolicyYaml, partitionedSuite, partitionOwnerRole } from '../support/partitioned';

/**
 * Issue 44: an interrupted retirement is finished from where the catalog says its partition is. A
 * parent lookup that finds nothing (no pg_inherits row with the retirement's parent, or no parent)
 * must not read as "detached by reaper": a partition now attached to another table, or whose
 * parent is gone, is not reaper's to move; the retirement is kept with what it found.
 */
describe('partitions: where an interrupted retirement left its partition', () => {
  const world = partitionedSuite('partitions_whereabouts', (bed) => void bed.writePolicies(partitionedPolicyYaml()));

  test('the catalog says attached elsewhere or parent missing, never detached', async () => {
    const { pool } = world.bed;
    await pool.query('CREATE TABLE lonely (id bigint)');
    const where = (parentTable: string, sourceName: string) => partitionWhereabouts(pool, { parentTable, sourceSchema: 'public', sourceName, retiredName: sourceName });
    assert.equal(await where('events_by_day', 'p_old_a'), 'attached');
    assert.equal(await where('no_such_parent', 'lonely'), 'parent-missing');
    assert.equal(await where('no_such_parent', 'p_old_a'), 'attached-elsewhere');
    assert.equal(await where('events_by_day', 'lonely'), 'detached');
    assert.equal(await where('events_by_day', 'no_such_table'), 'missing');
  });

  test('an open retirement whose partition was attached to another table is kept, the partition left where it is', async () => {
    const bed = world.bed;
    const owner = pg.escapeIdentifier(partitionOwnerRole(bed));
    const policy = loadPolicies(bed.env().policiesPath).get('day-events')!;
    assert.ok(retiresPartitions(policy));
    const info = (await bed.pool.query<{ bound: string; lower: string; upper: string }>(
      `SELECT pg_get_expr(c.relpartbound, c.oid) AS bound, reaper_iso(min(e.expires_at)) AS lower, reaper_iso(max(e.expires_at)) AS upper
       FROM pg_class c, p_old_a e WHERE c.oid = 'p_old_a'::regclass GROUP BY c.relpartbound, c.oid`,
    )).rows[0]!;
    // A run recorded its intent on p_old_a and stopped; then someone moved p_old_a to another table.
    const parentTable = (await targetResolve(bed.pool, policy)).table; // as the scheduler records it (quoted)
    const begun = await partitionRetirementBegin(bed.pool, {
      policy: 'day-events', runId: randomUUID(), parentTable, schema: 'public', name: 'p_old_a', bound: info.bound, lower: info.lower, upper: info.upper, concurrent: false,
    });
    assert.ok(begun);
    await bed.pool.query(`CREATE TABLE other_events (LIKE events_by_day) PARTITION BY RANGE (expires_at)`);
    await bed.pool.query(`ALTER TABLE other_events OWNER TO ${owner}`);
    await bed.pool.query('ALTER TABLE events_by_day DETACH PARTITION p_old_a');
    await bed.pool.query(`ALTER TABLE other_events ATTACH PARTITION p_old_a ${info.bound}`);

    const scheduler = new pg.Pool({ connectionString: bed.as(bed.env(), 'scheduler').databaseUrl, max: 2 });
    try {
      const target = await targetResolve(scheduler, policy);
      await retirePartitions({ pool: scheduler, log: testLog, stillClaimed: () => true }, { runId: randomUUID(), cutoff: await databaseNowIso(bed.pool) }, policy, target, {
        room: Number.POSITIVE_INFINITY,
        policyVersion: 'test',
      });
    } finally {
      await scheduler.end();
    }
    const state = (await bed.pool.query<{ state: string; reason: string }>(`SELECT state, reason FROM cleanup_partitions WHERE retirement_id = $1`, [begun.retirementId])).rows[0]!;
    assert.equal(state.state, 'kept');
    assert.match(state.reason, /not where reaper left it \(attached-elsewhere\)/);
    const parent = (await bed.pool.query<{ parent: string }>(`SELECT inhparent::regclass::text AS parent FROM pg_inherits WHERE inhrelid = to_regclass('public.p_old_a')`)).rows[0];
    assert.equal(parent?.parent, 'other_events', 'p_old_a stays a partition of the other table, in its schema');
  });
});
