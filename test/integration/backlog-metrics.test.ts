import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { loadPolicies } from '../../shared/config/policies';
import { runsInsertManualUnlessOneWaits } from '../../shared/db/queries/runs';
import { UNKNOWN_POLICY } from '../../shared/observability/metrics';
import { startScheduler, type SchedulerHandle } from '../../services/scheduler/scheduler';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { makeRowBatch, metricValue, publishBatch, readAgeGaugeExactly, rowDeletePolicyYaml } from '../support/fixtures';
import { runReaperCli } from '../support/processes';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 8, the backlog gauges and the worker's counters, against real PostgreSQL and RabbitMQ:
 *  - with no worker, reaper_oldest_eligible_age_seconds is the age of the oldest expired hold when
 *    a pass read it (database clock) and rises; once a worker drains the holds the first pass that
 *    began after the drain reads 0 (counted in passes: nothing here measures against the wall clock);
 *  - after a known sequence (a batch deleting 3 with 2 no-ops, one invalid message) the counters
 *    say exactly that, and the deletion-lag histogram counted one observation per deleted row.
 */
const REFRESH_MS = 400;
const POLICY = 'seat-holds';
const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

describe('backlog gauges and outcome counters', () => {
  let bed: TestBed;
  let broker: TestBroker;
  const running: Array<{ stop(): Promise<void> }> = [];

  before(async () => {
    bed = await makeTestBed('backlog_metrics');
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 100 })); // runs are made by the test
    broker = await openTestBroker(bed.amqpUrl);
  });

  after(async () => {
    for (const service of running.splice(0).reverse()) await service.stop();
    await broker?.close();
    await bed?.close();
  });

  const env = () => bed.env({ REAPER_BACKLOG_REFRESH_MS: String(REFRESH_MS) });
  async function scheduler(): Promise<SchedulerHandle> {
    const handle = await startScheduler(bed.as(env(), 'scheduler'), loadPolicies(env().policiesPath), log);
    running.push(handle);
    return handle;
  }
  async function worker(): Promise<WorkerHandle> {
    const handle = await startWorker(bed.as(env(), 'worker'), loadPolicies(env().policiesPath), log);
    running.push(handle);
    return handle;
  }
  async function stop(handle: { stop(): Promise<void> }): Promise<void> {
    running.splice(running.indexOf(handle), 1);
    await handle.stop();
  }

  /** The true age of the oldest expired held row, by the database clock. */
  async function trueOldestAge(): Promise<number> {
    const result = await bed.pool.query<{ age: number | null }>(
      `SELECT extract(epoch FROM clock_timestamp() - min(expires_at))::float8 AS age FROM seat_reservations WHERE status = 'held' AND expires_at <= clock_timestamp()`,
    );
    return result.rows[0]!.age ?? 0;
  }

  test('oldest eligible age: exact by the database clock and rising with no worker; 0 from the first pass after a worker drains it', async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    // 20 expired holds, the oldest expired 90 s ago, plus holds that are not eligible (future, confirmed).
    await bed.pool.query(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at)
       SELECT gen_random_uuid(), 'held', clock_timestamp() - interval '90 seconds' + i * interval '1 second' FROM generate_series(0, 19) i`,
    );
    await seedHolds(bed.pool, { expiredHeld: 0, futureHeld: 5, expiredConfirmed: 3 });
    const oldestExpiryMs = (
      await bed.pool.query<{ ms: number }>(`SELECT (extract(epoch FROM min(expires_at)) * 1000)::float8 AS ms FROM seat_reservations WHERE status = 'held' AND expires_at <= clock_timestamp()`)
    ).rows[0]!.ms;
    const sched = await scheduler();
    const gauge = () => metricValue(sched.metrics.registry, 'reaper_oldest_eligible_age_seconds', { policy: POLICY });
    // Exactly the age of the oldest expired hold when a pass read it (database clock), not "within
    // a few seconds" of a second reading that a loaded machine can delay.
    const first = await readAgeGaugeExactly(bed.pool, 'the oldest eligible age', oldestExpiryMs, gauge);
    assert.equal(await metricValue(sched.metrics.registry, 'reaper_eligible_rows', { policy: POLICY }), 20, 'waiting rows: the 20 expired holds only');
    assert.equal(await metricValue(sched.metrics.registry, 'reaper_oldest_leased_age_seconds', { policy: POLICY }), 0, 'row-delete holds no lease');
    // Yearly: the longest of the next gaps (a leap year among them makes it 366 days).
    assert.ok([365 * 86400, 366 * 86400].includes((await metricValue(sched.metrics.registry, 'reaper_schedule_interval_seconds', { policy: POLICY }))!));
    // Rising: nothing deletes, so a later refresh reads an older age (by the database clock).
    await eventually('the age to rise by a second', async () => ((await gauge()) ?? 0) >= first + 1, { timeoutMs: 30_000 });
    await readAgeGaugeExactly(bed.pool, 'the oldest eligible age, later', oldestExpiryMs, gauge);

    // A worker and a run drain the holds; the first pass that BEGAN after the drain reads 0. Passes
    // run one after another, so the pass ending after the first pass that ended after the drain
    // began after it: counted in passes (reaper_backlog_refresh_timestamp_seconds), not in seconds.
    const work = await worker();
    await runsInsertManualUnlessOneWaits(bed.pool, POLICY);
    await eventually('every expired hold deleted', async () => (await trueOldestAge()) === 0);
    const drainedAtS = Date.now() / 1000; // the same clock the in-process scheduler stamps its passes with
    const passEnded = () => metricValue(sched.metrics.registry, 'reaper_backlog_refresh_timestamp_seconds', {});
    const endedAfterDrain = await eventually('a pass that ended after the drain', async () => {
      const at = await passEnded();
      return at !== undefined && at > drainedAtS ? at : undefined;
    }, { timeoutMs: 30_000 });
    await eventually('the pass after it', async () => ((await passEnded()) ?? 0) > endedAfterDrain, { timeoutMs: 30_000 });
    assert.equal(await gauge(), 0, 'a pass that began after the drain reads 0');
    assert.equal(await metricValue(sched.metrics.registry, 'reaper_eligible_rows', { policy: POLICY }), 0);

    // The run completes: its duration is observed once and the last completed run is exported.
    await eventually('the run duration observed', async () =>
      (await metricValue(sched.metrics.registry, 'reaper_run_duration_seconds_count', { policy: POLICY })) === 1,
    );
    await eventually('the last completed run exported', async () =>
      ((await metricValue(sched.metrics.registry, 'reaper_last_completed_run_timestamp_seconds', { policy: POLICY })) ?? 0) > 0,
    );
    const lag = await metricValue(work.metrics.registry, 'reaper_deletion_lag_seconds_count', { policy: POLICY });
    assert.equal(lag, 20, 'one lag observation per deleted row');

    // reaper status shows the same columns, in --json.
    const status = await runReaperCli(['status', '--json'], bed.processEnv());
    assert.equal(status.code, 0, status.stdout);
    const row = (JSON.parse(status.stdout) as { policies: Array<Record<string, unknown>> }).policies.find((p) => p.policy === POLICY)!;
    assert.equal(row.oldestEligibleAgeSeconds, 0);
    assert.equal(row.oldestLeasedAgeSeconds, 0);
    assert.equal(row.waitingRows, 0);
    assert.equal(typeof row.lastCompletedRun, 'string');
    // The run just completed: its lag is a few seconds at most, never negative (a lag read off the
    // wrong clock or the wrong run would be minutes or hours off).
    assert.ok(typeof row.lastCompletedLagSeconds === 'number' && row.lastCompletedLagSeconds >= 0 && row.lastCompletedLagSeconds < 120, `the last completed run's lag: ${String(row.lastCompletedLagSeconds)}`);
    const table = await runReaperCli(['status', '--wide'], bed.processEnv());
    assert.match(table.stdout, /oldestEligible\s+oldestLeased\s+waiting\s+lastCompleted\s+lag/);

    await stop(work);
    await stop(sched);
  });

  test('a known sequence: exactly its counts, and one lag observation per deleted row', async () => {
    for (const service of running.splice(0).reverse()) await service.stop(); // left by a failed test: would share the queue
    await bed.pool.query('DELETE FROM seat_reservations');
    const work = await worker();
    const value = (name: string, labels: Record<string, string>) => metricValue(work.metrics.registry, name, labels);
    // Every counter with a known label set starts at 0 (present, not absent).
    assert.equal(await value('reaper_items_total', { policy: POLICY, outcome: 'deleted' }), 0);
    assert.equal(await value('reaper_items_total', { policy: POLICY, outcome: 'noop' }), 0);
    assert.equal(await value('reaper_batches_total', { policy: POLICY, outcome: 'done' }), 0);
    assert.equal(await value('reaper_dead_lettered_total', { policy: POLICY, reason: 'invalid-json' }), 0);
    assert.equal(await value('reaper_dead_lettered_total', { policy: UNKNOWN_POLICY, reason: 'unknown-policy' }), 0);
    assert.equal(await value('reaper_deletion_lag_seconds_count', { policy: POLICY }), 0);
    assert.equal(await value('reaper_build_info', { version: '0.1.0' }), 1);

    const seeded = await seedHolds(bed.pool, { expiredHeld: 3, expiredConfirmed: 1, futureHeld: 1 });
    const batch = await makeRowBatch(bed.pool, [...seeded.expiredHeld, ...seeded.expiredConfirmed, ...seeded.futureHeld]);
    const names = brokerNames(bed.prefix);
    await publishBatch(broker, names, batch);
    await broker.publish(names.workExchange, POLICY, '{"version": 1, "items": [', { messageId: 'broken' });
    await eventually('the batch and the invalid message settled', async () =>
      (await value('reaper_batches_total', { policy: POLICY, outcome: 'done' })) === 1 &&
      (await value('reaper_batches_total', { policy: POLICY, outcome: 'dead-lettered' })) === 1,
    );
    assert.equal(await value('reaper_items_total', { policy: POLICY, outcome: 'deleted' }), 3);
    assert.equal(await value('reaper_items_total', { policy: POLICY, outcome: 'noop' }), 2);
    assert.equal(await value('reaper_batches_total', { policy: POLICY, outcome: 'duplicate' }), 0);
    assert.equal(await value('reaper_batches_total', { policy: POLICY, outcome: 'retry' }), 0);
    assert.equal(await value('reaper_dead_lettered_total', { policy: POLICY, reason: 'invalid-json' }), 1);
    assert.equal(await value('reaper_dead_lettered_total', { policy: POLICY, reason: 'invalid-message' }), 0);
    assert.equal(await value('reaper_deletion_lag_seconds_count', { policy: POLICY }), 3, 'lag count = rows deleted');
    // The seed expired them about an hour ago: each lag is about 3600 s, by the database clock.
    const lagSum = (await value('reaper_deletion_lag_seconds_sum', { policy: POLICY }))!;
    assert.ok(lagSum > 3 * 3500 && lagSum < 3 * 3700, `lag sum ${lagSum} s is 3 lags of about an hour`);

    // A message naming a policy nobody configured keeps the label bounded: "(unknown)", not its name.
    await broker.publish(names.workExchange, POLICY, JSON.stringify({ ...batch, policy: 'made-up-name' }), { messageId: 'unknown' });
    await eventually('the unknown policy dead-lettered under "(unknown)"', async () =>
      (await value('reaper_dead_lettered_total', { policy: UNKNOWN_POLICY, reason: 'unknown-policy' })) === 1,
    );
    const text = await work.metrics.registry.metrics();
    assert.doesNotMatch(text, /made-up-name/, 'a name from a message never becomes a label value');
    await broker.drain(names.deadLetterQueue);
    await stop(work);
  });
});
