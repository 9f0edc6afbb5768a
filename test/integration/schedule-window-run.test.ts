import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import pino from 'pino';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames } from '../../shared/amqp/topology';
import { parsePolicies } from '../../shared/config/policies';
import { decodeBatch } from '../../shared/contracts/batch';
import { targetResolve } from '../../shared/db/queries/target';
import { runClaimOf, runsClaimNext, runsInsertIfAbsent, runsReleaseLease } from '../../shared/db/queries/runs';
import { makeMetrics } from '../../shared/observability/metrics';
import { executeRun, type RunExecutorDeps } from '../../services/scheduler/run-executor';
import { executorSuite } from '../support/executor-suite';
import { rowDeletePolicyYaml, runRow } from '../support/fixtures';
import { seedHolds } from '../support/seed';

/**
 * Issue 20 item 1: a run that reaches its schedule window's end stops at a batch boundary (the
 * executor checks the window before each window of batches, as it checks its claim), keeps its
 * cursor, and continues in the next window with its ORIGINAL cutoff. The real executor, the real
 * run statements and the real broker; the clock the window is read with is injected (deps.now),
 * so the window closes exactly after the first checkpoint.
 */
const POLICY = 'seat-holds';
const OPEN = new Date('2026-06-01T03:00:00Z');
const CLOSED = new Date('2026-06-01T07:00:00Z');

describe('schedule window: a run stops at the window end and resumes in the next window', () => {
  const world = executorSuite('schedule_window_run', [POLICY]);

  test('closed after the first window: stopped with its cursor; the next window publishes the rest under the same cutoff, nothing newer', async () => {
    const yaml = rowDeletePolicyYaml({ batchSize: 2 }).replace(/\n$/, '\n    window: { start: "01:00", end: "05:00", timeZone: "UTC" }\n');
    const policy = parsePolicies(yaml, 'window.yaml', {}).get(POLICY)!;
    const target = await targetResolve(world.bed.pool, policy);
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 10 });
    const names = brokerNames(world.bed.prefix);
    let clock = OPEN;
    const deps: RunExecutorDeps = {
      pool: world.bed.pool,
      publisher: new ConfirmingPublisher(world.connection),
      names,
      owner: 'scheduler-a',
      leaseMs: 60_000,
      unroutableFailAfterMs: 60_000,
      log: pino({ level: 'silent' }),
      metrics: makeMetrics([]),
      stopping: () => false,
      batchVersion: async () => 1,
      // Two batches of two rows a window: 10 rows make three windows.
      windowBatches: 2,
      now: () => clock,
      beforeStep: async (step) => {
        // The window's end arrives while the first window is being checkpointed.
        if (step === 'checkpoint') clock = CLOSED;
      },
    };

    const inserted = (await runsInsertIfAbsent(world.bed.pool, { policy: POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    // Rows that expire after the run's cutoff: eligible by the time the run resumes, never for this run.
    const later = await world.bed.pool.query<{ reservation_id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
       SELECT gen_random_uuid(), 'held', clock_timestamp(), 'late-' || i FROM generate_series(1, 3) i RETURNING reservation_id`,
    );
    const first = (await runsClaimNext(world.bed.pool, 'scheduler-a', deps.leaseMs, [POLICY]))!;
    assert.equal(first.runId, inserted.runId);
    assert.equal(await executeRun(deps, first, policy, target), 'window-closed', 'the run stops when its window closes');
    await runsReleaseLease(world.bed.pool, runClaimOf(first, 'scheduler-a'));
    const stopped = await runRow(world.bed.pool, first.runId);
    assert.deepEqual(
      { state: stopped.state, candidates: stopped.candidates, batches: stopped.batches_confirmed },
      { state: 'scanning', candidates: 4, batches: 2 },
      'stopped at a batch boundary: the first window (4 rows, 2 batches) checkpointed, nothing after it',
    );
    const firstMessages = await world.broker.drain(names.workQueue(POLICY));
    assert.equal(firstMessages.length, 2, 'only the first window was published');

    // The next window: the same run is claimed again and continues from its cursor.
    clock = OPEN;
    deps.beforeStep = undefined;
    const resumed = (await runsClaimNext(world.bed.pool, 'scheduler-b', deps.leaseMs, [POLICY]))!;
    assert.equal(resumed.runId, first.runId, 'the stopped run is the one claimed in the next window');
    assert.equal(resumed.cutoff, first.cutoff, 'with its original cutoff');
    assert.equal(await executeRun({ ...deps, owner: 'scheduler-b' }, resumed, policy, target), 'published');
    const finished = await runRow(world.bed.pool, first.runId);
    assert.equal(finished.candidates, 10, 'the seeded rows, once each; not the rows that expired after the cutoff');
    const rest = await world.broker.drain(names.workQueue(POLICY));
    const published = [...firstMessages, ...rest].map((message) => {
      const decoded = decodeBatch(message.content);
      assert.ok(decoded.ok);
      return decoded.batch;
    });
    assert.ok(published.every((batch) => batch.cutoff === first.cutoff), 'every batch carries the original cutoff');
    const ids = published.flatMap((batch) => batch.items.map((item) => item.id));
    assert.deepEqual([...ids].sort(), [...seeded.expiredHeld].sort(), 'each seeded row published exactly once across both windows');
    const lateIds = new Set(later.rows.map((row) => row.reservation_id));
    assert.ok(!ids.some((id) => lateIds.has(id)), 'no row that expired after the cutoff');
  });
});
