import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from '../support/broker';
import { closeBedAndBroker, rowDeletePolicyYaml, runCompleted, runReceipts, runRow, startSchedulerAndWorkers, triggerRunId } from '../support/fixtures';
import { holdCheckpointLock, releaseHeldLocks, schedulerWaitsOnCheckpoint } from '../support/locks';
import { type ReaperProcess } from '../support/processes';
import { withBrokerStopped } from '../support/rabbitmqctl';
import { assertRunDeletedExactlyOnce } from '../support/run-checks';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The broker really restarts in the middle of a run (`rabbitmqctl stop_app`, then `start_app` and
 * `await_startup`, always restored in a `finally`): every connection drops, the broker is away for
 * a while, the quorum queues come back from disk with the batches that were queued and the ones a
 * worker held unacked. A scheduler process and two worker processes reconnect by themselves, the
 * run completes, and every expired hold is deleted exactly once (docs/design.md invariants 4 and 14).
 *
 * A serial file: stopping the broker would fail the other files running beside it. (Connections
 * closed while the broker stays up: broker-connections-closed.test.ts.)
 */
const EXPIRED = 10_000;
const FUTURE = 300;
const CONFIRMED = 300;
const BATCH_SIZE = 50;

describe('broker restarted mid-run', () => {
  let bed: TestBed;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    bed = await makeTestBed('fault_broker_restart');
    names = brokerNames(bed.prefix);
  });

  after(() => closeBedAndBroker({ bed }, releaseHeldLocks));

  const amqpConnectedCount = (service: ReaperProcess) => service.lines.filter((line) => line.msg === 'amqp connected').length;

  test('stop_app / start_app mid-run: the services reconnect, the run completes, each expired hold is deleted once', async () => {
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: BATCH_SIZE }));
    const seeded = await seedHolds(bed.pool, { expiredHeld: EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const expectedBatches = EXPIRED / BATCH_SIZE;
    const crew = startSchedulerAndWorkers(
      bed,
      { scheduler: 'scheduler', workers: ['worker-1', 'worker-2'], workerEnv: { REAPER_PREFETCH: '2' } },
      'no service may die when the broker restarts',
    );
    const { group, services } = crew;
    const { eventuallyAlive } = group;
    let broker: TestBroker | undefined;
    let passed = false;
    try {
      await group.ready();

      // Mid-run, deterministically: the first window is published and confirmed, its checkpoint
      // waits on the test's lock, the workers are deleting that window's batches.
      const checkpoints = await holdCheckpointLock(bed.pool);
      const runId = await triggerRunId(bed, 'seat-holds');
      await eventuallyAlive('the scheduler to wait on its first checkpoint', () => schedulerWaitsOnCheckpoint(bed.pool), { timeoutMs: 30_000, intervalMs: 20 });
      await eventuallyAlive('a few batches to be committed', async () => (await runReceipts(bed.pool, runId)).batches >= 3, { timeoutMs: 30_000, intervalMs: 20 });

      const atStop = await withBrokerStopped(async () => {
        // While the broker is away: every service has lost its connection, and the scheduler goes
        // on to its next window, whose publishes wait for the broker (kept short: other engineers'
        // and files' tests share this broker).
        for (const service of services) {
          await eventuallyAlive(`${service.label} to notice the broker is gone`, () =>
            service.lines.some((line) => line.msg === 'amqp connection closed; reconnecting'),
          );
        }
        const state = (await runRow(bed.pool, runId)).state;
        const done = (await runReceipts(bed.pool, runId)).batches;
        await checkpoints.release();
        return { state, done };
      });
      assert.equal(atStop.state, 'scanning', 'the broker stopped while the run was scanning');
      assert.ok(atStop.done < expectedBatches, `the broker stopped mid-run (${atStop.done}/${expectedBatches} batches done)`);

      for (const service of services) {
        await eventuallyAlive(`${service.label} to reconnect after the restart`, () => amqpConnectedCount(service) >= 2, { timeoutMs: 60_000 });
      }
      broker = await openTestBroker(bed.amqpUrl);
      await runCompleted(group, bed.pool, runId, 60_000);
      await assertRunDeletedExactlyOnce({ bed, broker, names }, { runId, seeded, ...crew, diagnosis: { atStop } });
      passed = true;
    } finally {
      await releaseHeldLocks();
      if (!passed) await group.stopLeftovers();
      await broker?.close();
    }
  });
});
