import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type pg from 'pg';
import { eventually } from '../support/eventually';
import { runReaperCli, type ReaperProcess } from '../support/processes';
import {
  closeRemoteWorld,
  ledgerDiagnosis,
  ledgerRows,
  MEDIA_POLICY,
  openRemoteWorld,
  seedAssets,
  started,
  startSchedulerProcess,
  startWorkerProcess,
  type RemoteWorld,
} from '../support/remote-helpers';

const OUTCOME_LOCK_TIMEOUT_MS = 300;

/**
 * Issue 17 item 8: a call whose outcome write fails must not end the worker. The outcome write of
 * one call is made to fail (the test holds the ledger row's lock past the worker's lock_timeout)
 * while the same delivery's loop sleeps for its next token and asks for admission (one token at a
 * time). The failure is the delivery's result once its calls have ended; the worker lives on, the
 * operation's lease expires, and the call is retried with the same Idempotency-Key: every
 * operation ends done, none stays in flight, and the remote deleted each asset once.
 */
describe('remote-delete: a failed outcome write is handled, not an unhandled rejection', () => {
  let world: RemoteWorld;
  let scheduler: ReaperProcess;
  let locker: pg.PoolClient | undefined;

  before(async () => {
    // One token at a time (rate 2/s, burst 1): between two calls the loop sleeps and asks again.
    world = await openRemoteWorld('fault_remote_outcome_write', { ratePerSecond: 2, burst: 1, concurrency: 2, batchSize: 6, leaseMs: 12_000, timeoutMs: 2_000 });
    scheduler = startSchedulerProcess(world.bed, 'outcome-scheduler');
    await started(scheduler, 'scheduler');
  });

  after(async () => {
    await locker?.query('ROLLBACK').catch(() => undefined); // a failed test may still hold it
    locker?.release();
    const stopped = await scheduler?.stop();
    await closeRemoteWorld(world);
    assert.equal(stopped?.code, 0, 'the scheduler drains and exits 0');
  });

  test('the outcome write times out on a row lock while other calls wait for admission: the worker stays alive and the operation ends done', async () => {
    const { bed, api } = world;
    const ids = await seedAssets(bed.pool, 'locked', 6);
    const worker = startWorkerProcess(bed, 'outcome-worker', { REAPER_LOCK_TIMEOUT_MS: String(OUTCOME_LOCK_TIMEOUT_MS) });
    await started(worker, 'worker');
    api.configure({ hold: true });
    assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);

    // The first call is at the remote (decided, not answered): lock its ledger row, then answer it.
    const first = await eventually('a first call at the remote', () => api.heldCalls()[0], { timeoutMs: 30_000 });
    locker = await bed.pool.connect();
    await locker.query('BEGIN');
    const locked = await locker.query('SELECT 1 FROM cleanup_ledger WHERE operation_key = $1 FOR UPDATE', [first.key]);
    assert.equal(locked.rowCount, 1, 'the first call has its ledger row');
    assert.equal(api.release((call) => call.seq === first.seq), 1);

    // The outcome write waits for the lock and fails; meanwhile the loop goes on asking for tokens.
    await eventually(
      'the failed outcome write reported (or the worker gone)',
      () => !worker.running || worker.lines.some((line) => line.msg?.startsWith('call outcome not recorded') && line.operationKey === first.key),
      { timeoutMs: 20_000, describe: () => worker.output.slice(-5) },
    );
    assert.ok(worker.running, `the worker is alive after the failed outcome write (exit: ${JSON.stringify(worker.running ? null : await worker.exited)}; last output: ${worker.output.slice(-3).join(' | ')})`);
    await locker.query('ROLLBACK');
    locker.release();
    locker = undefined;
    api.configure({ hold: false });
    api.release();

    // The lease of the unrecorded call expires; the operation is claimed and called again, then done.
    const rows = await eventually(
      'every operation done',
      async () => {
        const current = await ledgerRows(bed.pool, ids);
        return current.length === ids.length && current.every((row) => row.state === 'done') ? current : undefined;
      },
      { timeoutMs: 60_000, intervalMs: 200, describe: () => ledgerDiagnosis(bed.pool) },
    );
    assert.ok(worker.running, 'the worker never exited');
    for (const row of rows) assert.equal(row.outcome, 'confirmed', `${row.operation_key} confirmed`);
    const retried = rows.find((row) => row.operation_key === first.key)!;
    assert.ok(retried.attempt_count >= 2, `the call whose outcome was lost was made again (${retried.attempt_count} attempts)`);
    for (const [key, executions] of api.executionsByKey()) assert.equal(executions, 1, `${key} deleted at the remote once`);
    const exit = await worker.stop();
    assert.equal(exit.code, 0, 'the worker drains and exits 0');
  });
});
