import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { connectAny, ReconnectingConnection } from '../../shared/amqp/connection';
import { makeTopology } from '../../shared/amqp/topology';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * AMQP_URL as a list: a URL whose broker does not answer is passed over for the next one, at the
 * first connect and by the one-off CLI connections. (Failing over between the nodes of a real
 * cluster is test/cluster/cluster-node-lost.test.ts.)
 */
describe('AMQP_URL with several brokers', () => {
  let bed: TestBed;
  before(async () => {
    bed = await makeTestBed('amqp_url_list');
  });
  after(async () => {
    await bed?.close();
  });

  // Port 1 refuses at once on this machine: nothing listens there.
  const DEAD = 'amqp://guest:guest@127.0.0.1:1';

  test('the service connection skips a dead URL and connects to the next, without the backoff', async () => {
    const connection = new ReconnectingConnection({
      url: `${DEAD},${bed.amqpUrl}`,
      connectionName: `test-url-list ${bed.prefix}`,
      topology: makeTopology({ prefix: bed.prefix, policies: ['seat-holds'], deliveryLimit: 5 }),
      log: pino({ level: 'silent' }),
    });
    const started = Date.now();
    try {
      await connection.start();
      assert.ok(connection.connected);
      assert.ok(Date.now() - started < 2_000, `connected within 2 s (${Date.now() - started} ms)`);
    } finally {
      await connection.close();
    }
  });

  test('one-off connections (CLI) take the first URL that answers', async () => {
    const model = await connectAny(`${DEAD}, ${bed.amqpUrl}`, { timeout: 5_000 });
    await model.close();
    await assert.rejects(connectAny(`${DEAD},${DEAD}`, { timeout: 2_000 }), /ECONNREFUSED/);
  });
});
