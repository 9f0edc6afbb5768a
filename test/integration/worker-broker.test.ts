import assert from 'node:assert/strict';
import { createServer } from 'node:net';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { encodeBatch } from '../../shared/contracts/batch';
import { type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { TcpProxy } from '../support/tcp-proxy';
import { startReaper, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';
import { closeBedAndBroker, makeRowBatch, openBedAndBroker, rowDeletePolicyYaml } from '../support/fixtures';

/**
 * The worker and the broker's own decisions: a queue the broker holds with other arguments
 * (exit 1, naming it, instead of retrying forever), a broker that does not answer (alive, not
 * ready), and a consumer the broker cancels because its queue was deleted (consumed again).
 */
describe('worker against the broker', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    ({ bed, broker, names } = await openBedAndBroker('worker_broker', rowDeletePolicyYaml()));
  });
  after(() => closeBedAndBroker({ bed, broker }));

  /** A port nothing listens on: bound once by the OS, then released. */
  async function closedPort(): Promise<number> {
    const server = createServer();
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const port = (server.address() as { port: number }).port;
    await new Promise<void>((resolve) => server.close(() => resolve()));
    return port;
  }

  async function exitWithin(process: ReaperProcess, ms: number): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<'timeout'>((resolve) => (timer = setTimeout(() => resolve('timeout'), ms)));
    const outcome = await Promise.race([process.exited, timeout]);
    clearTimeout(timer);
    if (outcome === 'timeout') {
      await process.stop(1_000);
      assert.fail(`${process.label} did not exit within ${ms} ms; last output: ${process.output.slice(-4).join(' | ')}`);
    }
    return outcome;
  }

  test('/livez answers 200 while the broker is unreachable, /readyz 503', async () => {
    const httpPort = await closedPort();
    const amqpPort = await closedPort();
    const worker = startReaper('worker-no-broker', ['worker'], bed.processEnv({ HTTP_PORT: String(httpPort), AMQP_URL: `amqp://guest:guest@127.0.0.1:${amqpPort}` }));
    const base = `http://127.0.0.1:${httpPort}`;
    await eventually('/livez to answer', async () => (await fetch(`${base}/livez`)).status === 200, { describe: () => worker.output.slice(-4) });
    await worker.waitForLine('a failed broker connect', (line) => line.msg === 'amqp connect failed');
    assert.equal((await fetch(`${base}/livez`)).status, 200);
    assert.equal((await fetch(`${base}/readyz`)).status, 503);
    await worker.stop();
  });

  for (const kind of ['worker', 'scheduler'] as const) {
    test(`a ${kind} whose work queue the broker holds with another x-delivery-limit exits 1 naming the queue and the argument`, async () => {
      const connection = await amqp.connect(bed.amqpUrl);
      const channel = await connection.createChannel();
      const queue = names.workQueue('seat-holds');
      await channel.deleteQueue(queue);
      // As if pre-declared from definitions made with REAPER_DELIVERY_LIMIT=5; the service runs with 20.
      await channel.assertQueue(queue, {
        durable: true,
        arguments: { 'x-queue-type': 'quorum', 'x-delivery-limit': 5, 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': names.deadLetterQueue },
      });
      try {
        const service = startReaper(`${kind}-conflict`, [kind], bed.processEnv({ REAPER_DELIVERY_LIMIT: '20' }));
        const exit = await exitWithin(service, 20_000);
        assert.deepEqual(exit, { code: 1, signal: null }, service.output.slice(-4).join('\n'));
        const printed = service.output.find((line) => line.startsWith('reaper: '));
        assert.ok(printed, `the CLI prints the reason; output: ${service.output.slice(-4).join(' | ')}`);
        assert.match(printed, /x-delivery-limit/);
        assert.match(printed, new RegExp(`queue '${queue.replace(/[.]/g, '\\.')}'`));
        assert.ok(!service.output.some((line) => /^\s+at /.test(line)), 'no stack trace');
      } finally {
        await channel.deleteQueue(queue);
        await connection.close();
      }
    });
  }

  test('a work queue deleted under a running worker is declared again and consumed: a batch for it is deleted', async () => {
    const worker = startReaper('worker-cancelled', ['worker'], bed.processEnv({ HTTP_PORT: '0' }));
    const started = await worker.waitForLine('started', (line) => line.msg === 'worker started');
    const base = `http://127.0.0.1:${String(started.httpPort)}`;
    assert.equal((await fetch(`${base}/readyz`)).status, 200);

    const connection = await amqp.connect(bed.amqpUrl);
    const channel = await connection.createChannel();
    await channel.deleteQueue(names.workQueue('seat-holds'));
    await connection.close();
    await worker.waitForLine('the cancel noticed', (line) => line.msg === 'consumer cancelled by the broker (queue deleted or moved); re-declaring and consuming again');
    await worker.waitForLine('consuming again', (line) => line.msg === 'consuming again after the broker cancelled the consumer');
    await eventually('ready again', async () => (await fetch(`${base}/readyz`)).status === 200);

    const seeded = await seedHolds(bed.pool, { expiredHeld: 5 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    await broker.publish(names.workExchange, 'seat-holds', encodeBatch(batch), { messageId: batch.batchId, mandatory: true });
    await eventually('the batch to be deleted', async () => (await countReservations(bed.pool, seeded.expiredHeld)) === 0);
    assert.deepEqual(await worker.stop(), { code: 0, signal: null });
  });

  test('a queue with other arguments found at a reconnect: the running worker exits 1 naming the queue and the argument', async () => {
    // The worker reaches the broker through a proxy that can refuse it: the queue is replaced while
    // the worker is cut off, so it sees no consumer cancel (whose re-declare would find the conflict
    // first) and can only find the new arguments when it reconnects.
    const target = new URL(bed.amqpUrl);
    const proxy = await TcpProxy.start({ targetHost: target.hostname, targetPort: Number(target.port || 5672) });
    const worker = startReaper('worker-conflict-later', ['worker'], bed.processEnv({ REAPER_DELIVERY_LIMIT: '20', AMQP_URL: proxy.urlFor(bed.amqpUrl) }));
    const queue = names.workQueue('seat-holds');
    const connection = await amqp.connect(bed.amqpUrl);
    const channel = await connection.createChannel();
    try {
      await worker.waitForLine('started', (line) => line.msg === 'worker started');
      proxy.refusing = true;
      assert.ok(proxy.resetAll() > 0, 'the worker had no broker connection through the proxy');
      await worker.waitForLine('a refused reconnect', (line) => line.msg === 'amqp connect failed');
      await channel.deleteQueue(queue);
      await channel.assertQueue(queue, {
        durable: true,
        arguments: { 'x-queue-type': 'quorum', 'x-delivery-limit': 5, 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': names.deadLetterQueue },
      });
      proxy.refusing = false;
      const exit = await exitWithin(worker, 20_000);
      assert.deepEqual(exit, { code: 1, signal: null }, worker.output.slice(-4).join('\n'));
      const fatal = worker.lines.find((line) => line.msg === 'broker topology conflict: the worker exits 1');
      assert.ok(fatal, worker.output.slice(-4).join('\n'));
      assert.match(String(fatal.err), /x-delivery-limit/);
      assert.match(String(fatal.err), new RegExp(`queue '${queue.replace(/[.]/g, '\\.')}'`));
      assert.ok(!worker.lines.some((line) => line.msg === 'consumer cancelled by the broker (queue deleted or moved); re-declaring and consuming again'), 'found by the cancel path, not at the reconnect');
    } finally {
      await worker.stop(1_000);
      await channel.deleteQueue(queue);
      await connection.close();
      await proxy.close();
    }
  });
});
