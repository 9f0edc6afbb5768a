import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type ConsumeMessage } from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import type { ExpiryEventV2 } from '../../shared/contracts/expiry-event';
import { outboxEventCount } from '../../shared/db/queries/outbox';
import { eventually } from '../support/eventually';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { startPrivatePostgres, type PrivatePostgres } from '../support/private-postgres';
import { assertNoLeakedProcesses, startReaper, type ReaperProcess } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Expiry events: the database restarts (`pg_ctl restart -m immediate`: every backend killed, crash
 * recovery) while `reaper relay` publishes a large outbox. Nothing is lost: every event arrives,
 * an event published before the restart whose outbox delete did not commit arrives again with
 * the same message id and body, the outbox ends empty, and the relay itself survives and exits 0.
 *
 * The database is a PostgreSQL cluster of this file's own (test/support/private-postgres.ts): the
 * machine's shared one serves every other test running at the moment.
 */
const POLICY = 'seat-holds';
const EVENTS = 20_000;

describe('expiry events: the database restarts while the relay publishes', () => {
  let cluster: PrivatePostgres;
  let bed: TestBed;
  let consumer: ChannelModel;
  let channel: Channel;
  const queue = () => `${bed.prefix}.events-consumer`;

  before(async () => {
    cluster = await startPrivatePostgres('relay_db_restart');
    bed = await makeTestBed('fault_relay_db_restart', { adminDatabaseUrl: cluster.url });
    // The test's own idle connections die with the restart: the pool must not crash the test.
    bed.pool.on('error', () => undefined);
    bed.writePolicies(rowDeletePolicyYaml({ name: POLICY, events: true }));
    consumer = await amqp.connect(bed.amqpUrl);
    channel = await consumer.createChannel();
    const exchange = brokerNames(bed.prefix).eventsExchange;
    await channel.assertExchange(exchange, 'topic', { durable: true });
    await channel.assertQueue(queue(), { exclusive: true });
    await channel.bindQueue(queue(), exchange, `${POLICY}.expired`);
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await consumer?.close();
      await bed?.close();
      await cluster?.close();
    }
  });

  const outboxCount = () => outboxEventCount(bed.pool);

  test('restarted mid-relay: every event published, duplicates only with the same id, the relay survives', async () => {
    // The outbox as deletions left it, in both layouts (migration 0031): the first half one row per
    // deleted key (written by an earlier release), the second half one row per batch of 500 keys (the
    // deleting statements' own outbox rows are tested in relay-crash.test.ts; here the relay is under test).
    const runId = randomUUID();
    const written = await bed.pool.query<{ key: string }>(
      `WITH events AS (
         SELECT i, gen_random_uuid()::text AS key, clock_timestamp() - interval '1 hour' - i * interval '1 microsecond' AS expiry, $2 || ':' || lpad((i / 1000)::text, 6, '0') AS batch_id
         FROM generate_series(1, $3) i
       ), single AS (
         INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
         SELECT $1, key, expiry, clock_timestamp(), $2::uuid, batch_id, 'v-test' FROM events WHERE i <= $3 / 2 ORDER BY i
         RETURNING key
       ), batched AS (
         INSERT INTO cleanup_outbox (policy, keys, observed_expiries, event_count, cutoff, run_id, batch_id, policy_version)
         SELECT $1, array_agg(key ORDER BY i), array_agg(expiry ORDER BY i), count(*), clock_timestamp(), $2::uuid, min(batch_id), 'v-test'
         FROM events WHERE i > $3 / 2 GROUP BY (i - 1) / 500 ORDER BY (i - 1) / 500
         RETURNING keys
       )
       SELECT key FROM single UNION ALL SELECT unnest(keys) FROM batched`,
      [POLICY, runId, EVENTS],
    );
    const keys = written.rows.map((row) => row.key).sort();

    // Consumed as they arrive (a get loop would never see the queue empty while the relay publishes).
    const messages: ConsumeMessage[] = [];
    await channel.prefetch(500);
    await channel.consume(queue(), (message) => {
      if (message === null) return;
      messages.push(message);
      channel.ack(message);
    });
    // Passes of 200 events (production 2,000): the relay's statements come about every 50 ms rather
    // than every 0.4 s, so the restart meets one (with 2,000 it fell between two passes' statements
    // once under load, the pool replaced its dead idle connections, and the relay never saw it).
    let relay: ReaperProcess | null = startReaper('relay-db-restart', ['relay'], bed.processEnv({ REAPER_TEST_RELAY_EVENTS_PER_PASS: '200' }));
    try {
      // Mid-relay: some events published, most still in the outbox, a pass in progress.
      await eventually('the relay to be part way through the outbox', async () => {
        return messages.length >= 400 && (await outboxCount()) > EVENTS / 4;
      }, { timeoutMs: 30_000, intervalMs: 20, describe: () => relay!.output.slice(-5) });
      const restartedAt = Date.now();
      await cluster.restartImmediately();
      const publishedAtRestart = messages.length;

      await eventually('every event to arrive and the outbox to be empty', async () => {
        return new Set(messages.map((message) => message.properties.messageId as string)).size === EVENTS && (await outboxCount()) === 0;
      }, { timeoutMs: 60_000, describe: async () => ({ received: messages.length, outbox: await outboxCount().catch(String), relay: relay!.output.slice(-5) }) });

      const byId = new Map<string, string>();
      let duplicates = 0;
      for (const message of messages) {
        const id = message.properties.messageId as string;
        const body = message.content.toString();
        const event = JSON.parse(body) as ExpiryEventV2;
        assert.equal(id, event.eventId, 'message id = the event id');
        assert.ok(id.startsWith(`${POLICY}:${event.key}:${event.observedExpiry}:`), `the event id is the decision and its deletion: ${id}`);
        if (byId.has(id)) {
          duplicates += 1;
          assert.equal(body, byId.get(id), `a duplicate of ${id} is the same event`);
        } else byId.set(id, body);
      }
      assert.deepEqual([...byId.values()].map((body) => (JSON.parse(body) as ExpiryEventV2).key).sort(), keys, 'every outbox row published, nothing lost');
      assert.ok(
        relay.lines.some((line) => line.msg === 'relay pass failed; the outbox rows stay and are published again'),
        `the relay saw the restart: ${relay.output.slice(-5).join('\n')}`,
      );
      console.log(
        `[relay-db-restart] ${EVENTS} events, ${publishedAtRestart} received before the restart, ${duplicates} duplicates (same id, same body); ` +
          `${messages.length} messages in ${Date.now() - restartedAt} ms after the restart began`,
      );
      assert.ok(relay.running, 'the relay survived the restart');
      const stopped = await relay.stop();
      relay = null;
      assert.deepEqual(stopped, { code: 0, signal: null }, 'the relay drains and exits 0');
    } finally {
      await relay?.stop();
    }
  });
});
