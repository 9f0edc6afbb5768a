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
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The blast-radius brake (issue 9): a run whose scan would exceed limits.maxPerRun (or
 * maxFractionPerRun) publishes nothing and waits in 'awaiting-approval'; `reaper approve` lets it
 * delete with its ORIGINAL cutoff, `reaper reject` ends it with nothing deleted.
 */
describe('guardrails: the blast-radius brake', () => {
  let bed: TestBed;
  let scheduler: SchedulerHandle;
  let worker: WorkerHandle;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

  before(async () => {
    bed = await makeTestBed('guardrails_brake');
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 10, limits: { maxPerRun: 10, maxFractionPerRun: 0.9 } }));
    const env = bed.env();
    const policies = loadPolicies(env.policiesPath);
    scheduler = await startScheduler(bed.as(env, 'scheduler'), policies, log);
    worker = await startWorker(bed.as(env, 'worker'), policies, log);
  });

  after(async () => {
    await scheduler?.stop();
    await worker?.stop();
    await assertNoLeakedProcesses();
    await bed?.close();
  });

  const cli = (args: string[]) => runReaperCli(args, bed.processEnv());
  const summary = async (runId: string) => (await runsGetSummary(bed.pool, runId))!;
  const untilState = (runId: string, state: RunSummary['state']) =>
    eventually(`run ${runId} ${state}`, async () => {
      const run = await summary(runId);
      return run.state === state ? run : undefined;
    });

  test('an over-limit run deletes nothing until approved, then deletes with its original cutoff', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 20, futureHeld: 2 });
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const braked = await untilState(run.runId, 'awaiting-approval');
    assert.equal(braked.countedCandidates, 20, "the count the operator approves");
    assert.equal(braked.candidates, 0, "nothing published");
    assert.match(braked.error ?? '', /20 candidates > limits\.maxPerRun 10/);
    assert.equal(braked.batchesConfirmed, 0, 'nothing published');
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 20, 'nothing deleted');
    const listed = JSON.parse((await cli(['runs', '--json'])).stdout) as Array<{ runId: string; state: string }>;
    assert.equal(listed.find((entry) => entry.runId === run.runId)?.state, 'awaiting-approval');

    // Expires after the run's cutoff, before the approval: the approved run must leave it alone.
    const later = await bed.pool.query<{ id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at) VALUES (gen_random_uuid(), 'held', clock_timestamp() + interval '200 milliseconds')
       RETURNING reservation_id::text AS id`,
    );
    await eventually('the later row expired', async () => (await bed.pool.query(`SELECT 1 FROM seat_reservations WHERE expires_at < now() AND reservation_id = $1`, [later.rows[0]!.id])).rowCount === 1);

    const approved = await cli(['approve', run.runId]);
    assert.equal(approved.code, 0, approved.stdout);
    const done = await untilState(run.runId, 'completed');
    assert.equal(done.cutoff, run.cutoff, 'the original cutoff');
    assert.equal(done.deleted, 20);
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
    assert.equal(await countReservations(bed.pool, [later.rows[0]!.id]), 1, 'a row expiring after the cutoff survives the approved run');
    assert.equal(await countReservations(bed.pool, seeded.futureHeld), 2);
    assert.equal((await cli(['approve', run.runId])).code, 1, 'a completed run is not awaiting approval');
  });

  test('a rejected run deletes nothing', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 15 });
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    await untilState(run.runId, 'awaiting-approval');
    const rejected = await cli(['reject', run.runId, '--json']);
    assert.equal(rejected.code, 0, rejected.stdout);
    const ended = await summary(run.runId);
    assert.equal(ended.state, 'rejected');
    assert.ok(ended.decidedBy, 'who rejected it is recorded');
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 15, 'nothing deleted');
    const receipts = await bed.pool.query('SELECT 1 FROM cleanup_batches WHERE run_id = $1', [run.runId]);
    assert.equal(receipts.rowCount, 0);
  });

  test('a run within the limits is not braked', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 5, futureHeld: 5 });
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const done = await untilState(run.runId, 'completed');
    assert.equal(done.deleted, 5);
    assert.ok(done.policyVersion, 'the run records the policy version it ran under');
  });
});
