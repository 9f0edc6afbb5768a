import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, test } from 'node:test';
import pg from 'pg';
import { loadPolicies, retiresPartitions } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/target';
import { readBacklog } from '../../services/scheduler/backlog-gauges';
import { retirePartitions } from '../../services/scheduler/partition-retirement';
import { eventually } from '../support/eventually';
import { testLog } from '../support/fixtures';
import { databaseNowIso } from '../support/seed';
import { partitionedPolicyYaml, partitionedSuite } from '../support/partitioned';

/**
 * Issue 44: the scheduler's backlog gauge reads the policy's table; a read in flight holds every
 * DETACH ... CONCURRENTLY up until it ends (the bench saw 2.2 s). The gauge reads a retiring
 * policy's table under the shared side of the policy's partition lock: while a scheduler retires
 * (or waits to), the gauge leaves the table alone; a retirement waits for the reads in flight
 * (not another scheduler's retirement) instead of leaving its partitions to the next run.
 */
describe('partitions: the backlog gauge does not hold up a retirement', () => {
  const world = partitionedSuite('partitions_gauge', (bed) => void bed.writePolicies(partitionedPolicyYaml()));
  const LOCK = `hashtext('reaper-partitions'), hashtext('day-events')`;

  const setup = async () => {
    const policy = loadPolicies(world.bed.env().policiesPath).get('day-events')!;
    assert.ok(retiresPartitions(policy));
    const target = await targetResolve(world.bed.pool, policy);
    return { policy, targets: new Map([[policy.name, target]]) };
  };

  test('while a scheduler retires the policy, a gauge pass leaves its table alone (no lock on it is waited for)', async () => {
    const { policy, targets } = await setup();
    const retiring = await world.bed.pool.connect();
    const ddl = await world.bed.pool.connect();
    try {
      await retiring.query(`SELECT pg_advisory_lock(${LOCK})`); // a scheduler retiring day-events
      await ddl.query('BEGIN');
      await ddl.query('LOCK TABLE events_by_day IN ACCESS EXCLUSIVE MODE'); // its DDL: any read of the table would wait
      const read = readBacklog(world.bed.pool, [policy], targets, { yieldToRetirement: true });
      const outcome = await Promise.race([read.then((entries) => entries.map((entry) => entry.policy)), new Promise<'waited'>((resolve) => setTimeout(() => resolve('waited'), 3_000))]);
      assert.deepEqual(outcome, [], 'the gauge pass waited for the retiring table instead of leaving it out');
    } finally {
      await ddl.query('ROLLBACK').catch(() => undefined);
      ddl.release();
      await retiring.query(`SELECT pg_advisory_unlock_all()`).catch(() => undefined);
      retiring.release();
    }
    // Not retiring: the pass reads it.
    assert.deepEqual((await readBacklog(world.bed.pool, [policy], targets, { yieldToRetirement: true })).map((entry) => entry.policy), ['day-events']);
  });

  test('the gauge reads the table with JIT off (compiling its statement took seconds on a loaded machine; it runs in a millisecond)', async () => {
    const { policy, targets } = await setup();
    const client = await world.bed.pool.connect();
    const jitWhenRead: string[] = [];
    // The same connection, recording the session's jit setting as each backlog statement of the table starts.
    const recording = new Proxy(client, {
      get(target, property, receiver) {
        if (property !== 'query') return Reflect.get(target, property, receiver);
        return async (text: unknown, ...rest: unknown[]) => {
          if (typeof text === 'string' && text.includes('AS oldest_age')) jitWhenRead.push((await target.query<{ jit: string }>('SHOW jit')).rows[0]!.jit);
          return (target.query as (...args: unknown[]) => unknown).call(target, text, ...rest);
        };
      },
    });
    try {
      assert.deepEqual((await readBacklog(recording, [policy], targets, { yieldToRetirement: true })).map((entry) => entry.policy), ['day-events']);
      assert.deepEqual((await readBacklog(recording, [policy], targets)).map((entry) => entry.policy), ['day-events']);
    } finally {
      client.release();
    }
    assert.deepEqual(jitWhenRead, ['off', 'off']);
    assert.equal((await world.bed.pool.query<{ jit: string }>('SHOW jit')).rows[0]!.jit, 'on', 'the server default is on (else this test proves nothing)');
  });

  test('a retirement waits for a gauge read in flight (no new one starts meanwhile), then retires', async () => {
    const { policy, targets } = await setup();
    const gauge = await world.bed.pool.connect();
    const scheduler = new pg.Pool({ connectionString: world.bed.as(world.bed.env(), 'scheduler').databaseUrl, max: 2 });
    try {
      await gauge.query('BEGIN');
      await gauge.query(`SELECT pg_advisory_xact_lock_shared(${LOCK})`); // a gauge pass reading the table
      await gauge.query('SELECT count(*) FROM events_by_day');
      const target = await targetResolve(scheduler, policy);
      const retirement = retirePartitions({ pool: scheduler, log: testLog, stillClaimed: () => true }, { runId: randomUUID(), cutoff: await databaseNowIso(world.bed.pool) }, policy, target, {
        room: Number.POSITIVE_INFINITY,
        policyVersion: 'test',
      });
      await eventually('the retirement waits for the gauge read', async () => {
        const waiting = await world.bed.pool.query(`SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND NOT granted`);
        return (waiting.rowCount ?? 0) > 0 || undefined;
      });
      assert.deepEqual((await readBacklog(world.bed.pool, [policy], targets, { yieldToRetirement: true })).map((entry) => entry.policy), [], 'no gauge read starts while it waits');
      await gauge.query('COMMIT');
      const result = await retirement;
      assert.equal(result.retiredRows, 18, 'p_old_a, p_old_b and p_held (no hold in this file) retired');
    } finally {
      await gauge.query('ROLLBACK').catch(() => undefined);
      gauge.release();
      await scheduler.end();
    }
  });
});
