import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';
import { bedAndBrokerSuite } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { runUnderFault } from '../support/fault-run';
import { TcpProxy } from '../support/tcp-proxy';

/**
 * Network faults through a TCP proxy between the services and the servers: connections reset
 * mid-commit (the worker's DELETE reached PostgreSQL, the RST came before the answer) and
 * mid-publish (the scheduler's link to the broker reset while it publishes a window), and latency
 * added to every packet of every link. Each time the run completes and the checker reads zero.
 */
describe('network faults through a proxy', () => {
  let pgProxy: TcpProxy;
  let amqpProxy: TcpProxy;
  const world = bedAndBrokerSuite('fault_network', { alsoClose: [() => pgProxy?.close(), () => amqpProxy?.close()] });
  before(async () => {
    const database = new URL(world.bed.databaseUrl);
    const amqp = new URL(world.bed.amqpUrl);
    pgProxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
    amqpProxy = await TcpProxy.start({ targetHost: amqp.hostname, targetPort: Number(amqp.port || 5672) });
  });

  const cleanTables = async () => {
    await world.bed.pool.query('TRUNCATE seat_reservations, cleanup_holds, cleanup_batches');
  };

  test('PostgreSQL link reset mid-commit (three times): batches requeued, redeliveries are no-ops or finish the work, checker at zero', async () => {
    await cleanTables();
    const workerEnv = { DATABASE_URL: pgProxy.urlFor(world.bed.databaseUrl), REAPER_PREFETCH: '1' };
    await runUnderFault({
      bed: world.bed,
      broker: world.broker,
      policy: 'reset-commit',
      expired: 5_000,
      batchSize: 50,
      services: [
        { label: 'scheduler-a', kind: 'scheduler' },
        { label: 'worker-a1', kind: 'worker', env: workerEnv },
        { label: 'worker-a2', kind: 'worker', env: workerEnv },
      ],
      async inject({ afterBatches, recovery, workers }) {
        const recoveries = [];
        for (let i = 1; i <= 3; i++) {
          await afterBatches(5 * i);
          // The row-delete DELETE is a named statement: after a connection's first execution only its name travels.
          const link = await pgProxy.holdRepliesAfter(/DELETE FROM|reaper_row_delete_/);
          pgProxy.reset(link);
          recoveries.push(await recovery(`postgres link reset mid-commit #${i}`, Date.now()));
        }
        await eventually('a worker to requeue a batch whose outcome it does not know', () =>
          workers.some((w) => w.lines.some((line) => line.msg === 'batch outcome unknown; requeued')),
        );
        return recoveries;
      },
    });
  });

  test('broker link reset mid-publish: the scheduler reconnects, retries its window, nothing is published under two batch ids, checker at zero', async () => {
    await cleanTables();
    await amqpProxy.close().catch(() => undefined);
    const amqp = new URL(world.bed.amqpUrl);
    amqpProxy = await TcpProxy.start({ targetHost: amqp.hostname, targetPort: Number(amqp.port || 5672) });
    await runUnderFault({
      bed: world.bed,
      broker: world.broker,
      policy: 'reset-publish',
      expired: 20_000,
      batchSize: 20,
      services: [
        { label: 'scheduler-b', kind: 'scheduler', env: { AMQP_URL: amqpProxy.urlFor(world.bed.amqpUrl) } },
        { label: 'worker-b1', kind: 'worker' },
        { label: 'worker-b2', kind: 'worker' },
      ],
      async inject({ scheduler, recovery }) {
        // Mid-publish: once the scheduler has sent about 100 KB of batches through the proxy.
        const start = amqpProxy.bytesUp;
        await eventually('the scheduler to be publishing', () => amqpProxy.bytesUp - start > 100_000, { timeoutMs: 30_000, intervalMs: 5 });
        const reset = amqpProxy.resetAll();
        assert.equal(reset, 1, "the scheduler's one broker connection was reset");
        const endedAt = Date.now();
        await scheduler.waitForLine('the scheduler to reconnect', (line) => line.msg === 'amqp connection closed; reconnecting');
        return [await recovery('broker link reset mid-publish', endedAt)];
      },
    });
  });

  test('20 ms added to every packet on every link (PostgreSQL and broker, both ways): the run completes, checker at zero', async () => {
    await cleanTables();
    pgProxy.latencyMs = 20;
    amqpProxy.latencyMs = 20;
    try {
      const env = { DATABASE_URL: pgProxy.urlFor(world.bed.databaseUrl), AMQP_URL: amqpProxy.urlFor(world.bed.amqpUrl) };
      const report = await runUnderFault({
        bed: world.bed,
        broker: world.broker,
        policy: 'latency',
        expired: 2_000,
        batchSize: 50,
        services: [
          { label: 'scheduler-c', kind: 'scheduler', env },
          { label: 'worker-c1', kind: 'worker', env },
          { label: 'worker-c2', kind: 'worker', env },
        ],
        async inject() {
          return [];
        },
      });
      assert.equal(report.lost + report.wrongful + report.doubled + report.stuck, 0);
    } finally {
      pgProxy.latencyMs = 0;
      amqpProxy.latencyMs = 0;
    }
  });
});
