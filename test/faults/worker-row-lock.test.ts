import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import pg from 'pg';
import { bedAndBrokerSuite, makeRowBatch, publishBatch, rowDeletePolicyYaml, startServices, stopAllCleanly } from '../support/fixtures';
import { countReservations, seedHolds } from '../support/seed';

/**
 * A row lock is a retry, never a dead letter (issue 17 item 7). An application holds a row lock
 * for longer than the worker's lock_timeout several times over the delivery limit: the worker's
 * DELETE fails with 55P03 on each attempt, and each attempt goes to a delay tier (a new message,
 * its delivery count starts again) instead of being requeued toward REAPER_DELIVERY_LIMIT. Once the
 * application commits, the batch is deleted in full and nothing is dead-lettered.
 */
const DELIVERY_LIMIT = 3;

describe('a row lock held by the application', () => {
  const world = bedAndBrokerSuite('worker_row_lock', { policiesYaml: rowDeletePolicyYaml({ batchSize: 20 }) });

  test('waiting on it for more attempts than the delivery limit delays the batch, never dead-letters it', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 20 });
    const group = startServices(world.bed, [
      { label: 'worker', kind: 'worker', env: { REAPER_LOCK_TIMEOUT_MS: '300', REAPER_DELIVERY_LIMIT: String(DELIVERY_LIMIT) } },
    ]);
    const [worker] = group.services;
    const application = new pg.Client({ connectionString: world.bed.databaseUrl });
    await application.connect();
    let passed = false;
    try {
      await worker!.waitForLine('worker consuming', (line) => line.msg === 'worker consuming');
      // The application's transaction locks one row of the batch and keeps it.
      await application.query('BEGIN');
      await application.query('SELECT 1 FROM seat_reservations WHERE reservation_id = $1 FOR UPDATE', [seeded.expiredHeld[7]]);
      await publishBatch(world.broker, world.names, await makeRowBatch(world.bed.pool, seeded.expiredHeld));

      const lockWaits = () => worker!.lines.filter((line) => line.msg === 'batch delayed' && /55P03/.test(String(line.reason))).length;
      const deadLetters = () => worker!.lines.filter((line) => line.msg === 'message dead-lettered');
      // Twice the delivery limit: far past the point where a counted retry would have ended.
      await group.eventuallyAlive('lock waits past the delivery limit (or a dead letter)', () => lockWaits() >= 2 * DELIVERY_LIMIT || deadLetters().length > 0, {
        timeoutMs: 60_000,
        intervalMs: 50,
      });
      assert.deepEqual(deadLetters(), [], 'a lock wait is never dead-lettered');
      assert.equal(await countReservations(world.bed.pool, seeded.expiredHeld), seeded.expiredHeld.length, 'nothing deleted while the lock is held');

      await application.query('COMMIT');
      await group.eventuallyAlive('the batch to be deleted once the lock is gone', async () => (await countReservations(world.bed.pool, seeded.expiredHeld)) === 0, {
        timeoutMs: 30_000,
        intervalMs: 100,
      });
      assert.equal((await world.broker.drain(world.names.deadLetterQueue)).length, 0, 'nothing in the dead-letter queue');
      assert.equal(worker!.lines.filter((line) => line.msg === 'batch outcome unknown; requeued').length, 0, 'no attempt counted toward the delivery limit');
      await stopAllCleanly(group.services);
      passed = true;
    } finally {
      await application.end().catch(() => undefined); // already ended: nothing held
      if (!passed) await group.stopLeftovers();
    }
  });
});
