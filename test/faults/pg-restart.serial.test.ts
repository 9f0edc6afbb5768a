import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { openTestBroker, type TestBroker } from '../support/broker';
import { runUnderFault } from '../support/fault-run';
import { releaseHeldLocks, schedulerWaitsOnCheckpoint } from '../support/locks';
import { assertNoLeakedProcesses } from '../support/processes';
import { ensurePostgresUp, restartPostgresImmediately } from '../support/server-control';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * PostgreSQL restarted with `-m immediate` (every backend killed, crash recovery at start) in the
 * middle of a run: the scheduler is mid-window (waiting to record its checkpoint), workers are
 * mid-batch. Every connection of every service dies at once. The workers pause consuming until
 * the database answers, the scheduler takes its run up again from the last recorded checkpoint;
 * the run completes, and the checker reads zero.
 *
 * This restarts the machine's PostgreSQL for every test running at the moment (a few seconds):
 * one short serial test, and the cluster is started again and awaited in `finally`.
 */
describe('PostgreSQL restarted (immediate) mid-run', () => {
  let bed: TestBed;
  let broker: TestBroker;

  before(async () => {
    bed = await makeTestBed('fault_pg_restart');
    // The test's own idle connections die with the restart: the pool must not crash the test.
    bed.pool.on('error', () => undefined);
    broker = await openTestBroker(bed.amqpUrl);
  });
  after(async () => {
    try {
      await ensurePostgresUp();
      await releaseHeldLocks();
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

  test('scheduler mid-window, workers mid-batch: the run completes after the restart, checker at zero', async () => {
    let stateAtRestart = '';
    await runUnderFault({
      bed,
      broker,
      expired: 10_000,
      batchSize: 50,
      services: [
        { label: 'scheduler', kind: 'scheduler' },
        { label: 'worker-1', kind: 'worker', env: { REAPER_PREFETCH: '2' } },
        { label: 'worker-2', kind: 'worker', env: { REAPER_PREFETCH: '2' } },
      ],
      runTimeoutMs: 50_000,
      // The restart itself is what these report (connections terminated by the administrator).
      allowErrors: /terminat|connection|ECONNREFUSED|shutdown|recovery|57P0/i,
      async inject({ runId, afterBatches, group, recovery }) {
        // Mid-window: the scheduler published a window and waits to record it; workers are deleting.
        // (locks.ts's holdCheckpointLock, but on a client that expects to lose its connection.)
        const checkpoint = await bed.pool.connect();
        checkpoint.on('error', () => undefined);
        try {
          await checkpoint.query('BEGIN');
          await checkpoint.query('LOCK TABLE cleanup_run_batches IN SHARE MODE');
          await group.eventuallyAlive('the scheduler to wait on a checkpoint', () => schedulerWaitsOnCheckpoint(bed.pool), { timeoutMs: 20_000, intervalMs: 20 });
          await afterBatches(5);
          stateAtRestart = (await bed.pool.query<{ state: string }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [runId])).rows[0]!.state;
          await restartPostgresImmediately();
        } finally {
          // Whatever failed first (issue 43: a failed wait left it checked out, and bed.close() hung):
          // destroyed, not pooled (its connection died with the restart, or holds the lock).
          checkpoint.release(true);
          await ensurePostgresUp();
        }
        const endedAt = Date.now();
        return [await recovery('postgres restarted (immediate)', endedAt)];
      },
    });
    assert.equal(stateAtRestart, 'scanning', 'the restart hit the run while it was scanning');
  });
});
