import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { bedAndBrokerSuite, readyAtRest, rowDeletePolicyYaml, runRow, startServices, stopAllCleanly, triggerRunId } from '../support/fixtures';
import { seedHolds } from '../support/seed';

/**
 * No step may outlast the run lease unseen (issue 17 item 4, docs/design.md invariant 17). Two
 * schedulers with REAPER_RUN_LEASE_MS=500 and a brake count made slower than six leases (an ACCESS
 * EXCLUSIVE lock on the policy's table, held by the test, makes the count wait): the claimant keeps
 * its lease on a timer while it counts, so the other replica never takes the run over, and every
 * batch reaches the broker exactly once. Before the fix the lease was extended only while retrying:
 * the second scheduler claimed the run during the count and both published the first window.
 */
const LEASE_MS = 500;
const EXPIRED = 200;
const BATCH_SIZE = 10;
const LOCK_HELD_MS = 3_000;

describe('a count slower than the run lease, two schedulers', () => {
  // A brake that lets the run through: only its count matters here.
  const world = bedAndBrokerSuite('fault_scheduler_slow_count', { policiesYaml: rowDeletePolicyYaml({ batchSize: BATCH_SIZE, limits: { maxPerRun: 100_000 } }) });

  test('the claimant keeps its lease through the count: one claim, every batch published once', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: EXPIRED, futureHeld: 10 });
    const env = { REAPER_RUN_LEASE_MS: String(LEASE_MS) };
    const schedulers = startServices(world.bed, [
      { label: 'slow-count-a', kind: 'scheduler', env },
      { label: 'slow-count-b', kind: 'scheduler', env },
    ]);
    const locker = await world.bed.pool.connect();
    let locked = false;
    try {
      await Promise.all(schedulers.services.map((s) => s.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000)));
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE seat_reservations IN ACCESS EXCLUSIVE MODE');
      locked = true;
      const runId = await triggerRunId(world.bed, 'seat-holds');
      await schedulers.eventuallyAlive('the brake count to wait on the table lock', async () =>
        (
          await world.bed.pool.query(
            `SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%count(*)%seat_reservations%'`,
          )
        ).rowCount! > 0,
        { timeoutMs: 20_000, intervalMs: 20 },
      );
      const countStarted = Date.now();
      // Six leases and more: without a lease kept during the count, the other replica claims.
      while (Date.now() - countStarted < LOCK_HELD_MS) {
        await new Promise((resolve) => setTimeout(resolve, 100));
        assert.equal((await runRow(world.bed.pool, runId)).claim_count, 1, `no takeover while the count runs (${Date.now() - countStarted} ms in)`);
      }
      await locker.query('COMMIT');
      locked = false;

      await schedulers.eventuallyAlive('the run to be published', async () => (await runRow(world.bed.pool, runId)).state === 'published', { timeoutMs: 30_000 });
      const run = await runRow(world.bed.pool, runId);
      assert.equal(run.claim_count, 1, 'one claim from start to end');
      assert.equal(run.batches_confirmed, EXPIRED / BATCH_SIZE);
      // No worker runs: what the schedulers published is all in the queue.
      const messages = await world.broker.drain(brokerNames(world.bed.prefix).workQueue('seat-holds'));
      const batchIds = messages.map((message) => String(message.properties.messageId));
      const items = messages.flatMap((message) => (JSON.parse(message.content.toString('utf8')) as { items: Array<{ id: string }> }).items.map((item) => item.id));
      assert.equal(new Set(batchIds).size, batchIds.length, 'no batch published twice');
      assert.equal(batchIds.length, EXPIRED / BATCH_SIZE, `every batch published exactly once (got ${batchIds.length})`);
      assert.deepEqual([...items].sort(), [...seeded.expiredHeld].sort(), 'every expired row published exactly once, nothing else');
      await stopAllCleanly(schedulers.services);
      assert.equal(await readyAtRest(world.broker, brokerNames(world.bed.prefix).workQueue('seat-holds')), 0);
    } finally {
      if (locked) await locker.query('ROLLBACK').catch(() => undefined); // the test failed while holding it
      locker.release();
      await schedulers.stopLeftovers();
    }
  });
});
