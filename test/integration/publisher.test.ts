import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher, PublishError } from '../../shared/amqp/publisher';
import { brokerNames, makeTopology } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from '../support/broker';
import { makeTestBed, type TestBed } from '../support/testbed';

/** The confirming publisher: success means confirmed AND routed; anything else is a PublishError. */
describe('confirming publisher', () => {
  let bed: TestBed;
  let connection: ReconnectingConnection;
  let publisher: ConfirmingPublisher;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    bed = await makeTestBed('publisher');
    names = brokerNames(bed.prefix);
    connection = new ReconnectingConnection({
      url: bed.amqpUrl,
      connectionName: `test-publisher ${bed.prefix}`,
      topology: makeTopology({ prefix: bed.prefix, policies: ['seat-holds'], deliveryLimit: 5 }),
      log: pino({ level: 'silent' }),
    });
    publisher = new ConfirmingPublisher(connection, 2_000);
    await connection.start();
    broker = await openTestBroker(bed.amqpUrl);
  });
  after(async () => {
    await broker?.close();
    await connection?.close();
    await bed?.close();
  });

  test('a routed message resolves once confirmed and is in the queue', async () => {
    await publisher.publish(names.workExchange, 'seat-holds', Buffer.from('{}'), { messageId: 'routed-1' });
    const messages = await broker.drain(names.workQueue('seat-holds'));
    assert.deepEqual(messages.map((m) => m.properties.messageId), ['routed-1']);
  });

  test('an unroutable message (no queue bound for the key) is a PublishError, not a silent success', async () => {
    await assert.rejects(
      publisher.publish(names.workExchange, 'no-such-policy', Buffer.from('{}'), { messageId: 'lost-1' }),
      (error: unknown) => error instanceof PublishError && /unroutable/.test(error.message),
    );
  });

  test('a publish to a missing exchange fails (channel closed) and the publisher recovers', async () => {
    await assert.rejects(publisher.publish(`${bed.prefix}.missing`, 'x', Buffer.from('{}'), {}), PublishError);
    // Only the channel died, not the connection: the next publish opens a new confirm channel.
    await publisher.publish(names.workExchange, 'seat-holds', Buffer.from('{}'), { messageId: 'after-error' });
    const messages = await broker.drain(names.workQueue('seat-holds'));
    assert.deepEqual(messages.map((m) => m.properties.messageId), ['after-error']);
  });

  test('two publishes in flight with one message id: the return fails the unroutable one, not the other', async () => {
    // Returns are matched by message id; publishes sharing one run one after the other, so a return
    // (and an ack with `multiple` covering both) can never be charged to the routed publish.
    const outcomes = await Promise.allSettled([
      publisher.publish(names.workExchange, 'seat-holds', Buffer.from('{}'), { messageId: 'same-id' }),
      publisher.publish(names.workExchange, 'no-such-policy', Buffer.from('{}'), { messageId: 'same-id' }),
    ]);
    assert.deepEqual(
      outcomes.map((outcome) => outcome.status),
      ['fulfilled', 'rejected'],
    );
    assert.match(String((outcomes[1] as PromiseRejectedResult).reason), /unroutable/);
    const messages = await broker.drain(names.workQueue('seat-holds'));
    assert.deepEqual(messages.map((m) => m.properties.messageId), ['same-id']);
  });
});
