import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { DELAY_TIERS_MS } from '../../shared/amqp/topology';
import { type BatchV1 } from '../../shared/contracts/batch';
import { bedAndBrokerSuite, makeRowBatch, publishBatch, readyAtRest, receiptsOf, rowDeletePolicyYaml } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { startReaper, type LogLine, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';

/**
 * A worker process really killed (SIGKILL, by its own failpoint) in the two places that matter for
 * "ack only after commit":
 *  - before COMMIT: the transaction dies with the connection, nothing is deleted, the unacked batch
 *    comes back and a fresh worker deletes it, once;
 *  - after COMMIT and before the ack: the rows are gone and the receipt is written, the batch comes
 *    back anyway, and the fresh worker counts it as a duplicate no-op without touching the receipt.
 */
describe('worker crash around the commit', () => {
  // The schedule never matters here: no scheduler runs in this file, batches are crafted.
  // Audit on: an audit row must exist exactly when a deletion committed, whatever the crash.
  const world = bedAndBrokerSuite('fault_worker_crash', { policiesYaml: rowDeletePolicyYaml({ batchSize: 100, audit: true }) });

  const startWorker = (label: string, extra: Record<string, string> = {}): ReaperProcess =>
    startReaper(label, ['worker'], world.bed.processEnv({ REAPER_WORKER_ID: label, REAPER_PREFETCH: '4', ...extra }));

  async function batchFor(ids: string[]): Promise<BatchV1> {
    return makeRowBatch(world.bed.pool, ids);
  }

  const publish = (batch: BatchV1) => publishBatch(world.broker, world.names, batch);

  const receipts = (batchId: string) => receiptsOf(world.bed.pool, batchId);

  /** The audit trail of a batch: how many rows, and how many distinct keys. */
  const audited = async (batchId: string) =>
    (await world.bed.pool.query<{ rows: number; keys: number }>('SELECT count(*)::int AS rows, count(DISTINCT key)::int AS keys FROM cleanup_audit WHERE batch_id = $1', [batchId])).rows[0]!;

  const settledLines = (worker: ReaperProcess, batchId: string): LogLine[] =>
    worker.lines.filter((line) => line.msg === 'batch settled' && line.batchId === batchId);

  /** The process's exit, or a failure naming it if it is still running after `timeoutMs`. */
  async function diedWithin(worker: ReaperProcess, timeoutMs: number): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    let exit: { code: number | null; signal: NodeJS.Signals | null } | undefined;
    void worker.exited.then((result) => (exit = result));
    return eventually(`${worker.label} to die at its failpoint`, () => exit, { timeoutMs, describe: () => worker.output.slice(-8) });
  }

  /** Ready messages in the work queue (a message held unacked by a live consumer is not counted). */
  const readyInWorkQueue = () => world.broker.messageCount(world.names.workQueue('seat-holds'));

  /**
   * "The killed worker never settled the batch", from the broker and not from its logs (a
   * SIGKILLed process's last log lines may never be written): the message went back to the work
   * queue (it was not acked, and it was not rejected: a reject would have counted a delivery), and
   * no copy of it reached a delay tier or the dead-letter queue (settle's other actions).
   */
  async function assertNeverSettledByBroker(): Promise<void> {
    await eventually('the unacked batch to be back in the work queue', async () => (await readyInWorkQueue()) === 1);
    for (const tier of DELAY_TIERS_MS) assert.equal(await world.broker.messageCount(world.names.delayQueue(tier)), 0, `no copy in delay tier ${tier} ms`);
    assert.equal(await world.broker.messageCount(world.names.deadLetterQueue), 0, 'no copy dead-lettered');
  }

  test('SIGKILL before commit: nothing is deleted, the batch comes back, a fresh worker deletes it once', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 40 });
    const batch = await batchFor(seeded.expiredHeld);

    const doomed = startWorker('crash-before-commit', { REAPER_TEST_FAILPOINT: 'before-commit' });
    await doomed.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
    await publish(batch);

    const exit = await diedWithin(doomed, 30_000);
    assert.deepEqual(exit, { code: null, signal: 'SIGKILL' }, 'the worker must die by SIGKILL at its failpoint');
    // Its log lines are not asserted (pino writes asynchronously, so the SIGKILL may win): the
    // broker and the database say where the process died.
    await assertNeverSettledByBroker();

    // The open transaction died with the process: every row is still there and no receipt exists.
    await eventually('the killed backend to be gone (no transaction left open on the table)', async () => {
      const open = await world.bed.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`,
      );
      return open.rows[0]!.n === 0;
    });
    assert.equal(await countReservations(world.bed.pool, seeded.expiredHeld), 40, 'a crash before commit deletes nothing');
    assert.deepEqual(await receipts(batch.batchId), [], 'no receipt for an uncommitted batch');
    assert.deepEqual(await audited(batch.batchId), { rows: 0, keys: 0 }, 'no audit row for an uncommitted deletion');

    const fresh = startWorker('fresh-after-before-commit');
    const settled = await fresh.waitForLine('the redelivered batch to settle', (line) => line.msg === 'batch settled' && line.batchId === batch.batchId, 30_000);
    assert.equal(settled.outcome, 'done');
    assert.equal(settled.deleted, 40);
    assert.equal(settled.noop, 0);
    assert.equal(settled.deliveryCount, 2, 'the second delivery: the one the killed worker held, given back once');
    assert.equal(await countReservations(world.bed.pool, seeded.expiredHeld), 0, 'the fresh worker deleted every row');
    assert.deepEqual(await receipts(batch.batchId), [{ deleted: 40, noop: 0, worker_id: 'fresh-after-before-commit' }], 'exactly one receipt, from the fresh worker');
    assert.deepEqual(await audited(batch.batchId), { rows: 40, keys: 40 }, 'one audit row per deleted row, once each');
    await eventually('the work queue to be empty', async () => (await readyInWorkQueue()) === 0);

    const stopped = await fresh.stop();
    assert.equal(stopped.code, 0, 'the fresh worker drains and exits 0');
    assert.equal(settledLines(fresh, batch.batchId).length, 1, 'the batch was settled exactly once');
    assert.equal(await readyAtRest(world.broker, world.names.workQueue('seat-holds')), 0, 'nothing came back after the ack (read once no consumer holds a message)');
    assert.equal((await world.broker.drain(world.names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
  });

  test('SIGKILL after commit, before ack: rows are gone, the batch comes back and is a counted duplicate no-op', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 25, futureHeld: 5 });
    const batch = await batchFor(seeded.expiredHeld);

    const doomed = startWorker('crash-after-commit', { REAPER_TEST_FAILPOINT: 'after-commit' });
    await doomed.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
    await publish(batch);

    const exit = await diedWithin(doomed, 30_000);
    assert.deepEqual(exit, { code: null, signal: 'SIGKILL' }, 'the worker must die by SIGKILL at its failpoint');
    await assertNeverSettledByBroker();

    // The commit happened: rows gone, receipt written by the killed worker.
    assert.equal(await countReservations(world.bed.pool, seeded.expiredHeld), 0, 'the committed deletion stands');
    assert.equal(await countReservations(world.bed.pool, seeded.futureHeld), 5, 'rows outside the batch are untouched');
    const committed = await receipts(batch.batchId);
    assert.deepEqual(committed, [{ deleted: 25, noop: 0, worker_id: 'crash-after-commit' }]);
    assert.deepEqual(await audited(batch.batchId), { rows: 25, keys: 25 }, 'the committed deletion is audited');

    const fresh = startWorker('fresh-after-after-commit');
    const settled = await fresh.waitForLine('the redelivered batch to settle', (line) => line.msg === 'batch settled' && line.batchId === batch.batchId, 30_000);
    assert.equal(settled.outcome, 'duplicate', 'a redelivered committed batch is a duplicate');
    assert.equal(settled.deleted, 0, 'the duplicate deletes nothing');
    assert.equal(settled.deliveryCount, 2, 'the second delivery: the one the killed worker held, given back once');
    assert.deepEqual(await receipts(batch.batchId), committed, 'the receipt is unchanged (not overwritten, not doubled)');
    assert.deepEqual(await audited(batch.batchId), { rows: 25, keys: 25 }, 'the duplicate adds no audit row');
    assert.equal(await countReservations(world.bed.pool, seeded.futureHeld), 5);
    await eventually('the work queue to be empty', async () => (await readyInWorkQueue()) === 0);

    const stopped = await fresh.stop();
    assert.equal(stopped.code, 0, 'the fresh worker drains and exits 0');
    assert.equal(settledLines(fresh, batch.batchId).length, 1, 'the duplicate was settled exactly once');
    assert.equal(await readyAtRest(world.broker, world.names.workQueue('seat-holds')), 0, 'the duplicate was acked: nothing came back (read once no consumer holds a message)');
    assert.equal((await world.broker.drain(world.names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
  });
});
