import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { loadPolicies } from '../../shared/config/policies';
import { runsGetSummary, runsInsertIfAbsent, type RunSummary } from '../../shared/db/queries/runs';
import { startScheduler, type SchedulerHandle } from '../../services/scheduler/scheduler';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { eventually } from '../support/eventually';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * An approval covers what was counted, and no more (issue 17 item 1, docs/design.md invariant 16).
 * The brake holds a run with its count; `reaper approve` records that count and the policy
 * version; the run then publishes at most the count plus limits.approvalTolerance (default 10 %),
 * checked window by window as it publishes. Rows that became eligible under the same cutoff while
 * it waited (a bulk backdated import) send it back to 'awaiting-approval' with the new count, and
 * only a second approval lets it go on. A policy version deployed before the approval does too.
 */
const BATCH_SIZE = 10;

const policiesYaml = (maxPerRun: number) => rowDeletePolicyYaml({ batchSize: BATCH_SIZE, limits: { maxPerRun } });

describe('guardrails: an approval covers what was counted, and no more', () => {
  let bed: TestBed;
  let scheduler: SchedulerHandle | undefined;
  let worker: WorkerHandle | undefined;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

  const startServices = async () => {
    const env = bed.env();
    const policies = loadPolicies(env.policiesPath);
    scheduler = await startScheduler(bed.as(env, 'scheduler'), policies, log);
    worker = await startWorker(bed.as(env, 'worker'), policies, log);
  };
  const stopServices = async () => {
    await scheduler?.stop();
    await worker?.stop();
    scheduler = undefined;
    worker = undefined;
  };

  before(async () => {
    bed = await makeTestBed('approval_bound');
    bed.writePolicies(policiesYaml(10));
    await startServices();
  });

  after(async () => {
    await stopServices();
    await assertNoLeakedProcesses();
    await bed?.close();
  });

  const cli = (args: string[]) => runReaperCli(args, bed.processEnv());
  const summary = async (runId: string) => (await runsGetSummary(bed.pool, runId))!;
  const until = (runId: string, what: string, done: (run: RunSummary) => boolean) =>
    eventually(`run ${runId} ${what}`, async () => {
      const run = await summary(runId);
      return done(run) ? run : undefined;
    }, { timeoutMs: 60_000, describe: () => summary(runId) });
  const heldCount = async () => (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM seat_reservations WHERE status = 'held'`)).rows[0]!.n;
  const newRun = async () => (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;

  test('a bulk backdated insert while the run waits: the approved run publishes at most approved + 10 %, then waits for a second decision', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 30, futureHeld: 5 });
    const run = await newRun();
    const braked = await until(run.runId, 'awaiting approval', (r) => r.state === 'awaiting-approval');
    assert.equal(braked.countedCandidates, 30, 'the count the operator sees');
    assert.equal(braked.candidates, 0, 'nothing published');

    // A bulk import backdated under the run's frozen cutoff, after the count, before the approval.
    await bed.pool.query(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
       SELECT gen_random_uuid(), 'held', $1::timestamptz - interval '2 hours' + i * interval '1 millisecond', 'import-' || i FROM generate_series(1, 300) i`,
      [run.cutoff],
    );
    const shown = JSON.parse((await cli(['run', run.runId, '--json'])).stdout) as RunSummary;
    assert.equal(shown.countedCandidates, 30, '`reaper run` shows the count that will be approved');

    const approved = await cli(['approve', run.runId, '--expect', '30']);
    assert.equal(approved.code, 0, approved.stdout);
    const again = await until(run.runId, 'back awaiting approval after publishing what was approved', (r) => r.state === 'awaiting-approval' && r.approvedCandidates !== null);
    assert.equal(again.approvedCandidates, 30, 'the approval recorded its count');
    assert.ok(again.approvedPolicyVersion, 'and the policy version it was counted under');
    assert.ok(again.candidates <= 33, `published ${again.candidates} <= approved 30 + 10 %`);
    assert.ok(again.candidates > 0, 'what fits in the approval is published');
    assert.equal(again.countedCandidates, 330, 'the new count: published + still to publish');
    assert.match(again.error ?? '', /330 candidates > approved 30 \+ 10% \(limits\.approvalTolerance\)/);
    const settled = await until(run.runId, 'receipts for what was published', (r) => r.batchesDone === r.batchesConfirmed);
    assert.ok(settled.deleted <= 33, `deleted ${settled.deleted} <= approved 30 + 10 %`);
    assert.equal(await heldCount(), 335 - settled.deleted, 'nothing else deleted');

    // Every view shows both counts.
    const plan = JSON.parse((await cli(['plan', 'seat-holds', '--json'])).stdout) as { decision: { runId: string; approved: number; counted: number } | null };
    assert.deepEqual([plan.decision?.runId, plan.decision?.approved, plan.decision?.counted], [run.runId, 30, 330], '`reaper plan` shows approved and current counts');
    const status = JSON.parse((await cli(['status', '--json'])).stdout) as { policies: Array<{ lastRunCounted: number | null; lastRunApproved: number | null }> };
    assert.deepEqual([status.policies[0]!.lastRunApproved, status.policies[0]!.lastRunCounted], [30, 330], '`reaper status` shows both');
    assert.equal((await cli(['approve', run.runId, '--expect', '30'])).code, 1, 'an approval of the old count does not cover the new one');

    assert.equal((await cli(['approve', run.runId, '--expect', '330'])).code, 0, 'the second decision');
    const done = await until(run.runId, 'completed', (r) => r.state === 'completed');
    assert.equal(done.approvedCandidates, 330);
    assert.equal(done.deleted, 330, 'every row of both approvals deleted once');
    assert.equal(await heldCount(), 5, 'only the holds that had not expired are left');
  });

  test('a policy version deployed before the approval sends the run back to awaiting approval', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 15 });
    const run = await newRun();
    const braked = await until(run.runId, 'awaiting approval', (r) => r.state === 'awaiting-approval');
    const counted = braked.policyVersion;
    await stopServices();
    bed.writePolicies(policiesYaml(12)); // a new rule: another policy version
    await startServices();
    assert.equal((await cli(['approve', run.runId])).code, 0);
    const again = await until(run.runId, 'back awaiting approval under the new version', (r) => r.state === 'awaiting-approval' && r.approvedCandidates !== null);
    assert.match(again.error ?? '', /policy version changed since the approval/);
    assert.equal(again.approvedPolicyVersion, counted, 'the approval was for the old version');
    assert.notEqual(again.policyVersion, counted, 'the new count was made under the new version');
    assert.equal(again.candidates, 0, 'nothing published under a version nobody approved');
    assert.equal(await heldCount(), 15);

    assert.equal((await cli(['approve', run.runId])).code, 0);
    const done = await until(run.runId, 'completed', (r) => r.state === 'completed');
    assert.equal(done.approvedPolicyVersion, done.policyVersion);
    assert.equal(done.deleted, 15);
  });
});
