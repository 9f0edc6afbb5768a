import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';
import amqp from 'amqplib';
import type { Channel, ChannelModel } from 'amqplib';
import { bedAndBrokerSuite, rowDeletePolicyYaml, runCompleted, runReceipts, runRow, startSchedulerAndWorkers, triggerRunId } from '../support/fixtures';
import { holdCheckpointLock, releaseHeldLocks } from '../support/locks';
import { seedHolds } from '../support/seed';
import { assertRunDeletedExactlyOnce } from '../support/run-checks';

/**
 * The scheduler's publishes start failing in the middle of a run, deterministically: the test
 * holds a lock on cleanup_run_batches, so the scheduler's first checkpoint waits while the workers
 * are already deleting that window's batches (they are ahead of every confirmed window). Then the
 * work queue's binding is removed and the lock released: the next window's publishes come back
 * unroutable (mandatory) and are refused. The scheduler must not die; it publishes the same
 * batches again, and once the binding is back the run completes with every expired hold deleted
 * exactly once and counted once.
 *
 * (broker-connections-closed.test.ts and broker-restart.serial.test.ts reach the same retry by
 * taking the connection away; this is the reproducible form of a refused publish.)
 */
const EXPIRED = 20_000;
const FUTURE = 500;
const CONFIRMED = 500;
const BATCH_SIZE = 50;

describe('scheduler publishes refused mid-window', () => {
  let admin: ChannelModel;
  let adminChannel: Channel;
  // The admin connection may already be closed: nothing to release then.
  const world = bedAndBrokerSuite('fault_publish_failure', {
    policiesYaml: rowDeletePolicyYaml({ batchSize: BATCH_SIZE }),
    first: releaseHeldLocks,
    alsoClose: [() => admin?.close().catch(() => undefined)],
  });
  before(async () => {
    admin = await amqp.connect(world.bed.amqpUrl);
    adminChannel = await admin.createChannel();
  });

  test('the scheduler retries the refused window instead of dying, and the run deletes every expired hold once', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const crew = startSchedulerAndWorkers(
      world.bed,
      { scheduler: 'scheduler-1', workers: ['worker-1', 'worker-2'], workerEnv: { REAPER_PREFETCH: '1' } },
      'no service may die because a publish was refused',
    );
    const { group, scheduler } = crew;
    const { eventuallyAlive } = group;

    let passed = false;
    try {
      await group.ready();
      // Hold the scheduler's first checkpoint: it writes the confirmed batch ids to this table.
      const checkpoints = await holdCheckpointLock(world.bed.pool);
      const runId = await triggerRunId(world.bed, 'seat-holds');

      // Mid-run: the first window is published and confirmed, its checkpoint waits on the lock,
      // and the workers have already committed batches of it.
      await eventuallyAlive(
        'the workers to be ahead of the confirmed windows',
        async () => {
          const row = await runRow(world.bed.pool, runId);
          return row.state === 'scanning' && (await runReceipts(world.bed.pool, runId)).batches > row.batches_confirmed;
        },
        { intervalMs: 20 },
      );
      await adminChannel.unbindQueue(world.names.workQueue('seat-holds'), world.names.workExchange, 'seat-holds');
      await checkpoints.release();
      const refused = await eventuallyAlive(
        'the scheduler to report the refused window',
        async () => scheduler.lines.find((line) => line.msg === 'run publish failed; retrying'),
        { timeoutMs: 15_000 },
      );
      assert.match(String(refused.err), /unroutable/, 'the window failed because its publishes were unroutable');
      await adminChannel.bindQueue(world.names.workQueue('seat-holds'), world.names.workExchange, 'seat-holds');

      await runCompleted(group, world.bed.pool, runId, 40_000);
      await assertRunDeletedExactlyOnce(world, { runId, seeded, ...crew });
      passed = true;
    } finally {
      await releaseHeldLocks();
      if (!passed) await group.stopLeftovers();
    }
  });
});
