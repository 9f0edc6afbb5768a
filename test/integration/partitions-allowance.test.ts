import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, test } from 'node:test';
import pg from 'pg';
import { loadPolicies, retiresPartitions } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/target';
import { retirePartitions } from '../../services/scheduler/partition-retirement';
import { testLog } from '../support/fixtures';
import { databaseNowIso } from '../support/seed';
import { HELD_ID, partitionedPolicyYaml, partitionedSuite } from '../support/partitioned';

/**
 * Issue 44 "the brake and approval count the partition's rows": the run's allowance is checked
 * against the rows the retirement would actually take, as the re-check in the detaching
 * transaction counts them, not against an earlier count. Rows written into a retirable partition
 * after the classification (here: right before its detach) push it past the allowance left: it
 * is kept (never detached) and its rows are the row path's and the brake's; the next partition,
 * within the allowance, is retired.
 */
describe('partitions: the allowance is checked against the re-check count', () => {
  const world = partitionedSuite('partitions_allowance', (bed) => void bed.writePolicies(partitionedPolicyYaml()));

  test('a partition that grew past the allowance after its classification is not retired', async () => {
    const bed = world.bed;
    const scheduler = new pg.Pool({ connectionString: bed.as(bed.env(), 'scheduler').databaseUrl, max: 2 });
    try {
      const policy = loadPolicies(bed.env().policiesPath).get('day-events')!;
      assert.ok(retiresPartitions(policy));
      const target = await targetResolve(scheduler, policy);
      const grown: string[] = [];
      await retirePartitions(
        {
          pool: scheduler,
          log: testLog,
          stillClaimed: () => true,
          beforeDetach: async (partition) => {
            if (grown.length > 0) return;
            grown.push(partition);
            // One more expired row within the guard in the partition about to be detached: 7 rows, allowance 6.
            await bed.pool.query(`INSERT INTO events_by_day (id, status, expires_at) SELECT 2100, 'open', min(expires_at) + interval '1 second' FROM ONLY p_old_a`);
          },
        },
        { runId: randomUUID(), cutoff: await databaseNowIso(bed.pool) },
        policy,
        target,
        { room: 6, policyVersion: 'test' },
      );
      assert.deepEqual(grown, ['public.p_old_a']);
      const states = (await bed.pool.query<{ source_name: string; state: string; row_count: number | null; reason: string | null }>(
        'SELECT source_name, state, row_count::int AS row_count, reason FROM cleanup_partitions ORDER BY retirement_id',
      )).rows;
      assert.equal(states[0]!.source_name, 'p_old_a');
      assert.equal(states[0]!.state, 'kept', JSON.stringify(states));
      assert.match(states[0]!.reason!, /its 7 row\(s\) pass the run's allowance left \(6\)/);
      const retired = states.filter((row) => row.state === 'quarantined');
      assert.deepEqual(retired.map((row) => [row.source_name, row.row_count]), [['p_old_b', 6]], 'the next partition, within the allowance, is retired');
      assert.ok(retired.reduce((sum, row) => sum + row.row_count!, 0) <= 6, 'never more rows retired than the allowance');
      assert.equal((await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM events_by_day WHERE id BETWEEN 2001 AND 2100')).rows[0]!.n, 7, 'p_old_a stays attached with its rows');
    } finally {
      await scheduler.end();
    }
  });

  test('a hold whose key does not cast to the key type (written by hand): the proof falls back to reading the rows, and the holds still win', async () => {
    const bed = world.bed;
    // After the test above: p_old_a (7 rows) and p_held are attached and retirable; a valid hold on a row of p_held, and one that names no bigint.
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', 'not-a-number', 'typo', 'test'), ('day-events', $1, 'litigation', 'test')`, [HELD_ID]);
    const scheduler = new pg.Pool({ connectionString: bed.as(bed.env(), 'scheduler').databaseUrl, max: 2 });
    try {
      const policy = loadPolicies(bed.env().policiesPath).get('day-events')!;
      assert.ok(retiresPartitions(policy));
      const runId = randomUUID();
      const result = await retirePartitions({ pool: scheduler, log: testLog, stillClaimed: () => true }, { runId, cutoff: await databaseNowIso(bed.pool) }, policy, await targetResolve(scheduler, policy), {
        room: Number.POSITIVE_INFINITY,
        policyVersion: 'test',
      });
      assert.equal(result.retiredRows, 7, 'p_old_a retired, p_held (a held row) not');
      const states = (await bed.pool.query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions WHERE run_id = $1 ORDER BY 1', [runId])).rows;
      assert.deepEqual(states, [{ source_name: 'p_old_a', state: 'quarantined' }]);
      assert.equal((await bed.pool.query('SELECT 1 FROM events_by_day WHERE id = $1', [HELD_ID])).rowCount, 1, 'the held row stays in the table');
    } finally {
      await scheduler.end();
    }
  });
});

/**
 * The same allowance on the DETACH ... CONCURRENTLY path (no default partition), which cannot be
 * rolled back (review finding): a partition whose rows already pass the allowance left is never
 * begun, so never detached and attached back; before, it left the parent's view and came back
 * with the reason "its 7 row(s) pass the run's allowance left (6)".
 */
describe('partitions: the allowance on the concurrent path', () => {
  const world = partitionedSuite('partitions_allowance_concurrent', async (bed) => {
    bed.writePolicies(partitionedPolicyYaml());
    await bed.pool.query('DROP TABLE p_default');
  });

  test('a partition already over the allowance is not detached at all; the next one within it is retired', async () => {
    const bed = world.bed;
    await bed.pool.query(`INSERT INTO events_by_day (id, status, expires_at) SELECT 2100, 'open', min(expires_at) + interval '1 second' FROM ONLY p_old_a`);
    const scheduler = new pg.Pool({ connectionString: bed.as(bed.env(), 'scheduler').databaseUrl, max: 2 });
    try {
      const policy = loadPolicies(bed.env().policiesPath).get('day-events')!;
      assert.ok(retiresPartitions(policy));
      const result = await retirePartitions({ pool: scheduler, log: testLog, stillClaimed: () => true }, { runId: randomUUID(), cutoff: await databaseNowIso(bed.pool) }, policy, await targetResolve(scheduler, policy), {
        room: 6,
        policyVersion: 'test',
      });
      const states = (await bed.pool.query<{ source_name: string; state: string; concurrent: boolean }>('SELECT source_name, state, concurrent FROM cleanup_partitions ORDER BY retirement_id')).rows;
      assert.deepEqual(states, [{ source_name: 'p_old_b', state: 'quarantined', concurrent: true }], 'p_old_a never begun (never detached); p_old_b retired concurrently');
      assert.equal(result.retiredRows, 6);
      assert.equal((await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM events_by_day WHERE id BETWEEN 2001 AND 2100')).rows[0]!.n, 7, 'p_old_a stays attached with its rows');
    } finally {
      await scheduler.end();
    }
  });
});
