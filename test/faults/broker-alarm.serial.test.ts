import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { openTestBroker, type TestBroker } from '../support/broker';
import { runUnderFault } from '../support/fault-run';
import { releaseHeldLocks, schedulerWaitsOnCheckpoint } from '../support/locks';
import { assertNoLeakedProcesses } from '../support/processes';
import { restoreMemoryWatermark, setMemoryWatermark } from '../support/server-control';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The broker's memory alarm (`rabbitmqctl set_vm_memory_high_watermark 0.0001`) blocks every
 * publishing connection mid-run: the scheduler's publishes get no confirm, its window times out
 * and is retried from the last checkpoint, again and again while the alarm lasts. Once the
 * watermark is back at 0.4 the window goes through, the run completes, and no row is published
 * under two batch ids (a retried window reuses its batch ids; what the broker had buffered arrives
 * as duplicates of the same ids, counted no-ops). Checker at zero.
 *
 * The alarm blocks publishers of every test on the machine for its ~15 s: one short serial test,
 * and the watermark is restored (and the alarm awaited gone) in `finally`.
 */
const CONFIRM_TIMEOUT_MS = 3_000;

describe('broker memory alarm mid-run', () => {
  let bed: TestBed;
  let broker: TestBroker;

  before(async () => {
    bed = await makeTestBed('fault_broker_alarm');
    broker = await openTestBroker(bed.amqpUrl);
  });
  after(async () => {
    try {
      await restoreMemoryWatermark();
      await releaseHeldLocks();
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

  test('publishers blocked: the window times out, is retried after the alarm, the run completes, nothing published twice; checker at zero', async () => {
    let retriesDuringAlarm = 0;
    let retryReason = '';
    await runUnderFault({
      bed,
      broker,
      expired: 8_000,
      batchSize: 50,
      services: [
        // The blocked window's publish gives up after 3 s instead of the production 10 s: the test
        // waits on that timeout and the retry, not on the production timer (issue 43 item 4).
        { label: 'scheduler', kind: 'scheduler', env: { REAPER_TEST_CONFIRM_TIMEOUT_MS: String(CONFIRM_TIMEOUT_MS) } },
        { label: 'worker-1', kind: 'worker' },
        { label: 'worker-2', kind: 'worker' },
      ],
      runTimeoutMs: 60_000,
      async inject({ afterBatches, group, scheduler, recovery }) {
        // Between two windows, so that the next window is published into the alarm.
        const checkpoint = await bed.pool.connect();
        checkpoint.on('error', () => undefined);
        try {
          await checkpoint.query('BEGIN');
          await checkpoint.query('LOCK TABLE cleanup_run_batches IN SHARE MODE');
          await group.eventuallyAlive('the scheduler to wait on a checkpoint', () => schedulerWaitsOnCheckpoint(bed.pool), { timeoutMs: 20_000, intervalMs: 20 });
          await afterBatches(3);
          await setMemoryWatermark(0.0001);
        } finally {
          await checkpoint.query('COMMIT').catch(() => undefined);
          checkpoint.release();
        }
        let endedAt = 0;
        try {
          await group.eventuallyAlive(
            'the blocked window to time out',
            () => scheduler.lines.some((line) => line.msg === 'run publish failed; retrying'),
            { timeoutMs: 40_000, intervalMs: 100, describe: () => scheduler.output.slice(-4) },
          );
          const retries = scheduler.lines.filter((line) => line.msg === 'run publish failed; retrying');
          retriesDuringAlarm = retries.length;
          retryReason = String(retries[0]?.err);
        } finally {
          await restoreMemoryWatermark();
          endedAt = Date.now();
        }
        return [await recovery('broker memory alarm', endedAt)];
      },
    });
    assert.ok(retriesDuringAlarm >= 1, 'the window timed out at least once during the alarm');
    assert.match(retryReason, new RegExp(`no confirm within ${CONFIRM_TIMEOUT_MS} ms`), 'the publish gave up after the test timing (REAPER_TEST_CONFIRM_TIMEOUT_MS), not the production 10 s');
  });
});
