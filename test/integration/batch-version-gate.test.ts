import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type ConsumeMessage } from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { eventually } from '../support/eventually';
import { rowDeletePolicyYaml, runRow, stopAllCleanly, triggerRunId } from '../support/fixtures';
import { assertNoLeakedProcesses, startReaper, stopLeftovers, type ReaperProcess } from '../support/processes';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The scheduler upgraded first: told to publish version 2 (REAPER_BATCH_VERSION=2) while a
 * consumer that announces nothing is connected (a worker of a release before announcements; here
 * a bare AMQP consumer), it publishes version 1 and says why; once that consumer is gone, version 2.
 */
describe('batch version gate: scheduler upgraded before its workers', () => {
  let bed: TestBed;
  let connection: ChannelModel;
  let channel: Channel;

  before(async () => {
    bed = await makeTestBed('version_gate');
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 10 }));
    connection = await amqp.connect(bed.amqpUrl);
    channel = await connection.createChannel();
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await connection?.close().catch(() => undefined); // already closed: nothing to release
      await bed?.close();
    }
  });

  test('an unannounced consumer holds the scheduler at version 1; without it, version 2 is published', async () => {
    const names = brokerNames(bed.prefix);
    const scheduler: ReaperProcess = startReaper('scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'scheduler', REAPER_BATCH_VERSION: '2' }));
    let passed = false;
    try {
      await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 60_000);
      const received: Array<{ version: number; policyVersion?: string; runId: string }> = [];
      const { consumerTag } = await channel.consume(names.workQueue('seat-holds'), (message: ConsumeMessage | null) => {
        if (!message) return;
        received.push(JSON.parse(message.content.toString('utf8')) as { version: number; runId: string });
        channel.ack(message);
      });
      const runOnce = async (): Promise<string> => {
        await seedHolds(bed.pool, { expiredHeld: 25 });
        const runId = await triggerRunId(bed, 'seat-holds');
        await eventually('the run to be published', async () => (await runRow(bed.pool, runId)).state === 'published', { timeoutMs: 30_000 });
        return runId;
      };

      const first = await runOnce();
      await eventually('the batches of the first run', () => received.filter((b) => b.runId === first).length === 3);
      assert.deepEqual([...new Set(received.filter((b) => b.runId === first).map((b) => b.version))], [1], 'held at version 1');
      const holding = scheduler.lines.find((line) => line.msg === 'holding batch version at 1 (REAPER_BATCH_VERSION=2)');
      assert.ok(holding, 'the scheduler says it holds at version 1');
      assert.match(String(holding.reason), /1 consumer\(s\) on the work queue but only 0 announce version 2/);

      // The unannounced consumer goes away: nothing objects to version 2 any more.
      await channel.cancel(consumerTag);
      const second = await runOnce();
      // Its cutoff also covers the first run's rows (a bare consumer deletes nothing).
      const expected = (await runRow(bed.pool, second)).batches_confirmed;
      const drained: Array<{ version: number; policyVersion?: string; runId: string }> = [];
      await eventually('the batches of the second run', async () => {
        for (;;) {
          const message = await channel.get(names.workQueue('seat-holds'), { noAck: true });
          if (message === false) break;
          drained.push(JSON.parse(message.content.toString('utf8')) as { version: number; runId: string });
        }
        return drained.filter((b) => b.runId === second).length === expected;
      });
      for (const batch of drained) {
        assert.equal(batch.version, 2);
        assert.match(String(batch.policyVersion), /^[0-9a-f]{16}$/, 'version 2 carries the policy version');
      }
      assert.ok(scheduler.lines.some((line) => line.msg === 'publishing batch version 2'), 'and says so');
      await stopAllCleanly([scheduler]);
      passed = true;
    } finally {
      if (!passed) await stopLeftovers([scheduler]);
    }
  });
});
