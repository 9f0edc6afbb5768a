import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, beforeEach, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type ConsumeMessage } from 'amqplib';
import { ConfirmingPublisher, fixedConnection } from '../../shared/amqp/publisher';
import { brokerNames } from '../../shared/amqp/topology';
import { parsePolicies, type RemoteDeletePolicy, type RowDeletePolicy } from '../../shared/config/policies';
import type { ExpiryEventV2 } from '../../shared/contracts/expiry-event';
import { expiringRowsDeleteGroupIfStillExpired } from '../../shared/db/queries/expiring-rows';
import { targetSettleConfirmedMany } from '../../shared/db/queries/ledger-s3';
import { outboxCountUpTo, outboxEventCount } from '../../shared/db/queries/outbox';
import { targetResolve } from '../../shared/db/queries/target';
import { relayOnce } from '../../services/relay/relay';
import { eventually } from '../support/eventually';
import { makeRowBatch, rowDeletePolicyYaml } from '../support/fixtures';
import { MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 41 item 5 (migration 0031): an outbox row holds the events of every row one batch of a
 * deleting statement deleted, and the relay publishes one message per event, each with the id
 * policy:key:observed expiry:outbox id, deleting the row only once every one of its events was
 * confirmed. Rows of the older layout (one key, written by an earlier release) are still published.
 * The relay's pass (relayOnce) runs in this process against the real database and broker.
 */
describe('expiry events: one outbox row per statement and batch, one message per event', () => {
  let bed: TestBed;
  let model: ChannelModel;
  let channel: Channel;
  let publisher: ConfirmingPublisher;
  let exchange: string;
  const queue = () => `${bed.prefix}.events-all`;
  const received: ConsumeMessage[] = [];
  const POLICY = 'seat-holds';

  before(async () => {
    bed = await makeTestBed('events_batched');
    exchange = brokerNames(bed.prefix).eventsExchange;
    model = await amqp.connect(bed.amqpUrl);
    channel = await model.createChannel();
    await channel.assertExchange(exchange, 'topic', { durable: true });
    await channel.assertQueue(queue(), { exclusive: true });
    await channel.bindQueue(queue(), exchange, '#.expired');
    // Consumed as they arrive (fetching hundreds one by one is slow on a busy machine).
    await channel.consume(queue(), (message) => message && received.push(message), { noAck: true });
    publisher = new ConfirmingPublisher(fixedConnection(model), 5_000);
  });

  after(async () => {
    await model?.close();
    await bed?.close();
  });

  beforeEach(async () => {
    await bed.pool.query('DELETE FROM cleanup_outbox');
    received.length = 0;
  });

  /** The next `count` messages of the consumer's queue, in arrival order (and then no more than those, once the queue is empty). */
  async function arriving(count: number): Promise<ConsumeMessage[]> {
    await eventually(`${count} messages`, async () => received.length >= count && (await channel.checkQueue(queue())).messageCount === 0, { describe: () => ({ received: received.length }) });
    assert.equal(received.length, count, 'no more messages than expected');
    return received.splice(0, received.length);
  }

  const pass = (eventLimit: number, owner = 'test-relay') => relayOnce({ pool: bed.pool, publisher, exchange, eventLimit, owner });
  const bodyOf = (message: ConsumeMessage) => JSON.parse(message.content.toString()) as ExpiryEventV2;
  const idOf = (message: ConsumeMessage) => message.properties.messageId as string;

  /** A row of the layout of migration 0031 written directly: `count` events key-1..key-count of `prefix`. */
  async function insertBatchedRow(prefix: string, count: number): Promise<string> {
    const result = await bed.pool.query<{ outbox_id: string }>(
      `INSERT INTO cleanup_outbox (policy, keys, observed_expiries, event_count, cutoff, policy_version)
       SELECT $1, array_agg($2 || '-' || i ORDER BY i), array_agg(now() - interval '1 hour' + i * interval '1 microsecond' ORDER BY i), count(*), now(), 'v-test'
       FROM generate_series(1, $3) i
       RETURNING outbox_id::text`,
      [POLICY, prefix, count],
    );
    return result.rows[0]!.outbox_id;
  }

  test('one coalesced deleting statement of two batches: one outbox row per batch, each key once, the relay publishes one message per deleted row with its documented id', async () => {
    const policy = parsePolicies(rowDeletePolicyYaml({ events: true }), 'test.yaml', {}).get(POLICY) as RowDeletePolicy;
    const target = await targetResolve(bed.pool, policy);
    const { expiredHeld: ids } = await seedHolds(bed.pool, { expiredHeld: 7 });
    // The fourth row is named by both batches (a worker's two deliveries in hand): deleted once.
    const first = await makeRowBatch(bed.pool, ids.slice(0, 4));
    const second = await makeRowBatch(bed.pool, ids.slice(3), { runId: randomUUID() });
    const decided = new Map([...first.items, ...second.items].map((item) => [item.id, item.observedExpiry]));
    const outcome = await expiringRowsDeleteGroupIfStillExpired(bed.pool, target, {
      policy: POLICY,
      batches: [first, second],
      workerId: 'events-batched',
      events: { policyVersion: 'v-test' },
    });
    assert.equal(outcome.batches.reduce((sum, batch) => sum + batch.deleted, 0), 7);
    assert.equal(await countReservations(bed.pool, ids), 0);

    const rows = await bed.pool.query<{ outbox_id: string; batch_id: string; run_id: string; keys: string[]; event_count: number; key: string | null }>(
      'SELECT outbox_id::text, batch_id, run_id::text, keys, event_count, key FROM cleanup_outbox ORDER BY outbox_id',
    );
    assert.deepEqual(
      rows.rows.map((row) => ({ batch: row.batch_id, run: row.run_id, events: row.event_count, key: row.key })).sort((a, b) => a.batch.localeCompare(b.batch)),
      outcome.batches
        .map((batch) => {
          const run = batch.batchId === first.batchId ? first.runId : second.runId;
          return { batch: batch.batchId, run, events: batch.deleted, key: null };
        })
        .sort((a, b) => a.batch.localeCompare(b.batch)),
      'one row per batch, with its run and batch id and as many events as it deleted rows',
    );
    const outboxIdOf = new Map(rows.rows.flatMap((row) => row.keys.map((key) => [key, row.outbox_id] as const)));
    assert.deepEqual([...outboxIdOf.keys()].sort(), [...ids].sort(), 'each deleted key in exactly one row');
    assert.equal(rows.rows.reduce((sum, row) => sum + row.keys.length, 0), 7, 'no key twice');
    assert.equal(await outboxEventCount(bed.pool), 7);

    const relayed = await pass(2_000);
    assert.deepEqual({ taken: relayed.taken, rows: relayed.rows, published: relayed.published, failure: relayed.failure }, { taken: 7, rows: 2, published: 7, failure: null });
    const messages = await arriving(7); // one message per deleted row
    for (const message of messages) {
      const body = bodyOf(message);
      assert.equal(body.observedExpiry, decided.get(body.key), 'each key with the expiry its batch observed');
      assert.equal(idOf(message), `${POLICY}:${body.key}:${body.observedExpiry}:${outboxIdOf.get(body.key)}`, 'message id = policy:key:observed expiry:outbox id');
      assert.equal(body.eventId, idOf(message));
      assert.equal(body.batchId, rows.rows.find((row) => row.outbox_id === outboxIdOf.get(body.key))!.batch_id);
      assert.ok(body.cutoff && body.runId && body.deletedAt);
    }
    assert.equal(await outboxEventCount(bed.pool), 0, 'every row deleted once all its events were confirmed');
  });

  test('a row of the older layout (one key) is published as before; a pass is bounded by events, not rows; the limit check counts events', async () => {
    const old = await bed.pool.query<{ outbox_id: string; observed: string }>(
      `INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
       VALUES ($1, 'old-layout', now() - interval '2 hours', now(), NULL, NULL, 'v-old') RETURNING outbox_id::text, reaper_iso(observed_expiry) AS observed`,
      [POLICY],
    );
    const [a, b, c] = [await insertBatchedRow('a', 300), await insertBatchedRow('b', 300), await insertBatchedRow('c', 300)];
    // The worker's events.maxOutbox check and `reaper status` count events (bounded by the cap).
    assert.equal(await outboxCountUpTo(bed.pool, POLICY, 100_000), 901);
    assert.equal(await outboxCountUpTo(bed.pool, POLICY, 500), 500);

    // 500 events a pass: the old row (1) and a (300) come before b with 301 < 500, so b is taken
    // too; c has 601 before it and waits.
    const firstPass = await pass(500);
    assert.deepEqual({ taken: firstPass.taken, rows: firstPass.rows, published: firstPass.published }, { taken: 601, rows: 3, published: 601 });
    const firstMessages = await arriving(601);
    const oldMessage = firstMessages.find((message) => bodyOf(message).key === 'old-layout');
    assert.ok(oldMessage, 'the older row is published');
    assert.equal(idOf(oldMessage), `${POLICY}:old-layout:${old.rows[0]!.observed}:${old.rows[0]!.outbox_id}`);
    assert.equal(bodyOf(oldMessage).policyVersion, 'v-old');
    assert.deepEqual(
      firstMessages.map((message) => idOf(message).split(':').pop()),
      [old.rows[0]!.outbox_id, ...Array<string>(300).fill(a), ...Array<string>(300).fill(b)],
      'oldest row first, its events in their order',
    );
    assert.deepEqual(firstMessages.slice(1, 4).map((message) => bodyOf(message).key), ['a-1', 'a-2', 'a-3']);

    // At least one row, however many events it holds.
    const secondPass = await pass(10);
    assert.deepEqual({ taken: secondPass.taken, rows: secondPass.rows, published: secondPass.published }, { taken: 300, rows: 1, published: 300 });
    assert.ok((await arriving(300)).every((message) => idOf(message).endsWith(`:${c}`)));
    assert.equal((await pass(10)).taken, 0, 'the outbox is empty');
  });

  test('a row whose publish the broker partly refuses keeps only its refused events, is given back, and they are published again under the same ids', async () => {
    const outboxId = await insertBatchedRow('partial', 20);
    // A second consumer's queue that takes 5 messages and refuses (nacks) the rest: the broker
    // confirms 5 of the row's 20 events and refuses 15.
    const small = `${bed.prefix}.events-small`;
    await channel.assertQueue(small, { exclusive: true, arguments: { 'x-max-length': 5, 'x-overflow': 'reject-publish' } });
    await channel.bindQueue(small, exchange, '#.expired');
    const refused = await pass(2_000);
    assert.equal(refused.taken, 20);
    assert.equal(refused.published, 5, 'the 5 confirmed events count as published');
    assert.ok(refused.failure, 'the refusal is reported');
    assert.equal((await channel.checkQueue(small)).messageCount, 5, 'the broker took 5 of the row\'s events');
    const firstTry = await arriving(20);
    const row = await bed.pool.query<{ event_count: number; keys: string[]; claimed_by: string | null }>('SELECT event_count, keys, claimed_by FROM cleanup_outbox WHERE outbox_id = $1', [outboxId]);
    assert.equal(row.rows.length, 1, 'the row stays');
    assert.equal(row.rows[0]!.claimed_by, null, 'its claim is given back');
    assert.equal(row.rows[0]!.event_count, 15, 'it keeps the 15 refused events only');
    assert.equal(row.rows[0]!.keys.length, 15);

    // The queue still has no room: the next pass is refused whole, and nothing confirmed is published again.
    const stillFull = await pass(2_000);
    assert.deepEqual({ taken: stillFull.taken, published: stillFull.published }, { taken: 15, published: 0 });
    await arriving(15);
    await channel.deleteQueue(small);
    const again = await pass(2_000);
    assert.deepEqual({ taken: again.taken, published: again.published, failure: again.failure }, { taken: 15, published: 15, failure: null });
    const secondTry = await arriving(15);
    const firstIds = new Set(firstTry.map(idOf));
    assert.ok(secondTry.every((message) => firstIds.has(idOf(message))), 'the refused events are published again under their own message ids');
    assert.equal(new Set(secondTry.map(idOf)).size, 15);
    assert.deepEqual(
      secondTry.map((message) => bodyOf(message).key).sort(),
      row.rows[0]!.keys.slice().sort(),
      'exactly the kept events',
    );
    assert.equal(await outboxEventCount(bed.pool), 0);
  });

  test('the outbox refuses a row of the new layout whose arrays do not carry its events (no expiries, a NULL key, a count that differs)', async () => {
    const bad = [
      `ARRAY['a'], NULL, 1`,
      `ARRAY['a', NULL], ARRAY[now(), now()], 2`,
      `ARRAY['a', 'b'], ARRAY[now(), NULL::timestamptz], 2`,
      `ARRAY['a', 'b'], ARRAY[now(), now()], 3`,
    ];
    for (const values of bad) {
      await assert.rejects(
        bed.pool.query(`INSERT INTO cleanup_outbox (policy, keys, observed_expiries, event_count, policy_version) VALUES ($1, ${values}, 'v')`, [POLICY]),
        /cleanup_outbox_one_layout/,
        values,
      );
    }
    assert.equal(await outboxEventCount(bed.pool), 0);
  });

  test("an earlier release's relay cannot claim (so cannot publish as one bogus event and delete) a row of the new layout: its claim statement fails", async () => {
    await insertBatchedRow('earlier-relay', 2);
    // The claim statement of the release before migration 0031 (shared/db/queries/outbox.ts at
    // 00c85a7), word for word: it would read the row as one event with key NULL.
    const earlierReleaseClaim = `UPDATE cleanup_outbox o SET claimed_by = $2, claimed_until = clock_timestamp() + $3 * interval '1 millisecond'
     FROM (SELECT outbox_id FROM cleanup_outbox WHERE (claimed_until IS NULL OR claimed_until < clock_timestamp() OR claimed_by = $2)
             AND (policy, kind) NOT IN (SELECT * FROM unnest($4::text[], $5::text[]))
           ORDER BY outbox_id LIMIT $1 FOR UPDATE SKIP LOCKED) picked
     WHERE o.outbox_id = picked.outbox_id
     RETURNING o.outbox_id::text, o.policy, o.key, reaper_iso(o.observed_expiry) AS observed_expiry, reaper_iso(o.cutoff) AS cutoff,
       o.run_id::text, o.batch_id, reaper_iso(o.deleted_at) AS deleted_at, o.policy_version, o.kind, o.row_count::text, o.partition_bound, o.key_checksum`;
    await assert.rejects(bed.pool.query(earlierReleaseClaim, [200, 'old-relay:1', 15_000, [], []]), /claimed_until/);
    assert.equal(await outboxEventCount(bed.pool), 2, 'the row is still there, unclaimed');
    // This release's relay publishes both events.
    assert.equal((await pass(200)).published, 2);
    assert.deepEqual((await arriving(2)).map((message) => bodyOf(message).key).sort(), ['earlier-relay-1', 'earlier-relay-2']);
    assert.equal(await outboxEventCount(bed.pool), 0);
  });

  test('S3 remote-delete: one settle statement of several keys writes one outbox row per run and batch', async () => {
    const media = parsePolicies(mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 10, burst: 5, concurrency: 4 }), 'test.yaml', {}).get(MEDIA_POLICY) as RemoteDeletePolicy;
    const target = await targetResolve(bed.pool, media);
    const assets = await seedAssets(bed.pool, 'settle-many', 5);
    const runId = randomUUID();
    const batchOf = (index: number) => `${runId}:${index < 3 ? '000001' : '000002'}`;
    const observed = await bed.pool.query<{ asset_id: string; observed: string }>(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, run_id, claim_batch_id, state, outcome)
       SELECT $1 || ':' || m.asset_id || ':' || reaper_iso(m.retention_expires_at), $1, m.asset_id, m.retention_expires_at, $2::uuid, b.batch_id, 'done', 'confirmed'
       FROM unnest($3::text[], $4::text[]) AS b(asset_id, batch_id) JOIN media_assets m ON m.asset_id = b.asset_id
       RETURNING asset_id, reaper_iso(observed_expiry) AS observed`,
      [MEDIA_POLICY, runId, assets, assets.map((_, index) => batchOf(index))],
    );
    const settled = await targetSettleConfirmedMany(bed.pool, target, {
      items: observed.rows.map((row) => ({ assetId: row.asset_id, observedExpiry: row.observed })),
      markConfirmed: media.markConfirmed,
      events: { policyVersion: 'v-s3' },
    });
    assert.equal(settled.settled, 5);
    const rows = await bed.pool.query<{ batch_id: string; keys: string[]; event_count: number; cutoff: string | null }>(
      'SELECT batch_id, keys, event_count, cutoff FROM cleanup_outbox WHERE policy = $1 ORDER BY batch_id',
      [MEDIA_POLICY],
    );
    assert.deepEqual(
      rows.rows.map((row) => ({ batch: row.batch_id, keys: [...row.keys].sort(), events: row.event_count, cutoff: row.cutoff })),
      [
        { batch: batchOf(0), keys: assets.slice(0, 3), events: 3, cutoff: null },
        { batch: batchOf(3), keys: assets.slice(3), events: 2, cutoff: null },
      ],
    );
  });
});
