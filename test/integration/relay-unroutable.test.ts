import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type ConsumeMessage } from 'amqplib';
import type { PartitionRetiredEventV1 } from '../../shared/contracts/expiry-event';
import { closeBedAndBroker, insertPartitionRetiredEvent, openBedAndBroker, rowDeletePolicyYaml, type BedAndBroker } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { startReaper } from '../support/processes';

/**
 * Issue 44 review, item 1: a consumer that wants only deletions binds `#.expired`, so a policy's
 * `<policy>.partition-retired` event is unroutable (`mandatory` returns it). Before, the relay
 * released it and waited 2 s after every pass that held it, and as the oldest row it was in every
 * pass: each 200 row events behind it waited 2 s (head-of-line blocking, for every policy). Now
 * its routing key waits on its own (left out of the claims until its retry time) while the row
 * events go on at full speed, and it is still delivered once a queue is bound for it.
 */
describe('relay: an unroutable routing key does not hold back the others', () => {
  const EXPIRED = 2_000;
  let world: BedAndBroker;
  let consumer: ChannelModel;
  let channel: Channel;
  const arrived: Array<{ at: number; message: ConsumeMessage }> = [];
  const queue = () => `${world.bed.prefix}.deletions-only`;

  before(async () => {
    world = await openBedAndBroker('relay_unroutable', rowDeletePolicyYaml({ events: true }));
    consumer = await amqp.connect(world.bed.amqpUrl);
    channel = await consumer.createChannel();
    await channel.assertExchange(world.names.eventsExchange, 'topic', { durable: true });
    await channel.assertQueue(queue(), { exclusive: true });
    await channel.bindQueue(queue(), world.names.eventsExchange, '#.expired');
    await channel.consume(queue(), (message) => message && arrived.push({ at: Date.now(), message }), { noAck: true });
  });

  after(() => closeBedAndBroker(world, () => consumer.close()));

  test("row events flow at full speed while a partition-retired event is unroutable; it is delivered once bound", async () => {
    // The partition-retired event first (the oldest row, in the first pass), then the row events.
    await insertPartitionRetiredEvent(world.bed.pool, 'reaper_retired.p_old', 6);
    await world.bed.pool.query(
      `INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
       SELECT 'seat-holds', 'k' || g, now() - interval '1 hour', now(), NULL, NULL, 'v' FROM generate_series(1, $1) g`,
      [EXPIRED],
    );
    // The unroutable key is tried again at most every second here (production: 2 s doubling to 30 s),
    // and a pass takes 200 events (production 2,000): the 2,000 row events are 10 passes, each of
    // which would wait for the unroutable event if its key did not wait on its own.
    const relay = startReaper('relay-unroutable', ['relay'], world.bed.processEnv({ REAPER_TEST_RELAY_UNROUTABLE_MAX_MS: '1000', REAPER_TEST_RELAY_EVENTS_PER_PASS: '200' }));
    try {
      await eventually(`${EXPIRED} row events`, () => arrived.length >= EXPIRED, { timeoutMs: 60_000, describe: () => ({ arrived: arrived.length, log: relay.output.slice(-4) }) });
      const spread = arrived[EXPIRED - 1]!.at - arrived[0]!.at;
      // 10+ passes of 200 events: before, each waited 2 s for the unroutable event (>= 18 s in all).
      assert.ok(spread < 8_000, `the ${EXPIRED} row events took ${spread} ms from the first to the last: held back by the unroutable event`);
      assert.ok(arrived.every(({ message }) => message.fields.routingKey === 'seat-holds.expired'));
      // The relay deletes a pass's rows after the broker's confirms, which can come after the
      // consumer already has the messages (clean-clone CI, 2026-12-06: the last row event was still
      // in the outbox when the consumer had all): the routed rows leave; the unroutable one stays.
      const kinds = async () => (await world.bed.pool.query<{ kind: string }>('SELECT kind FROM cleanup_outbox ORDER BY outbox_id')).rows.map((row) => row.kind);
      await eventually('the routed row events gone from the outbox', async () => !(await kinds()).includes('expired'), { timeoutMs: 10_000, describe: kinds });
      assert.deepEqual(await kinds(), ['partition-retired'], 'the unroutable event stays in the outbox (never lost)');
      assert.ok(relay.output.some((line) => line.includes('no queue bound for these routing keys') && line.includes('seat-holds.partition-retired')), 'the relay names the unroutable key');

      // A consumer binds the key: the event arrives at its next try and leaves the outbox.
      await channel.bindQueue(queue(), world.names.eventsExchange, '#.partition-retired');
      const retired = await eventually('the partition-retired event', () => arrived.find(({ message }) => message.fields.routingKey === 'seat-holds.partition-retired'), { timeoutMs: 20_000 });
      const body = JSON.parse(retired.message.content.toString()) as PartitionRetiredEventV1;
      assert.equal(body.partition, 'reaper_retired.p_old');
      assert.equal(body.rowCount, 6);
      assert.equal(retired.message.properties.messageId, body.eventId);
      await eventually('the outbox empty', async () => (await world.bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_outbox')).rows[0]!.n === 0);
    } finally {
      await relay.stop();
    }
  });
});
