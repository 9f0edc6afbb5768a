import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { connectAny, ReconnectingConnection } from '../../shared/amqp/connection';
import { makeTopology } from '../../shared/amqp/topology';
import { redactUrl } from '../../shared/observability/logger';
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

  // Ports 1 and 2 refuse at once on this machine: nothing listens there.
  const DEAD = 'amqp://guest:guest@127.0.0.1:1';
  const DEAD_TOO = 'amqp://guest:guest@127.0.0.1:2';

  test('the service connection skips dead URLs and connects to the next, without the backoff', async () => {
    // What the connection logs, as objects: each failed attempt names its URL and the backoff step it was at.
    const lines: Array<{ msg: string; url?: string; attempt?: number }> = [];
    const log = pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line) as (typeof lines)[number]) });
    const connection = new ReconnectingConnection({
      url: `${DEAD},${DEAD_TOO},${bed.amqpUrl}`,
      connectionName: `test-url-list ${bed.prefix}`,
      topology: makeTopology({ prefix: bed.prefix, policies: ['seat-holds'], deliveryLimit: 5 }),
      log,
    });
    try {
      await connection.start();
      assert.ok(connection.connected);
      // Not a time (a loaded machine is slow to connect either way): the backoff step each failure
      // was logged at. Skipping to the next URL keeps it at 0; a backoff after the first dead URL
      // would have logged the second one at step 1.
      const failed = lines.filter((line) => line.msg === 'amqp connect failed').map((line) => ({ url: line.url, attempt: line.attempt }));
      assert.deepEqual(failed, [{ url: redactUrl(DEAD), attempt: 0 }, { url: redactUrl(DEAD_TOO), attempt: 0 }], 'each dead URL failed once, with no backoff between them');
      assert.equal(lines.filter((line) => line.msg === 'amqp connected').length, 1);
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
