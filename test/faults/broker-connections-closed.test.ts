import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { bedAndBrokerSuite, type ServiceGroup, rowDeletePolicyYaml, runCompleted, runReceipts, runRow, startSchedulerAndWorkers, triggerRunId } from '../support/fixtures';
import { handOverCheckpointLock, holdCheckpointLock, releaseHeldLocks, SCHEDULER_HELD_CHECKPOINT_ENV, schedulerWaitsOnCheckpoint } from '../support/locks';
import { type ReaperProcess } from '../support/processes';
import { brokerAdmin, type BrokerConnection } from '../support/broker-admin';
import { seedHolds } from '../support/seed';
import { assertRunDeletedExactlyOnce } from '../support/run-checks';

/**
 * The broker (running all along) closes this test's connections in the middle of a run: some batches are committed,
 * some are queued, some are in a worker's hands, and the scheduler may be mid-window with publishes
 * waiting for their confirms. The services reconnect by themselves, the run still completes, every
 * expired hold is deleted exactly once (receipts add up to the seeded count) and no hold that was
 * not eligible is touched.
 *
 * Only this file's connections are closed (matched on the prefix in the connection name): other
 * test files run against the same broker at the same time. (A real broker restart, stop_app and
 * start_app, is broker-restart.serial.test.ts.)
 */
const EXPIRED = 20_000;
const FUTURE = 500;
const CONFIRMED = 500;
const BATCH_SIZE = 50;

/**
 * This test's connections as the broker lists them, those whose name (e.g. "reaper-worker <prefix>
 * <id>") has each of `words`, once `count` of them are ones this test has not closed: the
 * management API (broker-admin.ts) lists a new connection at its next statistics tick
 * (collect_statistics_interval, 5 s by default), rabbitmqctl at once. All that is listed then is
 * returned, a closed one still listed too, for the caller's assertions.
 */
function listedOnce(group: ServiceGroup, what: string, words: readonly string[], count: number, closed: ReadonlySet<string> = new Set()): Promise<BrokerConnection[]> {
  return group.eventuallyAlive(
    what,
    async () => {
      const listed = (await (await brokerAdmin()).listConnections()).filter((connection) => words.every((word) => connection.name.split(' ').includes(word)));
      return listed.filter((connection) => !closed.has(connection.id)).length >= count ? listed : undefined;
    },
    { timeoutMs: 20_000, intervalMs: 200 },
  );
}

async function closeConnection(id: string): Promise<void> {
  await (await brokerAdmin()).closeConnection(id, 'test: connection closed by the broker');
}

describe('broker closes the connections mid-run', () => {
  const world = bedAndBrokerSuite('fault_connections_closed', { first: releaseHeldLocks });

  const amqpConnectedCount = (service: ReaperProcess) => service.lines.filter((line) => line.msg === 'amqp connected').length;

  test('every connection closed mid-run: services reconnect, the run completes, each expired hold is deleted once and nothing else', async () => {
    world.bed.writePolicies(rowDeletePolicyYaml({ batchSize: BATCH_SIZE }));
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const expectedBatches = Math.ceil(EXPIRED / BATCH_SIZE);
    const crew = startSchedulerAndWorkers(
      world.bed,
      { scheduler: 'scheduler-1', workers: ['worker-1', 'worker-2'], workerEnv: { REAPER_PREFETCH: '1' }, schedulerEnv: SCHEDULER_HELD_CHECKPOINT_ENV },
      'no service may die when the broker closes its connection',
    );
    const { group, workers, services } = crew;
    const { eventuallyAlive } = group;
    let passed = false;
    try {
      await group.ready();
      assert.deepEqual(services.map(amqpConnectedCount), [1, 1, 1], 'each service connected once');

      // Mid-run, deterministically: the scheduler publishes its first window and then waits to
      // record it; the workers commit some of that window's batches; then every connection closes.
      const checkpoints = await holdCheckpointLock(world.bed.pool);
      const runId = await triggerRunId(world.bed, 'seat-holds');
      await eventuallyAlive('the scheduler to wait on its first checkpoint', () => schedulerWaitsOnCheckpoint(world.bed.pool), { timeoutMs: 20_000, intervalMs: 20 });
      await eventuallyAlive('a few batches to be committed', async () => (await runReceipts(world.bed.pool, runId)).batches >= 5, { timeoutMs: 20_000, intervalMs: 20 });
      const connections = await listedOnce(group, "the services' connections to be listed", [world.bed.prefix], 3);
      assert.deepEqual(
        connections.map((c) => c.name).sort(),
        [`reaper-scheduler ${world.bed.prefix} scheduler-1`, `reaper-worker ${world.bed.prefix} worker-1`, `reaper-worker ${world.bed.prefix} worker-2`],
        'one connection per service, named after this test prefix',
      );
      const stateAtClose = (await runRow(world.bed.pool, runId)).state;
      await Promise.all(connections.map((c) => closeConnection(c.id)));
      const doneAtClose = (await runReceipts(world.bed.pool, runId)).batches;
      await checkpoints.release();
      assert.equal(stateAtClose, 'scanning', 'the connections were closed while the run was scanning');
      assert.ok(doneAtClose < expectedBatches, `the connections were closed mid-run (${doneAtClose}/${expectedBatches} batches done)`);

      // Every service notices and comes back by itself, once.
      for (const service of services) {
        await eventuallyAlive(`${service.label} to notice the closed connection`, () =>
          service.lines.some((line) => line.msg === 'amqp connection closed; reconnecting'),
        );
        await eventuallyAlive(`${service.label} to log 'amqp connected' again`, () => amqpConnectedCount(service) >= 2);
      }
      const reconnected = await listedOnce(group, 'the new connections to be listed', [world.bed.prefix], 3, new Set(connections.map((c) => c.id)));
      assert.equal(reconnected.length, 3, 'three live connections again');
      assert.ok(reconnected.every((c) => !connections.some((old) => old.id === c.id)), 'new connections, not the closed ones');

      await runCompleted(group, world.bed.pool, runId, 40_000);
      // One close, one reconnect each: not a reconnect loop.
      assert.deepEqual(services.map(amqpConnectedCount), [2, 2, 2], 'each service connected exactly twice (start, after the close)');

      // The workers' own accounts: as many deletions logged as seeded, duplicates delete nothing.
      const doneSettles = workers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'done'));
      assert.equal(doneSettles.reduce((sum, line) => sum + Number(line.deleted), 0), EXPIRED, 'the workers logged as many deletions as were seeded');
      const duplicates = workers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'duplicate'));
      assert.deepEqual(duplicates.filter((line) => line.deleted !== 0), [], 'duplicates delete nothing');
      // The data: every expired hold deleted, each exactly once, nothing else; services exit 0.
      await assertRunDeletedExactlyOnce(world, { runId, seeded, ...crew, diagnosis: { runStateAtClose: stateAtClose } });
      passed = true;
    } finally {
      await releaseHeldLocks();
      if (!passed) await group.stopLeftovers();
    }
  });

  /**
   * A flapping connection aimed at the scheduler: its connection (only) is closed again and again
   * while it scans and publishes, and the workers (whose connections stay up) keep deleting what
   * reached the queue. Each close may land while publishes of the current window still wait for
   * their confirms; the scheduler must retry that window from its checkpoint, not die, and the run
   * must still delete every expired hold exactly once.
   */
  test('scheduler connection closed repeatedly while it publishes: it recovers and the run still deletes every expired hold once', async () => {
    const FLAP_EXPIRED = 20_000;
    const FLAP_BATCH = 20; // 1,000 batches: 32 windows, far more than CLOSES checkpoints to stop at
    const CLOSES = 5;
    await world.bed.pool.query('DELETE FROM seat_reservations'); // whatever the first test left
    world.bed.writePolicies(rowDeletePolicyYaml({ name: 'flap-holds', batchSize: FLAP_BATCH }));
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: FLAP_EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const crew = startSchedulerAndWorkers(
      world.bed,
      { scheduler: 'scheduler-2', workers: ['worker-3', 'worker-4'], workerEnv: { REAPER_PREFETCH: '1' }, schedulerEnv: SCHEDULER_HELD_CHECKPOINT_ENV },
      'no service may die when the broker closes its connection',
    );
    const { group, scheduler } = crew;
    const { eventuallyAlive } = group;
    let passed = false;
    try {
      await group.ready();

      // Held before the trigger: the first close happens at the first checkpoint, whatever the speed.
      let checkpoints = await holdCheckpointLock(world.bed.pool);
      const runId = await triggerRunId(world.bed, 'flap-holds');
      const closed = new Set<string>();

      for (let closes = 1; closes <= CLOSES; closes++) {
        // Between two windows, deterministically: the next checkpoint is held, the scheduler's
        // connection is closed while it waits there, and it goes on once it has reconnected. The
        // run cannot end in between (each checkpoint waits for the lock), so every close happens.
        await eventuallyAlive(`the scheduler to wait on checkpoint ${closes}`, () => schedulerWaitsOnCheckpoint(world.bed.pool), {
          intervalMs: 20,
          describe: () => runRow(world.bed.pool, runId),
        });
        assert.equal((await runRow(world.bed.pool, runId)).state, 'scanning', `close ${closes} lands while the run is scanning`);
        const connections = await listedOnce(group, "the scheduler's connection to be listed", [world.bed.prefix, 'scheduler-2'], 1, closed);
        assert.equal(connections.length, 1, "the scheduler's one connection");
        await closeConnection(connections[0]!.id);
        closed.add(connections[0]!.id);
        await eventuallyAlive(`the scheduler to reconnect after close ${closes}`, () => amqpConnectedCount(scheduler) >= closes + 1, { intervalMs: 20 });
        // Let this checkpoint through and hold the next one (no window slips past unheld).
        if (closes < CLOSES) checkpoints = await handOverCheckpointLock(world.bed.pool, checkpoints);
        else await checkpoints.release();
      }
      assert.equal(amqpConnectedCount(scheduler), CLOSES + 1, 'the scheduler reconnected exactly once per close');

      await runCompleted(group, world.bed.pool, runId, 40_000);
      await assertRunDeletedExactlyOnce(world, { runId, seeded, ...crew, policy: 'flap-holds', diagnosis: { closes: CLOSES } });
      passed = true;
    } finally {
      await releaseHeldLocks();
      if (!passed) await group.stopLeftovers();
    }
  });
});
