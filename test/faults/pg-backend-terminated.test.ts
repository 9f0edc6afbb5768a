import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';
import { bedAndBrokerSuite } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { runUnderFault } from '../support/fault-run';
import { type ReaperProcess } from '../support/processes';
import { TcpProxy } from '../support/tcp-proxy';

/**
 * PostgreSQL fault: a worker's backend is terminated (pg_terminate_backend) between its DELETE and
 * the answer to it. The worker's DELETE and receipt are one statement that commits by itself; the
 * worker reaches the database through a proxy that lets the statement through and then holds the
 * server's answer back. The test waits until the backend is idle again (the statement committed),
 * terminates it, and drops the held answer: the worker sees its connection die with the commit's
 * outcome unknown. It must treat the batch as unknown (requeue, never ack), and the redelivery
 * must find the receipt and count a no-op. The run completes; the checker reads zero.
 */
describe('PostgreSQL backend terminated between the DELETE and the commit answer', () => {
  let proxy: TcpProxy;
  const world = bedAndBrokerSuite('fault_pg_terminate', { alsoClose: [() => proxy?.close()] });
  before(async () => {
    const database = new URL(world.bed.databaseUrl);
    proxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
  });

  test('committed but unanswered: the batch is requeued, its redelivery is a counted no-op, checker at zero', async () => {
    const workerEnv = { DATABASE_URL: proxy.urlFor(world.bed.databaseUrl), REAPER_PREFETCH: '1' };
    let terminatedPid = 0;
    let allWorkers: ReaperProcess[] = [];
    await runUnderFault({
      bed: world.bed,
      broker: world.broker,
      expired: 6_000,
      batchSize: 50,
      services: [
        { label: 'scheduler', kind: 'scheduler' },
        { label: 'worker-1', kind: 'worker', env: workerEnv },
        { label: 'worker-2', kind: 'worker', env: workerEnv },
      ],
      async inject({ afterBatches, recovery, workers }) {
        await afterBatches(10);
        // Row-delete groups run BEGIN / DELETE / COMMIT: holding the answers after the COMMIT leaves
        // the deletion committed and the worker without its answer.
        const link = await proxy.holdRepliesAfter(/\bCOMMIT\b/);
        const pid = link.backendPid;
        assert.ok(pid, 'the proxy read the backend pid of the link');
        // The statement ran and committed once its backend is idle again; only its answer is missing.
        await eventually(
          'the held DELETE to commit',
          async () => (await world.bed.pool.query<{ state: string }>('SELECT state FROM pg_stat_activity WHERE pid = $1', [pid])).rows[0]?.state === 'idle',
          { timeoutMs: 10_000, intervalMs: 10 },
        );
        const terminated = await world.bed.pool.query<{ ok: boolean }>('SELECT pg_terminate_backend($1) AS ok', [pid]);
        assert.equal(terminated.rows[0]!.ok, true);
        terminatedPid = pid;
        const endedAt = Date.now();
        proxy.drop(link);
        allWorkers = workers;
        await eventually('the worker to report the outcome as unknown', () =>
          workers.find((w) => w.lines.some((line) => line.msg === 'batch outcome unknown; requeued')),
        );
        return [await recovery('backend terminated mid-commit', endedAt)];
      },
    });
    assert.ok(terminatedPid > 0);
    // The redelivery of the batch whose answer was lost found its receipt: a counted no-op.
    const duplicates = allWorkers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'duplicate'));
    assert.ok(duplicates.length >= 1, 'the redelivered batch settled as a duplicate');
    assert.deepEqual(duplicates.filter((line) => line.deleted !== 0), [], 'a duplicate deletes nothing');
  });
});
