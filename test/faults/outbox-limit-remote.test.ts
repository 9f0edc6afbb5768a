import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type GetMessage } from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import type { ExpiryEventV2 } from '../../shared/contracts/expiry-event';
import { outboxEventCount } from '../../shared/db/queries/outbox';
import { stopAllCleanly } from '../support/fixtures';
import { drainQueue } from '../support/broker';
import { eventually } from '../support/eventually';
import { runReaperCli, startReaper, type ReaperProcess } from '../support/processes';
import { allConfirmed, assetStatuses, ledgerRows, ledgerSummary, MEDIA_POLICY, remoteWorldSuite, seedAssets, startRemoteServices } from '../support/remote-helpers';

/**
 * remote-delete past `events.maxOutbox` (docs/guardrails.md "Expiry events", services/worker/outbox-limit.ts):
 * with no relay running the outbox only grows; once it holds the limit the policy makes no more
 * remote calls (its batches wait in a delay tier, reason `outbox-full`, and come back paused
 * again), `reaper status` says why, and nothing is lost: once a relay drains the outbox the
 * paused batches delete the rest, and every deletion's event arrives. (row-delete's pause:
 * test/faults/relay-crash.test.ts.)
 */
const MAX_OUTBOX = 3;
const BATCH_SIZE = 2;
const ASSETS = 10;

describe('remote-delete: the expiry-event outbox limit pauses deletions until the relay catches up', () => {
  const world = remoteWorldSuite('outbox_limit_remote', {
    ratePerSecond: 50,
    burst: 10,
    concurrency: 4,
    batchSize: BATCH_SIZE,
    events: { maxOutbox: MAX_OUTBOX },
  });
  let consumer: ChannelModel;
  let channel: Channel;
  const queue = () => `${world.bed.prefix}.events-consumer`;

  before(async () => {
    // A consumer's own queue bound to the policy's routing key (an unroutable event is not confirmed).
    consumer = await amqp.connect(world.bed.amqpUrl);
    channel = await consumer.createChannel();
    const exchange = brokerNames(world.bed.prefix).eventsExchange;
    await channel.assertExchange(exchange, 'topic', { durable: true });
    // Not exclusive: the world's close (an earlier after hook) deletes it with the prefix's other queues.
    await channel.assertQueue(queue(), { durable: false });
    await channel.bindQueue(queue(), exchange, `${MEDIA_POLICY}.expired`);
  });
  after(() => consumer?.close());

  const drainEvents = () => drainQueue(channel, queue());

  const outboxCount = () => outboxEventCount(world.bed.pool, MEDIA_POLICY);

  // A paused batch asks again after 2 s, not the production 10 s (shared/config/test-timings.ts):
  // the test waits for it twice (back still paused, back after the relay drained the outbox).
  const SHORT_RETRY = { REAPER_TEST_OUTBOX_FULL_RETRY_MS: '2000' };

  test('past the limit no remote call, the status says why, nothing lost; the relay drains and deletion resumes', async () => {
    const ids = await seedAssets(world.bed.pool, 'outbox', ASSETS);
    // One batch at a time: what is deleted before the pause is this worker's own, so it is bounded exactly.
    const { workers, all } = await startRemoteServices(world.bed, { scheduler: 'outbox-scheduler', workers: ['outbox-worker'], workerEnv: { REAPER_PREFETCH: '1', ...SHORT_RETRY } });
    const worker = workers[0]!;
    let relay: ReaperProcess | null = null;
    try {
      assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], world.bed.processEnv())).code, 0);
      const first = await worker.waitForLine('a batch delayed because the outbox is full', (line) => line.msg === 'batch delayed' && line.reason === 'outbox-full', 30_000);
      const callsAtPause = world.api.calls.length;
      console.log(`[outbox-limit-remote] calls before the pause=${callsAtPause} (maxOutbox ${MAX_OUTBOX}, batch ${BATCH_SIZE})`);
      assert.ok(callsAtPause >= MAX_OUTBOX, `the outbox reached its limit before the pause (${callsAtPause} calls)`);
      // The check counts its own deletions since its last reading: at most one batch past the limit.
      assert.ok(callsAtPause <= MAX_OUTBOX - 1 + BATCH_SIZE, `at most one batch past the limit before the pause, saw ${callsAtPause} calls`);

      // The same batch comes back from its tier (SHORT_RETRY) and is still paused: no call meanwhile.
      const linesAtFirst = worker.lines.length;
      await worker.waitForLine(
        'the paused batch to come back paused',
        (line) => line.msg === 'batch delayed' && line.reason === 'outbox-full' && line.batchId === first.batchId && worker.lines.indexOf(line) >= linesAtFirst,
        30_000,
      );
      assert.equal(world.api.calls.length, callsAtPause, 'no remote call while the outbox is over its limit');
      assert.equal(await outboxCount(), callsAtPause, 'one unpublished event per confirmed deletion, none lost');
      const statuses = await assetStatuses(world.bed.pool, ids);
      assert.equal([...statuses.values()].filter((status) => status === 'active').length, ASSETS - callsAtPause, 'the rest is untouched');
      assert.equal((await ledgerSummary(world.bed.pool)).in_flight, undefined, 'no operation in flight while paused');

      const status = await runReaperCli(['status', '--json'], world.bed.processEnv());
      assert.equal(status.code, 0, status.stdout);
      const row = (JSON.parse(status.stdout) as { policies: Array<{ policy: string; events: { outbox: number; maxOutbox: number; paused: boolean } | null }> }).policies.find(
        (entry) => entry.policy === MEDIA_POLICY,
      );
      assert.deepEqual(row?.events && { outbox: row.events.outbox, maxOutbox: row.events.maxOutbox, paused: row.events.paused }, { outbox: MAX_OUTBOX, maxOutbox: MAX_OUTBOX, paused: true });
      const text = await runReaperCli(['status'], world.bed.processEnv());
      assert.match(text.stdout, new RegExp(`${MEDIA_POLICY}: deletions paused: ${MAX_OUTBOX}\\+ expiry events unpublished \\(events.maxOutbox ${MAX_OUTBOX}\\)`));
      const wide = await runReaperCli(['status', '--wide'], world.bed.processEnv());
      assert.match(wide.stdout, /PAUSED \(outbox full\)/, 'the wide table has the events column');
      // The runbook's own view: the outbox per policy, and that no relay is connected.
      const eventsStatus = await runReaperCli(['events', 'status', '--json'], world.bed.processEnv());
      assert.equal(eventsStatus.code, 0, eventsStatus.stdout);
      const outbox = JSON.parse(eventsStatus.stdout) as { relayConnections: number; policies: Array<{ policy: string; outbox: number; maxOutbox: number; paused: boolean; routingKey: string }> };
      assert.deepEqual(outbox, { relayConnections: 0, policies: [{ ...outbox.policies[0]!, policy: MEDIA_POLICY, outbox: MAX_OUTBOX, maxOutbox: MAX_OUTBOX, paused: true, routingKey: `${MEDIA_POLICY}.expired` }] });

      relay = startReaper('outbox-relay', ['relay'], world.bed.processEnv());
      // The relay drains the outbox; the paused batches come back and delete the rest.
      await allConfirmed(world, ASSETS, 60_000);
      assert.equal(world.api.calls.length, ASSETS, 'each asset deleted once');
      const events: GetMessage[] = [];
      await eventually('every deletion\'s event to arrive and the outbox to be empty', async () => {
        events.push(...(await drainEvents()));
        return new Set(events.map((message) => message.properties.messageId as string)).size >= ASSETS && (await outboxCount()) === 0;
      }, { timeoutMs: 30_000 });
      const keys = (await ledgerRows(world.bed.pool)).map((operation) => operation.operation_key).sort();
      // The event id is the operation key and the deletion (the outbox row's id): one per deletion.
      const decisions = [...new Set(events.map((message) => message.properties.messageId as string))].map((id) => id.replace(/:\d+$/, ''));
      assert.deepEqual(decisions.sort(), keys, 'one event per deletion, its id the operation key and the deletion');
      assert.deepEqual([...new Set(events.map((message) => (JSON.parse(message.content.toString()) as ExpiryEventV2).key))].sort(), ids);
      const after = await runReaperCli(['status', '--json'], world.bed.processEnv());
      const resumed = (JSON.parse(after.stdout) as { policies: Array<{ policy: string; events: { paused: boolean } | null }> }).policies.find((entry) => entry.policy === MEDIA_POLICY);
      assert.equal(resumed?.events?.paused, false, 'no longer paused');
      const drained = JSON.parse((await runReaperCli(['events', 'status', '--json'], world.bed.processEnv())).stdout) as { relayConnections: number; policies: Array<{ outbox: number; paused: boolean }> };
      assert.deepEqual({ outbox: drained.policies[0]!.outbox, paused: drained.policies[0]!.paused }, { outbox: 0, paused: false });
      assert.ok(drained.relayConnections >= 1, 'the running relay is seen connected');
      await stopAllCleanly([...all, relay]);
      relay = null;
    } finally {
      await relay?.stop();
    }
  });
});
