import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { loadPolicies } from '../../shared/config/policies';
import { runsGetSummary, runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startScheduler } from '../../services/scheduler/scheduler';
import { startWorker } from '../../services/worker/worker';
import { eventually } from '../support/eventually';
import { testLog } from '../support/fixtures';
import { runReaperCli } from '../support/processes';
import { partitionedPolicyYaml, partitionedSuite } from '../support/partitioned';

/**
 * Issue 44 item 1: on a partitioned table the key may be unique only together with expiresAt
 * (primary key (id, expires_at)); that pair names a row through the row path: the batches (id and
 * exact observed expiry), the conditional DELETE, the audit, the archive, and `reaper restore --run`
 * (ON CONFLICT on the pair; a key that exists again with another expiry is reported, not doubled).
 */
describe('partitions: (key, expiresAt) as the row identity on the row path', () => {
  // No retiring: every expired row goes through the row path; archive on for restore.
  const world = partitionedSuite('partitions_identity', (bed) => void bed.writePolicies(partitionedPolicyYaml({ extra: '    archive: { enabled: true, retainDays: 7 }' }).replace(/ *partitions:.*\n/, '')));

  test('a run deletes, audits and archives each expired row once; restore --run puts them back, a re-used key with another expiry is a conflict', async () => {
    const expired = (await world.bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM events_by_day WHERE expires_at <= now() AND status = 'open'`)).rows[0]!.n;
    const env = world.bed.env();
    const policies = loadPolicies(env.policiesPath);
    const scheduler = await startScheduler(world.bed.as(env, 'scheduler'), policies, testLog);
    const worker = await startWorker(world.bed.as(env, 'worker'), policies, testLog);
    let runId: string;
    try {
      runId = (await runsInsertIfAbsent(world.bed.pool, { policy: 'day-events', trigger: 'manual', scheduledFor: null, cutoff: null }))!.runId;
      await eventually('the run completed', async () => (await runsGetSummary(world.bed.pool, runId))?.state === 'completed', { timeoutMs: 30_000 });
    } finally {
      await scheduler.stop();
      await worker.stop();
    }
    const audit = await world.bed.pool.query<{ n: number; keys: number }>(`SELECT count(*)::int AS n, count(DISTINCT (key, observed_expiry))::int AS keys FROM cleanup_audit WHERE run_id = $1`, [runId]);
    assert.equal(audit.rows[0]!.n, expired, 'one audit row per deleted row');
    assert.equal(audit.rows[0]!.keys, expired);
    assert.equal((await world.bed.pool.query(`SELECT 1 FROM events_by_day WHERE expires_at <= now() AND status = 'open'`)).rowCount, 0);
    // Key 2001 comes back with another expiry (a new row of the application): restoring the old one is a conflict.
    await world.bed.pool.query(`INSERT INTO events_by_day (id, status, expires_at) VALUES (2001, 'open', now() + interval '1 hour')`);
    const restored = await runReaperCli(['restore', '--run', runId, '--json'], world.bed.processEnv());
    const result = JSON.parse(restored.stdout.slice(restored.stdout.indexOf('{'))) as { restored: number; conflicts: number; conflictKeys: string[] };
    assert.equal(result.restored, expired - 1, restored.stdout);
    assert.deepEqual(result.conflictKeys, ['2001']);
    assert.equal(restored.code, 1, 'a conflict is reported with exit 1');
    const back = await world.bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM events_by_day WHERE expires_at <= now() AND status = 'open'`);
    assert.equal(back.rows[0]!.n, expired - 1, 'every other row is back, in its partition');
    assert.equal((await world.bed.pool.query(`SELECT 1 FROM events_by_day WHERE id = 2001`)).rowCount, 1, 'never two rows of key 2001');
  });
});
