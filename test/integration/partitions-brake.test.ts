import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { loadPolicies } from '../../shared/config/policies';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startScheduler } from '../../services/scheduler/scheduler';
import { eventually } from '../support/eventually';
import { testLog } from '../support/fixtures';
import { runReaperCli } from '../support/processes';
import { HELD_ID, partitionedPolicyYaml, partitionedSuite } from '../support/partitioned';

/**
 * Issue 44 "the brake and approval count the partition's rows": a run whose count (retirable
 * partitions' rows included) passes limits.maxPerRun retires nothing and waits for approval; once
 * approved, it retires them.
 */
describe('partitions: the brake counts retirable rows', () => {
  const world = partitionedSuite('partitions_brake', async (bed) => {
    // 12 rows in the two retirable partitions alone pass maxPerRun 10 (the whole table: 30+).
    bed.writePolicies(partitionedPolicyYaml({ limits: '{ maxPerRun: 10 }' }));
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', $1, 'litigation 44', 'test')`, [HELD_ID]);
  });

  test('over maxPerRun: nothing retired until approved; approved: retired', async () => {
    const env = world.bed.env();
    const scheduler = await startScheduler(world.bed.as(env, 'scheduler'), loadPolicies(env.policiesPath), testLog);
    try {
      const run = (await runsInsertIfAbsent(world.bed.pool, { policy: 'day-events', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
      const held = await eventually('the run awaits approval', async () => {
        const row = await world.bed.pool.query<{ state: string; counted_candidates: number }>('SELECT state, counted_candidates::int AS counted_candidates FROM cleanup_runs WHERE run_id = $1', [run.runId]);
        return row.rows[0]?.state === 'awaiting-approval' ? row.rows[0] : undefined;
      }, { timeoutMs: 30_000 });
      assert.ok(held.counted_candidates >= 6 + 12 + 5 + 5 + 1, `the count includes the retirable partitions' rows (${held.counted_candidates})`);
      assert.equal((await world.bed.pool.query('SELECT 1 FROM cleanup_partitions')).rowCount, 0, 'nothing retired while awaiting approval');
      assert.equal((await world.bed.pool.query(`SELECT 1 FROM pg_tables WHERE schemaname = 'reaper_retired'`)).rowCount, 0);

      const approved = await runReaperCli(['approve', run.runId], world.bed.processEnv());
      assert.equal(approved.code, 0, approved.stdout);
      await eventually('both retired', async () => ((await world.bed.pool.query(`SELECT 1 FROM cleanup_partitions WHERE state = 'quarantined'`)).rowCount === 2 ? true : undefined), { timeoutMs: 30_000 });
      const published = await eventually('the run published', async () => {
        const row = await world.bed.pool.query<{ state: string; candidates: number }>('SELECT state, candidates::int AS candidates FROM cleanup_runs WHERE run_id = $1', [run.runId]);
        return row.rows[0]?.state === 'published' || row.rows[0]?.state === 'completed' ? row.rows[0] : undefined;
      }, { timeoutMs: 30_000 });
      // The approved count covers retired and published rows together: the scan publishes only the rest.
      assert.equal(published.candidates + 12, held.counted_candidates, 'retired (12) + published = the approved count');
    } finally {
      await scheduler.stop();
    }
  });
});
