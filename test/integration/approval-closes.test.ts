import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { loadPolicies } from '../../shared/config/policies';
import { runsGetSummary, runsInsertIfAbsent, type RunSummary } from '../../shared/db/queries/runs';
import { planBrakeCount, planCount } from '../../shared/db/queries/plan';
import { targetResolve } from '../../shared/db/queries/target';
import { startScheduler, type SchedulerHandle } from '../../services/scheduler/scheduler';
import { eventually } from '../support/eventually';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { currentKeyOf, MEDIA_POLICY, mediaPolicyHead, seedAssets } from '../support/remote-helpers';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 40, item 3: approvals that could never be satisfied.
 *  (a) A run taken over from a scheduler that published a window it never confirmed carries those
 *      candidates as `unconfirmed`; its allowance subtracts them, but it was held with the count
 *      alone: approving the shown count left no room for the first page, and it held again with
 *      the same count after every approval. It is now held with the number the allowance is
 *      measured against.
 *  (b) remote-delete: the scan publishes rows whose operation ended `held` or `superseded`, while
 *      the brake and `reaper plan` counted only `held`: the hold showed fewer candidates than the
 *      scan had, and `approve --expect <shown>` was followed by another hold, forever. One SQL
 *      predicate (ledgerCarriesDecisionSql) now serves the scan, the brake and the plan.
 * Both run the real scheduler against PostgreSQL; only publishing is looked at (no worker).
 */
describe('guardrails: every approval of the shown count lets the run finish', () => {
  let bed: TestBed;
  let scheduler: SchedulerHandle | undefined;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

  before(async () => {
    bed = await makeTestBed('approval_closes');
    bed.writePolicies(
      combinedPoliciesYaml(
        rowDeletePolicyYaml({ batchSize: 10, limits: { maxPerRun: 100 } }),
        `${mediaPolicyHead(10)}
    remote:
      baseUrl: http://127.0.0.1:9
      path: /assets/{id}
      timeoutMs: 2000
    admission: { ratePerSecond: 10, burst: 5, concurrency: 2 }
    limits: { maxPerRun: 10 }
`,
      ),
    );
  });

  after(async () => {
    await scheduler?.stop();
    await assertNoLeakedProcesses();
    await bed?.close();
  });

  const startSchedulerHere = async () => {
    const env = bed.env();
    scheduler = await startScheduler(bed.as(env, 'scheduler'), loadPolicies(env.policiesPath), log);
  };
  const summary = async (runId: string) => (await runsGetSummary(bed.pool, runId))!;
  const until = (runId: string, what: string, done: (run: RunSummary) => boolean) =>
    eventually(`run ${runId} ${what}`, async () => {
      const run = await summary(runId);
      return done(run) ? run : undefined;
    }, { timeoutMs: 30_000, describe: () => summary(runId) });
  const approve = async (runId: string, expect: number | string) => {
    const approved = await runReaperCli(['approve', runId, '--expect', String(expect)], bed.processEnv());
    assert.equal(approved.code, 0, approved.stdout);
  };

  test('(a) a run taken over with 80 unconfirmed candidates: held with 130, approved, published', async () => {
    await seedHolds(bed.pool, { expiredHeld: 50 });
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    // An earlier scheduler claimed it, began a window of 80 (recorded before its publish) and died.
    await bed.pool.query(
      `UPDATE cleanup_runs SET state = 'scanning', owner = 'dead-scheduler', claim_count = 1, started_at = clock_timestamp(),
         cutoff = clock_timestamp(), window_candidates = 80, lease_expires_at = clock_timestamp() - interval '1 second'
       WHERE run_id = $1`,
      [run.runId],
    );
    await startSchedulerHere();
    const held = await until(run.runId, 'held by the brake', (r) => r.state === 'awaiting-approval');
    assert.equal(held.countedCandidates, 130, `the 50 still to publish and the 80 an earlier claim may have published: ${JSON.stringify(held)}`);
    await approve(run.runId, 130);
    const done = await until(run.runId, 'published after one approval', (r) => r.state === 'published' || r.state === 'completed' || r.state === 'awaiting-approval');
    assert.notEqual(done.state, 'awaiting-approval', `no second hold: ${JSON.stringify(done)}`);
    assert.equal(done.candidates, 50, 'every remaining candidate published');
    await scheduler!.stop();
    scheduler = undefined;
  });

  test('(b) remote-delete: superseded operations count as the scan sees them; the approval of the shown count publishes the run', async () => {
    const env = bed.env();
    const policy = loadPolicies(env.policiesPath).get(MEDIA_POLICY)!;
    const target = await targetResolve(bed.pool, policy);
    const ids = await seedAssets(bed.pool, 'sup', 30);
    // 25 operations ended superseded (a guard flipped and back, same expiry): their rows hold the decision again.
    for (const id of ids.slice(0, 25)) {
      const key = await currentKeyOf(bed.pool, id);
      await bed.pool.query(
        `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, state, outcome, completed_at)
         SELECT $1, $2, asset_id, retention_expires_at, 'done', 'superseded', now() FROM media_assets WHERE asset_id = $3`,
        [key, MEDIA_POLICY, id],
      );
    }
    const cutoff = (await bed.pool.query<{ now: string }>('SELECT reaper_iso(clock_timestamp()) AS now')).rows[0]!.now;
    assert.equal((await planCount(bed.pool, target, cutoff, { unrecordedFor: MEDIA_POLICY })).candidates, 30, 'reaper plan counts what the scan publishes');
    assert.equal((await planBrakeCount(bed.pool, target, { cutoff, after: null, unrecordedFor: MEDIA_POLICY, guarded: false })).candidates, 30, 'and so does the brake');

    const run = (await runsInsertIfAbsent(bed.pool, { policy: MEDIA_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    await startSchedulerHere();
    const held = await until(run.runId, 'held by the brake', (r) => r.state === 'awaiting-approval');
    assert.equal(held.countedCandidates, 30, JSON.stringify(held));
    await approve(run.runId, 30);
    const done = await until(run.runId, 'published after one approval', (r) => r.state === 'published' || r.state === 'completed' || r.state === 'awaiting-approval');
    assert.notEqual(done.state, 'awaiting-approval', `no second hold: ${JSON.stringify(done)}`);
    assert.equal(done.candidates, 30);
  });

  test('(c) approve --expect <count>@<hold> approves that hold only, not a later one with the same count', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 150 });
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const held = await until(run.runId, 'held by the brake', (r) => r.state === 'awaiting-approval');
    assert.deepEqual({ counted: held.countedCandidates, hold: held.holdCount }, { counted: 150, hold: 1 });
    const shown = await runReaperCli(['run', run.runId], bed.processEnv());
    assert.match(shown.stdout, new RegExp(`reaper approve ${run.runId} --expect 150@1`), shown.stdout);
    // What a second hold with the same count records (another operator approved #1, the run was
    // held again: a new decision the first operator never saw).
    await bed.pool.query('UPDATE cleanup_runs SET hold_count = hold_count + 1 WHERE run_id = $1', [run.runId]);
    const stale = await runReaperCli(['approve', run.runId, '--expect', '150@1'], bed.processEnv());
    assert.equal(stale.code, 1, stale.stdout);
    assert.match(stale.stdout, /awaits approval for 150@2 \(candidates@hold\), not 150@1/);
    assert.equal((await summary(run.runId)).state, 'awaiting-approval', 'still held');
    await approve(run.runId, '150@2');
    await until(run.runId, 'published after the approval of the current hold', (r) => r.state === 'published' || r.state === 'completed');
  });
});
