import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import { loadPolicies, type RowDeletePolicy } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/target';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeRowDeleteGroupHandler, ROW_ADMISSION_HOLD_MS, type BatchGroupHandler } from '../../services/worker/handlers/row-delete';
import type { HandlerContext } from '../../services/worker/handlers/types';
import { startWorker } from '../../services/worker/worker';
import { openTestBroker, type TestBroker } from '../support/broker';
import { makeRowBatch, publishBatch, readyAtRest, receiptsOf } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Coalesced deletes (issue 12): the batches a worker has in hand for one policy go to the database
 * as one statement, and every receipt, count and ack rule of one batch at a time still holds.
 */
describe('row-delete: coalesced groups', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  let policy: RowDeletePolicy;
  let group: BatchGroupHandler;

  before(async () => {
    bed = await makeTestBed('row_delete_coalesced');
    broker = await openTestBroker(bed.amqpUrl);
    names = brokerNames(bed.prefix);
    policy = loadPolicies(bed.env().policiesPath).get('seat-holds') as RowDeletePolicy;
    group = makeRowDeleteGroupHandler(policy, await targetResolve(bed.pool, policy));
  });

  after(async () => {
    try {
      await broker?.close();
    } finally {
      await bed?.close();
    }
  });

  const context = (failpoint: HandlerContext['failpoint'] = () => undefined): HandlerContext => ({
    pool: bed.pool,
    workerId: 'in-process',
    log: pino({ level: 'silent' }),
    metrics: makeMetrics(),
    deliveryCount: 1,
    failpoint,
  });

  async function batches(count: number, rowsEach: number): Promise<BatchV1[]> {
    const out: BatchV1[] = [];
    for (let i = 0; i < count; i++) {
      const seeded = await seedHolds(bed.pool, { expiredHeld: rowsEach });
      const runId = randomUUID();
      out.push(await makeRowBatch(bed.pool, seeded.expiredHeld, { runId, batchId: makeBatchId(runId, 1) }));
    }
    return out;
  }

  test('one statement for the group: a receipt per batch with its own counts, renewed rows no-ops, a duplicate in the group a no-op', async () => {
    const [a, b, c] = await batches(3, 10);
    // A row of b renewed after the scan: b's receipt counts it as a no-op, the others are untouched.
    await bed.pool.query(`UPDATE seat_reservations SET expires_at = now() + interval '1 hour' WHERE reservation_id = $1`, [b!.items[0]!.id]);
    const results = await group([a!, b!, a!, c!], context());
    assert.deepEqual(results, [
      { kind: 'done', deleted: 10, noop: 0, duplicate: false },
      { kind: 'done', deleted: 9, noop: 1, duplicate: false },
      { kind: 'done', deleted: 0, noop: 10, duplicate: true },
      { kind: 'done', deleted: 10, noop: 0, duplicate: false },
    ]);
    for (const [batch, deleted] of [[a!, 10], [b!, 9], [c!, 10]] as const) {
      assert.deepEqual(await receiptsOf(bed.pool, batch.batchId), [{ deleted, noop: 10 - deleted, worker_id: 'in-process' }], `one receipt for ${batch.batchId}`);
    }
    // Same transaction: the receipts share their completed_at (now() of the one transaction).
    const stamps = await bed.pool.query<{ n: number }>('SELECT count(DISTINCT completed_at)::int AS n FROM cleanup_batches WHERE batch_id = ANY($1)', [[a!.batchId, b!.batchId, c!.batchId]]);
    assert.equal(stamps.rows[0]!.n, 1, 'the three batches were one statement');
    // Delivered again, as a group: all duplicates, nothing changes.
    const again = await group([c!, a!], context());
    assert.deepEqual(again.map((result) => result.kind === 'done' && result.duplicate), [true, true]);
    assert.deepEqual(await receiptsOf(bed.pool, a!.batchId), [{ deleted: 10, noop: 0, worker_id: 'in-process' }], 'the receipt is not rewritten');
  });

  test('a combined statement that fails is retried batch by batch: the bad batch alone fails, the others commit', async () => {
    const [good1, good2] = await batches(2, 5);
    const poisonRun = randomUUID();
    const poison: BatchV1 = { ...good1!, runId: poisonRun, batchId: makeBatchId(poisonRun, 1), items: [{ id: 'not-a-uuid', observedExpiry: good1!.items[0]!.observedExpiry }] };
    const results = await group([good1!, poison, good2!], context());
    assert.deepEqual(results[0], { kind: 'done', deleted: 5, noop: 0, duplicate: false });
    assert.equal(results[1]!.kind, 'dead-letter', 'the batch the database refuses is dead-lettered on its own');
    assert.deepEqual(results[2], { kind: 'done', deleted: 5, noop: 0, duplicate: false });
    assert.deepEqual(await receiptsOf(bed.pool, poison.batchId), [], 'no receipt for the refused batch');
    assert.equal((await receiptsOf(bed.pool, good1!.batchId)).length, 1);
    assert.equal((await receiptsOf(bed.pool, good2!.batchId)).length, 1);
    const stamps = await bed.pool.query<{ n: number }>('SELECT count(DISTINCT completed_at)::int AS n FROM cleanup_batches WHERE batch_id = ANY($1)', [[good1!.batchId, good2!.batchId]]);
    assert.equal(stamps.rows[0]!.n, 2, 'after the failed group, each batch committed alone');
  });

  test('the before-commit point is on the production path: a crash there loses the whole statement, nothing half-done', async () => {
    const [batch] = await batches(1, 7);
    const ids = batch!.items.map((item) => item.id);
    const reached: string[] = [];
    // Nothing is armed in the process: this context's failpoint stands in for the kill by
    // throwing at 'before-commit' (the process would die at that same instant, on the same code).
    const dieBeforeCommit: HandlerContext['failpoint'] = (name) => {
      reached.push(name);
      if (name === 'before-commit') throw new Error('killed at before-commit');
    };
    const [result] = await group([batch!], context(dieBeforeCommit));
    assert.deepEqual(reached, ['before-commit'], 'the before-commit point is reached on the path production runs');
    assert.equal(result!.kind, 'unknown', 'not acked: the broker would redeliver');
    assert.equal(await countReservations(bed.pool, ids), 7, 'the statement had not committed: every row is still there');
    assert.deepEqual(await receiptsOf(bed.pool, batch!.batchId), [], 'and no receipt');
    // The same batch again, nothing in the way: deleted once.
    assert.deepEqual(await group([batch!], context()), [{ kind: 'done', deleted: 7, noop: 0, duplicate: false }]);
  });

  test('a worker coalesces the deliveries it has in hand, acks each after the commit, and a duplicate delivery in the same group is a counted no-op', async () => {
    const all = await batches(8, 20);
    const env = bed.env({ REAPER_PREFETCH: '16', REAPER_WORKER_ID: 'coalescing-worker' });
    const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });
    // A first start declares the topology; the batches then wait in the queue, to be in hand at once.
    await (await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log)).stop();
    for (const batch of all) await publishBatch(broker, names, batch);
    await publishBatch(broker, names, all[3]!); // a duplicate delivery, in hand with its original
    const worker = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
    try {
      const counter = async (name: string, labels: Record<string, string>): Promise<number> => {
        const metric = await worker.metrics.registry.getSingleMetric(name)!.get();
        return metric.values.filter((v) => Object.entries(labels).every(([k, l]) => v.labels[k] === l)).reduce((sum, v) => sum + v.value, 0);
      };
      await eventually('nine deliveries settled', async () => (await counter('reaper_batches_total', { policy: 'seat-holds' })) === 9);
      assert.equal(await counter('reaper_batches_total', { policy: 'seat-holds', outcome: 'done' }), 8);
      assert.equal(await counter('reaper_batches_total', { policy: 'seat-holds', outcome: 'duplicate' }), 1, 'the duplicate delivery is counted as such');
      assert.equal(await counter('reaper_items_total', { policy: 'seat-holds', outcome: 'deleted' }), 160);
      for (const batch of all) assert.deepEqual(await receiptsOf(bed.pool, batch.batchId), [{ deleted: 20, noop: 0, worker_id: 'coalescing-worker' }]);
      assert.equal(await countReservations(bed.pool, all.flatMap((batch) => batch.items.map((item) => item.id))), 0);
      const stamps = await bed.pool.query<{ n: number }>('SELECT count(DISTINCT completed_at)::int AS n FROM cleanup_batches WHERE batch_id = ANY($1)', [all.map((batch) => batch.batchId)]);
      assert.ok(stamps.rows[0]!.n < all.length, `batches in hand were coalesced (${stamps.rows[0]!.n} transactions for ${all.length} batches)`);
    } finally {
      await worker.stop();
    }
    assert.equal(await readyAtRest(broker, names.workQueue('seat-holds')), 0, 'every delivery was acked: nothing came back');
    assert.equal((await broker.drain(names.deadLetterQueue)).length, 0);
  });

  test('a group whose admission waited past the schedule window\'s end deletes nothing, and waits for the opening (issue 40)', async () => {
    // 4 rows/s, a bucket of 10: the first group takes the bucket, the second waits about 2.5 s for
    // its tokens; the window ends 1-2 s after the first group. Admitted after the end, it must not delete.
    const hhmmss = (at: Date) => at.toISOString().slice(11, 19);
    const now = (await bed.pool.query<{ now: Date }>('SELECT clock_timestamp() AS now')).rows[0]!.now;
    const closesAt = new Date(Math.ceil((now.getTime() + 1_000) / 1000) * 1000);
    const windowed: RowDeletePolicy = {
      ...policy,
      name: 'seat-holds',
      admission: { adaptive: false, rowsPerSecond: 4, burst: 10 },
      window: { start: hhmmss(new Date(now.getTime() - 3_600_000)), end: hhmmss(closesAt), timeZone: 'UTC' },
    };
    const windowedGroup = makeRowDeleteGroupHandler(windowed, await targetResolve(bed.pool, windowed));
    await bed.pool.query(
      `INSERT INTO cleanup_admission (policy, tokens, refilled_at) VALUES ($1, 10, clock_timestamp())
       ON CONFLICT (policy) DO UPDATE SET tokens = 10, refilled_at = clock_timestamp()`,
      [policy.name],
    );
    const [first, second] = await batches(2, 10);
    assert.deepEqual(await windowedGroup([first!], context()), [{ kind: 'done', deleted: 10, noop: 0, duplicate: false }]);
    const [late] = await windowedGroup([second!], context());
    assert.ok(Date.now() > closesAt.getTime(), 'admitted (or refused) only after the window ended');
    assert.equal(late!.kind, 'retry', `the late group goes to a delay tier: ${JSON.stringify(late)}`);
    assert.match((late as { reason: string }).reason, /window/, 'for the window');
    assert.equal(await countReservations(bed.pool, second!.items.map((item) => item.id)), 10, 'nothing deleted past the window\'s end');
  });

  // Last in the file: it leaves the policy's bucket empty at 1 row/s.
  test('a refused chunk sends the rest of its group back with it, unasked', async () => {
    // One batch per chunk (the burst), a bucket that holds one chunk and refills in 10 s.
    const throttled: RowDeletePolicy = { ...policy, admission: { adaptive: false, rowsPerSecond: 1, burst: 10 } };
    const throttledGroup = makeRowDeleteGroupHandler(throttled, await targetResolve(bed.pool, throttled));
    const four = await batches(4, 10);
    // A full bucket (the tests before used the policy's row adaptively).
    await bed.pool.query(
      `INSERT INTO cleanup_admission (policy, tokens, refilled_at) VALUES ($1, 10, clock_timestamp())
       ON CONFLICT (policy) DO UPDATE SET tokens = 10, refilled_at = clock_timestamp()`,
      [policy.name],
    );
    await bed.pool.query(`
      CREATE TABLE test_admission_asks (at timestamptz NOT NULL DEFAULT clock_timestamp());
      CREATE FUNCTION test_admission_ask() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
        BEGIN INSERT INTO test_admission_asks DEFAULT VALUES; RETURN NEW; END $$;
      CREATE TRIGGER test_admission_ask AFTER UPDATE ON cleanup_admission FOR EACH ROW EXECUTE FUNCTION test_admission_ask();`);
    // Its hold nearly spent: the first chunk finds the bucket full, the second is refused at once.
    const results = await throttledGroup(four, { ...context(), heldSince: performance.now() - ROW_ADMISSION_HOLD_MS + 300 });
    assert.deepEqual(results[0], { kind: 'done', deleted: 10, noop: 0, duplicate: false });
    for (const result of results.slice(1)) assert.deepEqual({ kind: result.kind, reason: (result as { reason?: string }).reason }, { kind: 'retry', reason: 'throttled' });
    const asks = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM test_admission_asks')).rows[0]!.n;
    // The first chunk's ask and the second's: the third and fourth would have asked once each.
    assert.equal(asks, 2, 'asks of a group of four chunks, refused at the second');
    for (const batch of four.slice(1)) assert.equal(await countReservations(bed.pool, batch.items.map((item) => item.id)), 10, 'refused batches keep their rows');
  });
});
