import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { loadPolicies } from '../../shared/config/policies';
import { brokerNames } from '../../shared/amqp/topology';
import { targetResolve } from '../../shared/db/queries/target';
import { runsGetSummary, runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startScheduler, type SchedulerHandle } from '../../services/scheduler/scheduler';
import { type WorkerHandle } from '../../services/worker/worker';
import { type TestBroker } from '../support/broker';
import { batchReceipt, closeWorkerWorld, counterTotal, makeRowBatch, openWorkerWorld, publishBatch, rowDeletePolicyYaml } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { runReaperCli, startReaper } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';

/**
 * Issue "Keep the promise", row-delete side: nothing deleted early (item 1), every deletion counted
 * by exactly one receipt (item 17), a non-unique key or a bad markConfirmed refused at start-up
 * (items 4, 5), '-infinity' expiries never hold other rows back (item 6), and a DELETE blocked by an
 * application's row lock gives its message back as a retry (item 15).
 */
describe('keep the promise: row-delete', () => {
  let bed: TestBed;
  let worker: WorkerHandle;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

  // A short lock timeout so the blocked-DELETE test does not wait the default 5 s per delivery.
  const options = { policiesYaml: rowDeletePolicyYaml({ batchSize: 10 }), env: { REAPER_LOCK_TIMEOUT_MS: '300' } };
  before(async () => ({ bed, broker, names, worker } = await openWorkerWorld('promise_rows', options)));
  after(() => closeWorkerWorld({ bed, broker, worker }));

  test('item 1: a batch whose cutoff is a year ahead deletes no row that has not expired', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 3, futureHeld: 5 });
    const yearAhead = (await bed.pool.query<{ at: string }>(`SELECT reaper_iso(now() + interval '1 year') AS at`)).rows[0]!.at;
    const batch = await makeRowBatch(bed.pool, [...seeded.expiredHeld, ...seeded.futureHeld], { cutoff: yearAhead });
    await publishBatch(broker, names, batch);
    await eventually('the receipt', () => batchReceipt(bed.pool, batch.batchId));
    assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 3, noop: 5 });
    assert.equal(await countReservations(bed.pool, seeded.futureHeld), 5, 'live holds survive a forged future cutoff');
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
  });

  test('item 1: `reaper replay` refuses a cutoff later than the database clock (exit 2, names --cutoff)', async () => {
    const yearAhead = (await bed.pool.query<{ at: string }>(`SELECT reaper_iso(now() + interval '1 year') AS at`)).rows[0]!.at;
    const refused = await runReaperCli(['replay', '--policy', 'seat-holds', '--cutoff', yearAhead], bed.processEnv());
    assert.equal(refused.code, 2, refused.stdout);
    assert.match(refused.stdout, /--cutoff: .* is later than the database clock/);
    assert.doesNotMatch(refused.stdout, /\n\s+at /, 'no stack trace');
    const runs = await bed.pool.query('SELECT 1 FROM cleanup_runs WHERE trigger = $1', ['replay']);
    assert.equal(runs.rowCount, 0, 'nothing recorded');
    const past = (await bed.pool.query<{ at: string }>(`SELECT reaper_iso(now() - interval '1 minute') AS at`)).rows[0]!.at;
    const accepted = await runReaperCli(['replay', '--policy', 'seat-holds', '--cutoff', past, '--json'], bed.processEnv());
    assert.equal(accepted.code, 0, accepted.stdout);
    // No scheduler runs in this file yet; the item-6 test starts one, which must not execute this run.
    await bed.pool.query(`DELETE FROM cleanup_runs WHERE trigger = 'replay'`);
  });

  test('item 17: a redelivered batch whose receipt exists deletes nothing, even rows that match again', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 4 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    await publishBatch(broker, names, batch);
    await eventually('the first receipt', () => batchReceipt(bed.pool, batch.batchId));
    // The same rows come back with the same keys and expiries (restored from a backup, say).
    await bed.pool.query(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at) SELECT id::uuid, 'held', e::timestamptz
       FROM unnest($1::text[], $2::text[]) AS x(id, e)`,
      [batch.items.map((item) => item.id), batch.items.map((item) => item.observedExpiry)],
    );
    const duplicatesBefore = await counterTotal(worker.metrics.registry, 'reaper_batches_total', { outcome: 'duplicate' });
    await publishBatch(broker, names, batch);
    await eventually('the redelivery settled as a duplicate', async () => (await counterTotal(worker.metrics.registry, 'reaper_batches_total', { outcome: 'duplicate' })) > duplicatesBefore);
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 4, 'no deletion outside a counted receipt');
    assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 4, noop: 0 });
  });

  test('item 15: a DELETE blocked by an application row lock is retried (not dead-lettered) and completes once the lock goes', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 2 });
    const holder = await bed.pool.connect();
    // A lock wait goes to a delay tier (outcome `retry`), not toward the delivery limit (issue 17 item 7).
    const retriesBefore = await counterTotal(worker.metrics.registry, 'reaper_batches_total', { outcome: 'retry' });
    let released = false;
    try {
      await holder.query('BEGIN');
      await holder.query('SELECT 1 FROM seat_reservations WHERE reservation_id = $1 FOR UPDATE', [seeded.expiredHeld[0]]);
      const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
      await publishBatch(broker, names, batch);
      await eventually('a delivery delayed after the lock timeout', async () => (await counterTotal(worker.metrics.registry, 'reaper_batches_total', { outcome: 'retry' })) > retriesBefore, {
        timeoutMs: 15_000,
      });
      assert.equal(await batchReceipt(bed.pool, batch.batchId), undefined, 'nothing committed while the row is locked');
      await holder.query('COMMIT');
      released = true;
      await eventually('the receipt once the lock is gone', () => batchReceipt(bed.pool, batch.batchId), { timeoutMs: 20_000 });
      assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 2, noop: 0 });
      assert.equal(await broker.messageCount(names.deadLetterQueue), 0, 'a lock timeout is not a dead letter');
    } finally {
      if (!released) await holder.query('ROLLBACK').catch(() => undefined); // already failed: release below anyway
      holder.release();
    }
  });

  test("item 6: rows expiring at '-infinity' never hold the valid rows of their window back", async () => {
    await bed.pool.query('DELETE FROM seat_reservations'); // rows earlier tests left on purpose
    const seeded = await seedHolds(bed.pool, { expiredHeld: 25 });
    const infinite = await bed.pool.query<{ id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at) SELECT gen_random_uuid(), 'held', '-infinity' FROM generate_series(1, 7)
       RETURNING reservation_id::text AS id`,
    );
    const env = bed.env();
    const scheduler: SchedulerHandle = await startScheduler(bed.as(env, 'scheduler'), loadPolicies(env.policiesPath), log);
    try {
      const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
      const done = await eventually('the run completed', async () => {
        const summary = await runsGetSummary(bed.pool, run.runId);
        return summary?.state === 'completed' ? summary : undefined;
      });
      assert.equal(done.deleted, 25);
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
      assert.equal(await countReservations(bed.pool, infinite.rows.map((row) => row.id)), 7, "'-infinity' rows are left out (documented), not deleted");
      assert.equal(await broker.messageCount(names.deadLetterQueue), 0, 'no batch dead-lettered');
    } finally {
      await scheduler.stop();
    }
  });

  test('item 4: a key column that is not unique is refused at start-up, naming table and column', async () => {
    await bed.pool.query(`CREATE TABLE dup_holds (hold_key text NOT NULL, status text, expires_at timestamptz)`);
    await bed.pool.query(`CREATE UNIQUE INDEX dup_holds_partial ON dup_holds (hold_key) WHERE status = 'held'`);
    const spec = { table: 'dup_holds', key: 'hold_key', expiresAt: 'expires_at', guard: { status: 'held' } };
    await assert.rejects(targetResolve(bed.pool, spec), /key column "hold_key" of table "dup_holds" is not unique/);
    const policies = bed.writePolicies(rowDeletePolicyYaml({ name: 'dup-holds', table: 'dup_holds', key: 'hold_key', guard: null }));
    const worker = startReaper('worker dup-holds', ['worker'], bed.processEnv({ REAPER_POLICIES: policies, REAPER_AMQP_PREFIX: `${bed.prefix}-dup` }));
    const exit = await worker.exitWithin(20_000);
    assert.equal(exit.code, 1, worker.output.join('\n'));
    assert.match(worker.output.join('\n'), /dup-holds.*key column "hold_key" of table "dup_holds" is not unique/);
    await bed.pool.query(`CREATE UNIQUE INDEX dup_holds_key ON dup_holds (hold_key)`);
    await targetResolve(bed.pool, spec);
  });

  test('item 5: markConfirmed columns and values are checked at start-up', async () => {
    await bed.pool.query(`CREATE TABLE marked_assets (asset_id text PRIMARY KEY, status text, gone boolean, expires_at timestamptz)`);
    const base = { table: 'marked_assets', key: 'asset_id', expiresAt: 'expires_at', guard: { status: 'active' } };
    await assert.rejects(targetResolve(bed.pool, { ...base, markConfirmed: { stauts: 'deleted' } }), /has no column "stauts"/);
    await assert.rejects(targetResolve(bed.pool, { ...base, markConfirmed: { gone: 'maybe' } }), /markConfirmed\.gone: "maybe" is not a valid boolean/);
    await targetResolve(bed.pool, { ...base, markConfirmed: { gone: true, status: 'deleted' } });
  });
});
