import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { encodeBatch } from '../../shared/contracts/batch';
import { openTestBroker, type TestBroker } from '../support/broker';
import { makeRowBatch, readyAtRest, rowDeletePolicyYaml } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli, startReaper } from '../support/processes';
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
  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

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
    assert.equal(await broker.messageCount(names.deadLetterQueue), 2, 'listing takes nothing away');

    const requeued = await runReaperCli(['dlq', 'requeue', '--reason', 'delivery-limit', '--json'], bed.processEnv());
    assert.equal(requeued.code, 0, requeued.stdout);
    assert.deepEqual(JSON.parse(requeued.stdout), { requeued: 1, skipped: 1 });
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
});
