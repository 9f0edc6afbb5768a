import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { encodeBatch } from '../../shared/contracts/batch';
import { openTestBroker, type TestBroker } from '../support/broker';
import { closeBedAndBroker, makeRowBatch, readyAtRest, rowDeletePolicyYaml } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { runReaperCli, startReaper } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The operator's way back from the dead-letter queue: `reaper dlq list` shows reasons without
 * taking anything, `reaper dlq requeue` sends a batch back to its work queue (a worker then does
 * it), `reaper dlq purge` needs --yes.
 */
describe('dead-letter commands', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    bed = await makeTestBed('dlq_cli');
    bed.writePolicies(rowDeletePolicyYaml());
    names = brokerNames(bed.prefix);
    // The topology exists before any service starts, as after `kubectl apply` of the definitions.
    const connection = await amqp.connect(bed.amqpUrl);
    const channel = await connection.createChannel();
    await assertTopology(channel, makeTopology({ prefix: bed.prefix, policies: ['seat-holds'], deliveryLimit: 20 }));
    await connection.close();
    broker = await openTestBroker(bed.amqpUrl);
  });
  after(() => closeBedAndBroker({ bed, broker }));

  test('list shows the reason and keeps the message; requeue sends it back and a worker deletes its rows', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 7 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    const runId = batch.runId;
    // As a worker leaves it after a batch failed on every delivery (e.g. a long database outage).
    await broker.publish('', names.deadLetterQueue, encodeBatch(batch), {
      messageId: batch.batchId,
      headers: { 'x-run-id': runId, 'x-reaper-reason': 'delivery-limit', 'x-reaper-detail': 'failed on 20 deliveries', 'x-reaper-original-routing-key': 'seat-holds' },
    });
    // One more that must stay: requeue takes only the reason asked for.
    await broker.publish('', names.deadLetterQueue, '{"version": 1, "items": [', {
      messageId: 'broken-1',
      headers: { 'x-reaper-reason': 'invalid-json', 'x-reaper-detail': 'Unexpected end of JSON input', 'x-reaper-original-routing-key': 'seat-holds' },
    });

    const listed = await runReaperCli(['dlq', 'list', '--json'], bed.processEnv());
    assert.equal(listed.code, 0, listed.stdout);
    const views = JSON.parse(listed.stdout) as Array<{ messageId: string; reason: string; policy: string }>;
    assert.deepEqual(
      views.map((v) => [v.messageId, v.reason, v.policy]),
      [
        [batch.batchId, 'delivery-limit', 'seat-holds'],
        ['broken-1', 'invalid-json', 'seat-holds'],
      ],
    );
    // Listing reads the messages unacked and returns them when its channel closes: the broker puts
    // them back as ready a moment after the command exits (a loaded broker read 0 here at once).
    await eventually('listing to take nothing away (both messages ready again)', async () => (await broker.messageCount(names.deadLetterQueue)) === 2);

    const requeued = await runReaperCli(['dlq', 'requeue', '--reason', 'delivery-limit', '--json'], bed.processEnv());
    assert.equal(requeued.code, 0, requeued.stdout);
    assert.deepEqual(JSON.parse(requeued.stdout), { requeued: 1, skipped: 1, failed: 0, failures: [] });
    await eventually('the batch back in its work queue', async () => (await broker.messageCount(names.workQueue('seat-holds'))) === 1);
    // A quorum queue's message count settles a moment after the acks: poll it.
    await eventually('the invalid one alone to stay', async () => (await broker.messageCount(names.deadLetterQueue)) === 1);

    const worker = startReaper('worker', ['worker'], bed.processEnv());
    await eventually('the requeued batch to be done', async () => (await countReservations(bed.pool, seeded.expiredHeld)) === 0);
    assert.equal((await worker.stop()).code, 0);
    assert.equal(await readyAtRest(broker, names.workQueue('seat-holds')), 0, 'the requeued batch was acked, not returned');

    const refused = await runReaperCli(['dlq', 'purge'], bed.processEnv());
    assert.equal(refused.code, 2, 'purge without --yes is a usage error');
    // Read once, not "eventually": the count was already 1 (settled above) and a refused purge must not change it.
    assert.equal(await readyAtRest(broker, names.deadLetterQueue), 1, 'the invalid one is still there after the refused purge');
    const purged = await runReaperCli(['dlq', 'purge', '--yes', '--json'], bed.processEnv());
    assert.equal(purged.code, 0, purged.stdout);
    assert.deepEqual(JSON.parse(purged.stdout), { purged: 1 });
    assert.equal(await readyAtRest(broker, names.deadLetterQueue), 0, 'purged');
  });

  test('a dead letter whose work queue is gone stays in the dead-letter queue, is reported, and the command exits 1', async () => {
    // A second work queue that exists, so one run of the command both succeeds and fails.
    const connection = await amqp.connect(bed.amqpUrl);
    const channel = await connection.createChannel();
    const otherQueue = `${bed.prefix}.cleanup.other`;
    await channel.assertQueue(otherQueue, { durable: true });
    await channel.bindQueue(otherQueue, names.workExchange, 'other');
    // An operator deleted seat-holds' work queue (or the policy was retired): its key routes nowhere.
    await channel.deleteQueue(names.workQueue('seat-holds'));
    await connection.close();
    const deadLetter = (messageId: string, policy: string) =>
      broker.publish('', names.deadLetterQueue, '{}', {
        messageId,
        headers: { 'x-reaper-reason': 'delivery-limit', 'x-reaper-detail': 'failed on 20 deliveries', 'x-reaper-original-routing-key': policy },
      });
    await deadLetter('orphan-1', 'seat-holds');
    await deadLetter('routable-1', 'other');

    const text = await runReaperCli(['dlq', 'requeue'], bed.processEnv());
    assert.equal(text.code, 1, text.stdout);
    assert.match(text.stdout, /requeued 1, left 1 in the dead-letter queue/);
    assert.match(text.stdout, /1 could not be requeued and stayed in the dead-letter queue/);
    assert.match(text.stdout, /orphan-1 \(policy seat-holds\): unroutable/);
    assert.deepEqual((await broker.drain(otherQueue)).map((m) => m.properties.messageId), ['routable-1']);
    await eventually('the orphan to be still in the dead-letter queue', async () => (await broker.messageCount(names.deadLetterQueue)) === 1);

    const json = await runReaperCli(['dlq', 'requeue', '--json'], bed.processEnv());
    assert.equal(json.code, 1, json.stdout);
    const result = JSON.parse(json.stdout) as { requeued: number; skipped: number; failed: number; failures: Array<{ messageId: string; policy: string; error: string }> };
    assert.deepEqual([result.requeued, result.skipped, result.failed], [0, 0, 1]);
    assert.deepEqual(result.failures.map((f) => [f.messageId, f.policy]), [['orphan-1', 'seat-holds']]);
    assert.match(result.failures[0]!.error, /unroutable/);
    await eventually('the orphan to be still there after the second attempt', async () => (await broker.messageCount(names.deadLetterQueue)) === 1);
    const [kept] = await broker.drain(names.deadLetterQueue);
    assert.equal(kept?.properties.messageId, 'orphan-1');
    assert.equal(kept?.properties.headers?.['x-reaper-reason'], 'delivery-limit', 'the dead letter is kept as it was');
  });
});
