import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { setTimeout as delay } from 'node:timers/promises';
import { Writable } from 'node:stream';
import amqp from 'amqplib';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { SWEEP_INTERVAL_MS } from '../../services/worker/ledger-sweeper';
import { type TestBroker } from '../support/broker';
import { closeBedAndBroker, openBedAndBroker, startInProcessWorker } from '../support/fixtures';
import { MEDIA_POLICY, mediaPolicyYaml } from '../support/remote-helpers';
import { type TestBed } from '../support/testbed';

/**
 * A worker whose start fails leaves nothing running (issue 43, the promise of e8c7922): its ledger
 * sweeper starts only once the worker has started. Before, a remote-delete worker started the
 * sweeper before the broker connection, so a start that failed (here: the work queue is held by
 * the broker with another x-delivery-limit, which retrying cannot fix) closed the pool under a
 * sweeper that went on passing every second, logging "ledger sweep failed" for as long as the
 * process lived. The CLI exits on such a failure; anything that starts a worker in its own
 * process (the tests, an embedding) kept the timer.
 */
describe('a worker whose start fails', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    ({ bed, broker, names } = await openBedAndBroker('worker_start_failed', mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 10, burst: 1, concurrency: 1 })));
  });
  after(() => closeBedAndBroker({ bed, broker }));

  test('rejects naming the conflict, and no ledger sweeper passes after it', async () => {
    const lines: Array<{ msg?: string; err?: string }> = [];
    const log = pino({ level: 'debug' }, new Writable({ write: (chunk, _encoding, done) => (lines.push(JSON.parse(String(chunk))), done()) }));
    const connection = await amqp.connect(bed.amqpUrl);
    const channel = await connection.createChannel();
    const queue = names.workQueue(MEDIA_POLICY);
    await channel.assertQueue(queue, {
      durable: true,
      arguments: { 'x-queue-type': 'quorum', 'x-delivery-limit': 5, 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': names.deadLetterQueue },
    });
    try {
      await assert.rejects(startInProcessWorker(bed, { REAPER_DELIVERY_LIMIT: '20' }, log), /x-delivery-limit/);
      const failedAt = lines.length;
      // Absence needs a window: three of the sweeper's periods, each of which would have logged a pass.
      await delay(3 * SWEEP_INTERVAL_MS);
      const sweeps = lines.slice(failedAt).filter((line) => /ledger sweep/.test(line.msg ?? ''));
      assert.deepEqual(sweeps, [], 'no sweeper pass after the failed start');
    } finally {
      await channel.deleteQueue(queue);
      await connection.close();
    }
  });
});
