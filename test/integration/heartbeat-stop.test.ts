import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { makePool, type Pool } from '../../shared/db/pool';
import { HEARTBEAT_INTERVAL_MS, startHeartbeat } from '../../shared/observability/heartbeat';
import { eventually } from '../support/eventually';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * A stopped worker's heartbeat row is gone once stop() returns, even when a beat was on its way:
 * the beat is an upsert, and landing after the delete it would bring the row back, so the stopped
 * worker would look connected for WORKER_FRESH_SECONDS (the scheduler's batch-version gate then
 * holds version 2 back for an old worker that has stopped;
 * test/faults/rolling-upgrade once waited ten windows for two stopped workers, which this can explain).
 *
 * The interleaving is made, not waited for: a trigger the test adds holds the beat's insert on an
 * advisory lock the test holds (after the beat started, before it touched the worker's row), while
 * stop()'s delete of that row is free to run.
 */
describe('heartbeat: stop while a beat is in flight', () => {
  let bed: TestBed;
  let heartbeatPool: Pool;
  const APPLICATION = 'reaper-heartbeat-test';

  before(async () => {
    bed = await makeTestBed('heartbeat_stop');
    heartbeatPool = makePool(bed.databaseUrl, 2, APPLICATION);
  });

  after(async () => {
    await heartbeatPool?.end();
    await bed?.close();
  });

  test('the row stays deleted: stop() waits for the beat on its way before deleting', { timeout: 4 * HEARTBEAT_INTERVAL_MS + 30_000 }, async () => {
    const heartbeat = await startHeartbeat(heartbeatPool, { service: 'worker', workerId: 'stopping-worker', amqpPrefix: 'heartbeat-test', policies: ['p'], maxBatchVersion: 2 }, pino({ level: 'silent' }));
    const rowCount = async () =>
      (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM service_heartbeats WHERE instance_id = $1', [heartbeat.instanceId])).rows[0]!.n;
    assert.equal(await rowCount(), 1, 'the first beat wrote the row');

    await bed.pool.query(`CREATE FUNCTION reaper_test_hold_beat() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$`);
    await bed.pool.query('CREATE TRIGGER reaper_test_hold_beat BEFORE INSERT ON service_heartbeats FOR EACH ROW EXECUTE FUNCTION reaper_test_hold_beat()');
    const locker = await bed.pool.connect();
    let locked = false;
    try {
      await locker.query('SELECT pg_advisory_lock(4242)');
      locked = true;
      const beatWaiting = async () =>
        (
          await bed.pool.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE '%service_heartbeats%'`,
            [APPLICATION],
          )
        ).rows[0]!.n > 0;
      await eventually('the next beat to wait in the trigger', beatWaiting, { timeoutMs: 2 * HEARTBEAT_INTERVAL_MS + 5_000, intervalMs: 50 });

      const stopped = heartbeat.stop();
      // stop() must not finish while the beat is still on its way (before the fix it deleted the row at once).
      const early = await Promise.race([stopped.then(() => 'stopped'), new Promise((resolve) => setTimeout(() => resolve('waiting'), 500))]);
      await locker.query('SELECT pg_advisory_unlock(4242)');
      locked = false;
      await stopped;
      // The beat has landed (or stop() would not have returned with the fix; without it, wait for it here).
      await eventually('the beat to finish', async () => !(await beatWaiting()), { timeoutMs: 10_000, intervalMs: 20 });
      await eventually('no statement of the heartbeat pool running', async () =>
        (
          await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'`, [APPLICATION])
        ).rows[0]!.n === 0,
      { timeoutMs: 10_000, intervalMs: 20 });
      assert.equal(await rowCount(), 0, `the stopped worker's row is gone (stop() ${early === 'stopped' ? 'returned before' : 'waited for'} the beat)`);
      assert.equal(early, 'waiting', 'stop() waited for the beat that was on its way');
    } finally {
      if (locked) await locker.query('SELECT pg_advisory_unlock(4242)').catch(() => undefined); // the connection is gone: nothing to unlock
      locker.release();
      await bed.pool.query('DROP TRIGGER IF EXISTS reaper_test_hold_beat ON service_heartbeats');
    }
  });
});
