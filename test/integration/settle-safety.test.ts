import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { after, before, describe, test } from 'node:test';
import { promisify } from 'node:util';
import amqp from 'amqplib';
import type { Channel, ChannelModel, ConsumeMessage } from 'amqplib';
import pino from 'pino';
import { ConfirmingPublisher, fixedConnection } from '../../shared/amqp/publisher';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { loadPolicies } from '../../shared/config/policies';
import { encodeBatch } from '../../shared/contracts/batch';
import { makeMetrics } from '../../shared/observability/metrics';
import { settle, type SettleDeps } from '../../services/worker/settle';
import { startWorker } from '../../services/worker/worker';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { makeRowBatch, rowDeletePolicyYaml } from '../support/fixtures';

/**
 * What happens after a batch's work is decided must never throw out of the consumer: a metrics or
 * logging bug after a commit is logged and the message is still acked (issue 7 item 4); a delay or
 * dead-letter publish the broker does not take leaves the message requeued, never lost.
 */
describe('settle and the consumer never throw, and never lose a message', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let connection: ChannelModel;
  let names: ReturnType<typeof brokerNames>;
  /** A classic queue of this file: its counts are exact the moment the broker answers. */
  let queue: string;

  before(async () => {
    bed = await makeTestBed('settle_safety');
    bed.writePolicies(rowDeletePolicyYaml());
    names = brokerNames(bed.prefix);
    queue = `${bed.prefix}.settle-probe`;
    connection = await amqp.connect(bed.amqpUrl);
    const setup = await connection.createChannel();
    await assertTopology(setup, makeTopology({ prefix: bed.prefix, policies: ['seat-holds'], deliveryLimit: 20 }));
    await setup.assertQueue(queue, { durable: true });
    await setup.assertExchange(`${bed.prefix}.delay-unbound`, 'headers', { durable: false });
    await setup.close();
    broker = await openTestBroker(bed.amqpUrl);
  });
  after(async () => {
    await broker?.close();
    await connection?.close();
    await bed?.close();
  });

  /** Log lines written by the code under test, parsed. */
  function capturingLogger(): { log: pino.Logger; lines: Array<Record<string, unknown>> } {
    const lines: Array<Record<string, unknown>> = [];
    const log = pino({ level: 'info' }, { write: (text: string) => void lines.push(JSON.parse(text) as Record<string, unknown>) });
    return { log, lines };
  }

  /** Publishes one message to the probe queue and takes its delivery on a fresh consumer channel. */
  async function deliveryOf(messageId: string): Promise<{ channel: Channel; message: ConsumeMessage }> {
    await broker.publish('', queue, '{}', { messageId });
    const channel = await connection.createChannel();
    const message = await new Promise<ConsumeMessage>((resolve) => {
      void channel.consume(queue, (delivered) => delivered && resolve(delivered));
    });
    return { channel, message };
  }

  function depsWith(overrides: Partial<ReturnType<typeof brokerNames>> = {}): SettleDeps {
    return { publisher: new ConfirmingPublisher(fixedConnection(connection), 2_000), names: { ...names, ...overrides }, metrics: makeMetrics(), deliveryLimit: 20 };
  }

  test('a committed batch whose counter throws (a negative no-op count) is still acked, and the bug is logged', async () => {
    const { log, lines } = capturingLogger();
    const { channel, message } = await deliveryOf('negative-noop');
    // One item deleted three rows (a key that is not unique): the receipt says noop = -2, and
    // prom-client's Counter.inc(-2) throws.
    const action = await settle(depsWith(), { channel, message, policy: 'seat-holds', deliveryCount: 1, log }, { kind: 'done', deleted: 3, noop: -2, duplicate: false });
    assert.equal(action, 'acked');
    assert.ok(lines.some((line) => line.level === 50 && /after the broker action/.test(String(line.msg))), JSON.stringify(lines));
    // Closing the channel would return an unacked message to the queue: nothing comes back.
    await channel.close();
    assert.equal(await broker.messageCount(queue), 0, 'the committed batch was acked');
  });

  test('a delay-tier publish the broker returns (no tier bound) requeues the message instead of losing it', async () => {
    const { log, lines } = capturingLogger();
    const { channel, message } = await deliveryOf('delay-unroutable');
    const action = await settle(depsWith({ delayExchange: `${bed.prefix}.delay-unbound` }), { channel, message, policy: 'seat-holds', deliveryCount: 1, log }, {
      kind: 'retry',
      delayMs: 1_000,
      reason: 'test',
    });
    assert.equal(action, 'requeued');
    assert.ok(lines.some((line) => /delay publish failed: unroutable/.test(String(line.reason))), JSON.stringify(lines));
    await channel.close();
    const back = await broker.drain(queue);
    assert.deepEqual(back.map((m) => [m.properties.messageId, m.fields.redelivered]), [['delay-unroutable', true]]);
  });

  test('a dead-letter publish the broker returns (no dead-letter queue) requeues the message instead of losing it', async () => {
    const { log, lines } = capturingLogger();
    const { channel, message } = await deliveryOf('dead-letter-unroutable');
    const action = await settle(depsWith({ deadLetterQueue: `${bed.prefix}.no-such-dead-letter` }), { channel, message, policy: 'seat-holds', deliveryCount: 1, log }, {
      kind: 'dead-letter',
      reason: 'invalid-json',
      detail: 'test',
    });
    assert.equal(action, 'requeued');
    assert.ok(lines.some((line) => /dead-letter publish failed: unroutable/.test(String(line.reason))), JSON.stringify(lines));
    await channel.close();
    const back = await broker.drain(queue);
    assert.deepEqual(back.map((m) => [m.properties.messageId, m.fields.redelivered]), [['dead-letter-unroutable', true]]);
  });

  test('a worker whose metrics throw after every commit stays alive, acks each batch and goes on', async () => {
    const { log, lines } = capturingLogger();
    const env = bed.env();
    const worker = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
    try {
      worker.metrics.itemsTotal.inc = () => {
        throw new Error('a metrics bug');
      };
      for (let round = 1; round <= 2; round++) {
        const seeded = await seedHolds(bed.pool, { expiredHeld: 4 });
        const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
        await broker.publish(names.workExchange, 'seat-holds', encodeBatch(batch), { messageId: batch.batchId });
        await eventually(`batch ${round} deleted`, async () => (await countReservations(bed.pool, seeded.expiredHeld)) === 0);
        await eventually(`batch ${round} acked (nothing ready or unacked in the work queue)`, async () => (await queueCounts(names.workQueue('seat-holds'))) === '0 0');
      }
      const errors = lines.filter((line) => line.level === 50 && /recording a settled batch failed/.test(String(line.msg)));
      assert.equal(errors.length, 2, 'each metrics failure is logged');
      const done = (await worker.metrics.batchesTotal.get()).values.filter((v) => v.labels.outcome === 'done').reduce((sum, v) => sum + v.value, 0);
      assert.equal(done, 2);
    } finally {
      await worker.stop();
    }
  });
});

/**
 * "<ready> <unacked>" for a queue, from the broker itself (a worker's unacked message counts).
 * rabbitmqctl, not the management API: the API's counts are as of its last statistics tick (5 s).
 */
async function queueCounts(queue: string): Promise<string | undefined> {
  const { stdout } = await promisify(execFile)('rabbitmqctl', ['list_queues', 'name', 'messages_ready', 'messages_unacknowledged', '-q', '--no-table-headers']);
  const line = stdout.split('\n').find((text) => text.split(/\s+/)[0] === queue);
  return line?.trim().split(/\s+/).slice(1).join(' ');
}
