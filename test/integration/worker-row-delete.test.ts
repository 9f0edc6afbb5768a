import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { MAX_MESSAGE_BYTES, type BatchV1 } from '../../shared/contracts/batch';
import { type WorkerHandle } from '../../services/worker/worker';
import { type TestBroker } from '../support/broker';
import { batchReceipt, closeWorkerWorld, counterTotal, makeRowBatch, openWorkerWorld, publishBatch } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { countReservations, seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';

/**
 * The row-delete worker against real PostgreSQL and RabbitMQ: a batch is re-checked against the
 * current rows, duplicates are counted no-ops, and bad messages land in the dead-letter queue.
 */
describe('row-delete worker', () => {
  let bed: TestBed;
  let worker: WorkerHandle;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => ({ bed, broker, names, worker } = await openWorkerWorld('worker_row_delete')));
  after(() => closeWorkerWorld({ bed, broker, worker }));


  test('deletes expired held rows whose expiry has microseconds, and writes one receipt', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 50 });
    const micros = await bed.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM seat_reservations WHERE reservation_id = ANY($1::uuid[]) AND extract(microseconds FROM expires_at)::int % 1000 <> 0`,
      [seeded.expiredHeld],
    );
    assert.ok(micros.rows[0]!.n > 40, 'the seed must carry sub-millisecond expiries for this test to mean anything');
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    await publishBatch(broker, names, batch);
    await eventually('the batch receipt', () => batchReceipt(bed.pool, batch.batchId));
    assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 50, noop: 0 });
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
  });

  test('the same batch delivered twice: the second deletes nothing and is acked as a duplicate no-op', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 10 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    const duplicatesBefore = await counterTotal(worker.metrics.registry, 'reaper_batches_total', { outcome: 'duplicate' });
    await publishBatch(broker, names, batch);
    await publishBatch(broker, names, batch);
    await eventually('the duplicate to be counted', async () => (await counterTotal(worker.metrics.registry, 'reaper_batches_total', { outcome: 'duplicate' })) === duplicatesBefore + 1);
    assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 10, noop: 0 });
    await eventually('the work queue to be empty (both acked)', async () => (await broker.messageCount(names.workQueue('seat-holds'))) === 0);
  });

  test('a hold renewed after the scan and a confirmed hold are kept; the rest of the batch is deleted', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 5, expiredConfirmed: 2 });
    const batch = await makeRowBatch(bed.pool, [...seeded.expiredHeld, ...seeded.expiredConfirmed]);
    const renewed = seeded.expiredHeld[0]!;
    // Renewed after the scan: the expiry moves (by one microsecond is enough to make it a different decision).
    await bed.pool.query(`UPDATE seat_reservations SET expires_at = expires_at + interval '1 microsecond' WHERE reservation_id = $1`, [renewed]);
    await publishBatch(broker, names, batch);
    await eventually('the batch receipt', () => batchReceipt(bed.pool, batch.batchId));
    assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 4, noop: 3 });
    assert.equal(await countReservations(bed.pool, [renewed]), 1);
    assert.equal(await countReservations(bed.pool, seeded.expiredConfirmed), 2);
  });

  test('a row that expires after the cutoff is not deleted even if the message lists it', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 0, futureHeld: 3 });
    const batch = await makeRowBatch(bed.pool, seeded.futureHeld);
    await publishBatch(broker, names, batch);
    await eventually('the batch receipt', () => batchReceipt(bed.pool, batch.batchId));
    assert.deepEqual(await batchReceipt(bed.pool, batch.batchId), { deleted: 0, noop: 3 });
    assert.equal(await countReservations(bed.pool, seeded.futureHeld), 3);
  });

  describe('bad input lands in the dead-letter queue with its reason, and the worker keeps consuming', () => {
    const cases: Array<{ name: string; reason: string; make: (valid: BatchV1) => Buffer | string }> = [
      { name: 'unsupported version', reason: 'unsupported-version', make: (valid) => JSON.stringify({ ...valid, version: 3 }) },
      { name: 'invalid JSON', reason: 'invalid-json', make: () => '{"version": 1, "items": [' },
      { name: 'unknown field', reason: 'invalid-message', make: (valid) => JSON.stringify({ ...valid, deleteEverything: true }) },
      { name: 'unknown policy', reason: 'unknown-policy', make: (valid) => JSON.stringify({ ...valid, policy: 'no-such-policy' }) },
      {
        name: 'oversized message',
        reason: 'too-large',
        make: (valid) => JSON.stringify({ ...valid, padding: 'x'.repeat(MAX_MESSAGE_BYTES) }),
      },
      { name: 'a key that is not a uuid', reason: 'invalid-message', make: (valid) => JSON.stringify({ ...valid, items: [{ id: 'not-a-uuid', observedExpiry: valid.items[0]!.observedExpiry }] }) },
    ];
    for (const testCase of cases) {
      test(testCase.name, async () => {
        const seeded = await seedHolds(bed.pool, { expiredHeld: 3 });
        const valid = await makeRowBatch(bed.pool, seeded.expiredHeld);
        await broker.publish(names.workExchange, 'seat-holds', testCase.make(valid), { messageId: valid.batchId });
        const dead = await eventually('a dead-lettered message', async () => {
          const messages = await broker.drain(names.deadLetterQueue);
          return messages.length > 0 ? messages : undefined;
        });
        assert.equal(dead.length, 1);
        assert.equal(dead[0]!.properties.headers?.['x-reaper-reason'], testCase.reason);
        assert.ok(String(dead[0]!.properties.headers?.['x-reaper-detail']).length > 0, 'a human-readable detail');
        assert.equal(dead[0]!.properties.messageId, valid.batchId, 'the original message is kept');
        assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 3, 'nothing deleted');
        // The worker is still alive and consuming: the valid batch goes through.
        await publishBatch(broker, names, valid);
        await eventually('the valid batch after the bad one', () => batchReceipt(bed.pool, valid.batchId));
        assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
      });
    }
  });
});
