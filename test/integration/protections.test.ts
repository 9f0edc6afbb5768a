import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { loadPolicies, type RemoteDeletePolicy, type RowDeletePolicy } from '../../shared/config/policies';
import type { BatchV1 } from '../../shared/contracts/batch';
import { admissionSetPaused } from '../../shared/db/queries/admission';
import { expiringRowsDeleteGroupIfStillExpired } from '../../shared/db/queries/expiring-rows';
import { targetResolve } from '../../shared/db/queries/target';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeHttpRemoteClient } from '../../shared/remote/client';
import { startScheduler, type SchedulerHandle } from '../../services/scheduler/scheduler';
import { makeRemoteDeleteHandler } from '../../services/worker/handlers/remote-delete';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import {
  combinedPoliciesYaml,
  databaseIsoIn,
  makeRowBatch,
  metricValue,
  publishBatch,
  receiptsOf,
  rowDeletePolicyYaml,
  runRow,
  type Receipt,
} from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { currentKeyOf, ledgerRows, MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Protections that had no test failing without them (issue 22, item 5), against the real
 * PostgreSQL and RabbitMQ:
 *  - the cutoff half of least(cutoff, now): a batch whose cutoff is 30 minutes ago naming a row
 *    that expired 10 minutes ago deletes nothing, in the row-delete worker, in one group statement
 *    mixing two cutoffs, and in the remote-delete record and claim;
 *  - limits.maxFractionPerRun deciding alone (no maxPerRun), and the brake on a remote-delete policy;
 *  - a timed hold (`hold add --until`) that has passed no longer protects its row;
 *  - a statement running past REAPER_STATEMENT_TIMEOUT_MS is cancelled on the server and retried.
 * One in-process scheduler and one in-process seat-holds worker serve every test; remote-delete is
 * driven through its handler (no media worker runs: its ledger sweeper would claim what the
 * remote tests record by hand).
 */
const POLICY = 'seat-holds';
const STATEMENT_TIMEOUT_MS = 2_000;
const FRACTION = 0.5;
const REMOTE_MAX_PER_RUN = 2;
const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

describe('protections that had no test', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let api: MediaApi;
  let scheduler: SchedulerHandle | undefined;
  let worker: WorkerHandle | undefined;
  let rowPolicy: RowDeletePolicy;
  let mediaPolicy: RemoteDeletePolicy;
  const names = () => brokerNames(bed.prefix);

  before(async () => {
    bed = await makeTestBed('protections');
    api = await startMediaApi();
    bed.writePolicies(
      combinedPoliciesYaml(
        rowDeletePolicyYaml({ batchSize: 10, limits: { maxFractionPerRun: FRACTION } }),
        `${mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 200, burst: 50, concurrency: 8 })}    limits: { maxPerRun: ${REMOTE_MAX_PER_RUN} }\n`,
      ),
    );
    broker = await openTestBroker(bed.amqpUrl);
    const env = bed.env();
    const policies = loadPolicies(env.policiesPath);
    rowPolicy = policies.get(POLICY) as RowDeletePolicy;
    mediaPolicy = policies.get(MEDIA_POLICY) as RemoteDeletePolicy;
    scheduler = await startScheduler(bed.as(env, 'scheduler'), policies, log);
    // Only the worker has the short statement timeout (the statement-timeout test is about it).
    worker = await startWorker(bed.as(bed.env({ REAPER_STATEMENT_TIMEOUT_MS: String(STATEMENT_TIMEOUT_MS) }), 'worker'), new Map([[POLICY, rowPolicy]]), log);
  });

  after(async () => {
    try {
      await worker?.stop();
      await scheduler?.stop();
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await api?.close();
      await bed?.close();
    }
  });

  /** Held seat reservations that expired `ago` (an interval, e.g. '10 minutes') before the database clock, with microseconds. */
  async function heldExpired(ago: string, count = 1, seat = 'seat'): Promise<string[]> {
    const result = await bed.pool.query<{ id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
       SELECT gen_random_uuid(), 'held', clock_timestamp() - $1::interval + random() * interval '1 millisecond', $2 FROM generate_series(1, $3)
       RETURNING reservation_id::text AS id`,
      [ago, seat, count],
    );
    return result.rows.map((row) => row.id);
  }

  const receiptOf = (batchId: string) =>
    eventually(`the receipt of ${batchId}`, async () => (await receiptsOf(bed.pool, batchId))[0], { timeoutMs: 30_000 });
  const manualRun = async (policy: string) => (await runsInsertIfAbsent(bed.pool, { policy, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
  /** The run once the brake decided: parked for approval, or published (and maybe completed) past it. */
  const runPastScan = (runId: string) =>
    eventually(`run ${runId} past the brake`, async () => {
      const run = await runRow(bed.pool, runId);
      return ['awaiting-approval', 'published', 'completed'].includes(run.state) ? run : undefined;
    });
  const pick = (receipt: Receipt) => ({ deleted: receipt.deleted, noop: receipt.noop });

  test('row-delete worker: a batch with a cutoff 30 minutes ago deletes nothing that expired 10 minutes ago', async () => {
    const [row] = await heldExpired('10 minutes');
    const old = await makeRowBatch(bed.pool, [row!], { cutoff: await databaseIsoIn(bed.pool, '-30 minutes') });
    await publishBatch(broker, names(), old);
    assert.deepEqual(pick(await receiptOf(old.batchId)), { deleted: 0, noop: 1 }, 'expired after the cutoff: a no-op');
    assert.equal(await countReservations(bed.pool, [row!]), 1, 'the row is still there');

    // The same row under a cutoff of now (the control: nothing else kept it).
    const current = await makeRowBatch(bed.pool, [row!]);
    await publishBatch(broker, names(), current);
    assert.deepEqual(pick(await receiptOf(current.batchId)), { deleted: 1, noop: 0 });
    assert.equal(await countReservations(bed.pool, [row!]), 0);
  });

  test('one group statement mixing two cutoffs: each batch is held to its own cutoff', async () => {
    const target = await targetResolve(bed.pool, rowPolicy);
    // Both orders: the batch with the old cutoff first and last in the group.
    for (const oldFirst of [true, false]) {
      const [mine, theirs] = await heldExpired('10 minutes', 2);
      const current = await makeRowBatch(bed.pool, [mine!]);
      const old = await makeRowBatch(bed.pool, [theirs!], { cutoff: await databaseIsoIn(bed.pool, '-30 minutes') });
      const batches = oldFirst ? [old, current] : [current, old];
      const outcome = await expiringRowsDeleteGroupIfStillExpired(bed.pool, target, { policy: POLICY, batches, workerId: 'protections-test' });
      const deletedBy = Object.fromEntries(outcome.batches.map((batch) => [batch.batchId === old.batchId ? 'old cutoff' : 'current cutoff', batch.deleted]));
      assert.deepEqual(deletedBy, { 'old cutoff': 0, 'current cutoff': 1 }, `old cutoff ${oldFirst ? 'first' : 'last'} in the group`);
      assert.equal(await countReservations(bed.pool, [theirs!]), 1, 'expired after the old cutoff: kept');
      assert.equal(await countReservations(bed.pool, [mine!]), 0, 'the batch with the current cutoff deleted its row');
    }
  });

  test('remote-delete: a cutoff 30 minutes ago neither records nor claims an asset that expired 10 minutes ago', async () => {
    const [recorded, unrecorded, control] = await seedAssets(bed.pool, 'cutoff', 3);
    await bed.pool.query(
      `UPDATE media_assets SET retention_expires_at = clock_timestamp() - interval '10 minutes' + random() * interval '1 millisecond' WHERE asset_id = ANY($1)`,
      [[recorded, unrecorded, control]],
    );
    // An operation already in the ledger (recorded under a later cutoff): only the claim's re-check stands between it and a call.
    for (const id of [recorded!, control!]) {
      await bed.pool.query(
        `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source) SELECT $1, $2, asset_id, retention_expires_at, 'scan' FROM media_assets WHERE asset_id = $3`,
        [await currentKeyOf(bed.pool, id), MEDIA_POLICY, id],
      );
    }
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], false, new Map([[MEDIA_POLICY, 50]]));
    const target = await targetResolve(bed.pool, mediaPolicy);
    const handle = makeRemoteDeleteHandler(mediaPolicy, target, makeHttpRemoteClient(mediaPolicy.remote));
    const context = { pool: bed.pool, workerId: 'protections-test', log, metrics: makeMetrics(), deliveryCount: 1, failpoint: () => undefined };
    const batchOf = async (ids: readonly string[], cutoff: string, sequence: number): Promise<BatchV1> => ({
      version: 1,
      runId: '00000000-0000-4000-8000-00000000000' + String(sequence),
      batchId: `protections:${sequence}`,
      policy: MEDIA_POLICY,
      cutoff,
      items: await Promise.all(ids.map(async (id) => ({ id, observedExpiry: (await currentKeyOf(bed.pool, id)).slice(`${MEDIA_POLICY}:${id}:`.length) }))),
    });

    const result = await handle(await batchOf([recorded!, unrecorded!], await databaseIsoIn(bed.pool, '-30 minutes'), 1), context);
    assert.notEqual(result.kind, 'retry', JSON.stringify(result));
    assert.deepEqual(await ledgerRows(bed.pool, [unrecorded!]), [], 'recording: no operation for an asset that expired after the cutoff');
    const [row] = await ledgerRows(bed.pool, [recorded!]);
    assert.deepEqual([row!.attempt_count, row!.state === 'in_flight'], [0, false], `claim: not claimed (${JSON.stringify(row)})`);
    assert.deepEqual(
      api.calls.filter((call) => call.id === recorded || call.id === unrecorded),
      [],
      'no call for an asset that expired after the batch cutoff',
    );

    // The control: the same kind of operation under a cutoff of now is claimed and called.
    await handle(await batchOf([control!], await databaseIsoIn(bed.pool, '0 seconds'), 2), context);
    assert.equal(api.calls.filter((call) => call.id === control).length, 1, 'under a current cutoff the operation is called');
  });

  test('a timed hold (hold add --until) that has passed no longer protects its row', async () => {
    const [passing, lasting] = await heldExpired('10 minutes', 2);
    const until = await databaseIsoIn(bed.pool, '2 seconds');
    const cli = (args: string[]) => runReaperCli(args, bed.processEnv({ REAPER_OPERATOR: 'protections-test' }));
    const added = await cli(['hold', 'add', POLICY, passing!, '--reason', 'ends soon', '--until', until]);
    assert.equal(added.code, 0, added.stdout);
    const kept = await cli(['hold', 'add', POLICY, lasting!, '--reason', 'ends in an hour', '--until', await databaseIsoIn(bed.pool, '1 hour')]);
    assert.equal(kept.code, 0, kept.stdout);
    await eventually('the first hold to pass (database clock)', async () =>
      (await bed.pool.query<{ passed: boolean }>('SELECT clock_timestamp() > $1::timestamptz AS passed', [until])).rows[0]!.passed,
    );

    const batch = await makeRowBatch(bed.pool, [passing!, lasting!]);
    await publishBatch(broker, names(), batch);
    assert.deepEqual(pick(await receiptOf(batch.batchId)), { deleted: 1, noop: 1 });
    assert.equal(await countReservations(bed.pool, [passing!]), 0, 'the hold that passed protects nothing');
    assert.equal(await countReservations(bed.pool, [lasting!]), 1, 'the hold still running protects its row');
  });

  test('a statement that runs past REAPER_STATEMENT_TIMEOUT_MS is cancelled on the server and retried, not stuck', async () => {
    // A DELETE of the row this test names runs until told to stop (a BEFORE DELETE trigger that
    // polls a flag); every attempt is counted by a sequence, which a rollback does not undo.
    await bed.pool.query(`CREATE SEQUENCE reaper_test_delete_attempts`);
    await bed.pool.query(`CREATE TABLE reaper_test_slow (slow boolean NOT NULL)`);
    await bed.pool.query(`INSERT INTO reaper_test_slow VALUES (true)`);
    await bed.pool.query(`CREATE FUNCTION reaper_test_slow_delete() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN
        PERFORM nextval('reaper_test_delete_attempts');
        WHILE (SELECT slow FROM reaper_test_slow) LOOP PERFORM pg_sleep(0.05); END LOOP;
        RETURN OLD;
      END $$`);
    await bed.pool.query(`CREATE TRIGGER reaper_test_slow_delete BEFORE DELETE ON seat_reservations FOR EACH ROW
      WHEN (OLD.seat = 'slow') EXECUTE FUNCTION reaper_test_slow_delete()`);
    const attempts = async () =>
      (await bed.pool.query<{ n: number }>(`SELECT CASE WHEN is_called THEN last_value ELSE 0 END::int AS n FROM reaper_test_delete_attempts`)).rows[0]!.n;
    const sleepingStatements = async () =>
      (
        await bed.pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' AND wait_event = 'PgSleep'`,
        )
      ).rows[0]!.n;
    try {
      const [row] = await heldExpired('10 minutes', 1, 'slow');
      const batch = await makeRowBatch(bed.pool, [row!]);
      await publishBatch(broker, names(), batch);
      // A second attempt can only start once the first one ended with an error: the timeout.
      await eventually('a second attempt of the DELETE', async () => (await attempts()) >= 2, {
        timeoutMs: 60_000,
        describe: async () => ({ attempts: await attempts(), sleeping: await sleepingStatements() }),
      });
      assert.ok((await sleepingStatements()) <= 1, 'the first attempt was cancelled on the server, not abandoned there by the client');
      assert.deepEqual(await receiptsOf(bed.pool, batch.batchId), [], 'nothing committed while every attempt times out');
      assert.equal(await countReservations(bed.pool, [row!]), 1);
      // Given back to the broker (outcome unknown) or delayed (retry): either way counted, not lost.
      const givenBack = await Promise.all(['unknown', 'retry'].map((outcome) => metricValue(worker!.metrics.registry, 'reaper_batches_total', { policy: POLICY, outcome })));
      assert.ok(givenBack.reduce((sum: number, value) => sum + (value ?? 0), 0) >= 1, `counted as given back for another attempt (${JSON.stringify(givenBack)})`);

      await bed.pool.query(`UPDATE reaper_test_slow SET slow = false`);
      assert.deepEqual(pick(await receiptOf(batch.batchId)), { deleted: 1, noop: 0 }, 'a later attempt deleted the row once');
      assert.equal(await countReservations(bed.pool, [row!]), 0);
    } finally {
      await bed.pool.query(`UPDATE reaper_test_slow SET slow = false`).catch(() => undefined);
      await bed.pool.query(`DROP TRIGGER IF EXISTS reaper_test_slow_delete ON seat_reservations`);
    }
  });

  test('limits.maxFractionPerRun alone (no maxPerRun) stops a run that would delete too large a share', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    // 20 of 25 guarded rows (80 %) are candidates: over the fraction, whatever their number.
    const over = await seedHolds(bed.pool, { expiredHeld: 20, futureHeld: 5 });
    const braked = await manualRun(POLICY);
    const parked = await runPastScan(braked.runId);
    assert.equal(parked.state, 'awaiting-approval', `over maxFractionPerRun ${FRACTION}: ${JSON.stringify(parked)}`);
    assert.match(parked.error ?? '', /maxFractionPerRun/);
    assert.equal(parked.batches_confirmed, 0, 'nothing published');
    assert.equal(await countReservations(bed.pool, over.expiredHeld), 20, 'nothing deleted');
    await runReaperCli(['reject', braked.runId], bed.processEnv());

    // Under the fraction (5 of 25, 20 %) the same policy's run goes through.
    await bed.pool.query('TRUNCATE seat_reservations');
    const under = await seedHolds(bed.pool, { expiredHeld: 5, futureHeld: 20 });
    const done = await runPastScan((await manualRun(POLICY)).runId);
    assert.notEqual(done.state, 'awaiting-approval', JSON.stringify(done));
    await eventually('its rows deleted', async () => (await countReservations(bed.pool, under.expiredHeld)) === 0);
  });

  test('the brake on a remote-delete policy: an over-limit run publishes nothing and records nothing', async () => {
    const ids = await seedAssets(bed.pool, 'braked', REMOTE_MAX_PER_RUN + 3);
    const callsBefore = api.calls.length;
    const parked = await runPastScan((await manualRun(MEDIA_POLICY)).runId);
    assert.equal(parked.state, 'awaiting-approval', `over maxPerRun ${REMOTE_MAX_PER_RUN}: ${JSON.stringify(parked)}`);
    assert.equal(parked.batches_confirmed, 0, 'nothing published');
    assert.equal(await broker.messageCount(names().workQueue(MEDIA_POLICY)), 0, 'no batch in the work queue');
    assert.deepEqual(await ledgerRows(bed.pool, ids), [], 'no operation recorded');
    assert.equal(api.calls.length, callsBefore, 'no call');
  });
});
