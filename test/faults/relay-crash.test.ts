import assert from 'node:assert/strict';
import { after, before, beforeEach, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type GetMessage } from 'amqplib';
import { EVENT_CAUSE_EXPIRY, EVENT_CAUSE_HEADER, type ExpiryEventV2 } from '../../shared/contracts/expiry-event';
import { policyVersion, parsePolicies } from '../../shared/config/policies';
import { outboxEventCount, outboxEventKeys } from '../../shared/db/queries/outbox';
import { closeBedAndBroker, combinedPoliciesYaml, makeRowBatch, openBedAndBroker, publishBatch, rowDeletePolicyYaml, type BedAndBroker } from '../support/fixtures';
import { drainQueue } from '../support/broker';
import { eventually } from '../support/eventually';
import { runReaperCli, startReaper, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';

/**
 * Expiry events through the transactional outbox (docs/guardrails.md "Expiry events"): the deleting statement
 * writes one outbox row per batch holding an event per deletion that happened, and `reaper relay`
 * deletes a row only after the broker confirmed every one of its events. The relay is really killed (SIGKILL, by its own failpoint) before it
 * publishes and after the confirm; what a consumer bound to `<prefix>.events` receives is checked.
 */
describe('expiry events: outbox and relay crashes', () => {
  const POLICY_YAML = rowDeletePolicyYaml({ batchSize: 100, events: true });
  // The same rows under a second policy whose outbox limit is 3 (the pause test).
  const SMALL_YAML = rowDeletePolicyYaml({ name: 'seat-holds-small', batchSize: 100, events: { maxOutbox: 3 } });
  let world: BedAndBroker;
  let consumer: ChannelModel;
  let channel: Channel;
  const queue = () => `${world.bed.prefix}.events-consumer`;

  before(async () => {
    world = await openBedAndBroker('fault_relay_crash', combinedPoliciesYaml(POLICY_YAML, SMALL_YAML));
    consumer = await amqp.connect(world.bed.amqpUrl);
    channel = await consumer.createChannel();
    // A consumer's own queue: the exchange as the topology declares it, the policy's routing key.
    await channel.assertExchange(world.names.eventsExchange, 'topic', { durable: true });
    await channel.assertQueue(queue(), { exclusive: true });
    for (const policy of ['seat-holds', 'seat-holds-small']) await channel.bindQueue(queue(), world.names.eventsExchange, `${policy}.expired`);
  });

  after(() => closeBedAndBroker(world, () => consumer.close()));

  // Test timings (shared/config/test-timings.ts): a killed relay's claims keep a fresh relay off its
  // rows for 3 s, not the production 15 s, and a batch paused by a full outbox asks again after 1 s,
  // not 10 s. The tests wait for both; a relay that never takes the rows back still fails them.
  const SHORT_TIMINGS = { REAPER_TEST_RELAY_CLAIM_MS: '3000', REAPER_TEST_OUTBOX_FULL_RETRY_MS: '1000' };
  const env = (extra: Record<string, string> = {}) => world.bed.processEnv({ ...SHORT_TIMINGS, ...extra });

  const drainEvents = () => drainQueue(channel, queue());

  /** Events until `count` arrived (they may come in several relay passes). */
  async function eventsArriving(count: number): Promise<GetMessage[]> {
    const got: GetMessage[] = [];
    await eventually(`${count} events to arrive`, async () => {
      got.push(...(await drainEvents()));
      return got.length >= count;
    });
    return got;
  }

  /** The keys of the events in the outbox (of rows of either layout), sorted. */
  const outboxKeys = () => outboxEventKeys(world.bed.pool);

  /** Deletes `ids` through a real worker (one crafted batch); returns the worker's settled line. */
  async function deleteThroughWorker(ids: string[], beforePublish: () => Promise<void> = async () => undefined) {
    const batch = await makeRowBatch(world.bed.pool, ids);
    const worker = startReaper('worker', ['worker'], env({ REAPER_WORKER_ID: 'events-worker' }));
    try {
      await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
      await beforePublish();
      await publishBatch(world.broker, world.names, batch);
      const settled = await worker.waitForLine('the batch to settle', (line) => line.msg === 'batch settled' && line.batchId === batch.batchId, 30_000);
      return { batch, settled };
    } finally {
      await worker.stop();
    }
  }

  async function diedAtFailpoint(relay: ReaperProcess): Promise<void> {
    let exit: { code: number | null; signal: NodeJS.Signals | null } | undefined;
    void relay.exited.then((result) => (exit = result));
    const result = await eventually('the relay to die at its failpoint', () => exit, { timeoutMs: 30_000, describe: () => relay.output.slice(-8) });
    assert.deepEqual(result, { code: null, signal: 'SIGKILL' }, 'the relay must die by SIGKILL at its failpoint');
  }

  const idOf = (message: GetMessage) => message.properties.messageId as string;

  // Each test starts from an empty outbox and queue, whatever an earlier one left.
  beforeEach(async () => {
    await world.bed.pool.query('DELETE FROM cleanup_outbox');
    await drainEvents();
  });

  test('a row deleted, put back with the same expiry and deleted again: two events with two ids (issue 40)', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 1 });
    const [id] = seeded.expiredHeld;
    // A uuid the database made (CREATE TABLE AS takes no parameters).
    assert.match(id!, /^[0-9a-f-]{36}$/);
    await world.bed.pool.query(`CREATE TABLE test_saved_row AS SELECT * FROM seat_reservations WHERE reservation_id = '${id}'`);
    await deleteThroughWorker([id!]);
    // Put back exactly as it was (what `reaper restore` does), then deleted again under the same decision.
    await world.bed.pool.query('INSERT INTO seat_reservations SELECT * FROM test_saved_row; DROP TABLE test_saved_row');
    await deleteThroughWorker([id!]);
    const relay = startReaper('relay-twice', ['relay'], env());
    try {
      const events = await eventsArriving(2);
      const bodies = events.map((message) => JSON.parse(message.content.toString()) as ExpiryEventV2);
      assert.deepEqual(bodies.map((body) => body.key), [id, id], 'one event per deletion');
      assert.equal(bodies[0]!.observedExpiry, bodies[1]!.observedExpiry, 'the same decision');
      assert.equal(new Set(events.map(idOf)).size, 2, `a consumer deduping on the message id keeps both: ${events.map(idOf).join(', ')}`);
    } finally {
      await relay.stop();
    }
  });

  test('one outbox row for the batch, one event per deletion that happened: none for a no-op, a renewal race or a held row', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 10 });
    const [renewed, held, gone, ...deleted] = seeded.expiredHeld;
    const decided = new Map<string, string>(); // key -> the observed expiry its batch carried
    await world.bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('seat-holds', $1, 'legal', 'test')`, [held]);
    // The renewal race: the row is renewed in a transaction that still holds its lock when the
    // worker's DELETE reaches it; the DELETE waits, then re-checks the renewed row and skips it.
    const renewal = await world.bed.pool.connect();
    try {
      await renewal.query('BEGIN');
      await renewal.query(`UPDATE seat_reservations SET expires_at = now() + interval '1 day' WHERE reservation_id = $1`, [renewed]);
      let committed: Promise<void> = Promise.resolve();
      const { batch, settled } = await deleteThroughWorker(seeded.expiredHeld, async () => {
        // Deleted by someone else after the scan: a no-op for the worker.
        await world.bed.pool.query('DELETE FROM seat_reservations WHERE reservation_id = $1', [gone]);
        committed = commitOnceWaitedOn();
      });
      await committed;
      assert.equal(settled.deleted, 7);
      assert.equal(settled.noop, 3);
      for (const item of batch.items) decided.set(item.id, item.observedExpiry);
    } finally {
      renewal.release();
    }
    async function commitOnceWaitedOn(): Promise<void> {
      await eventually('the worker DELETE to wait on the renewed row', async () => {
        const waiting = await world.bed.pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%DELETE FROM%'`,
        );
        return waiting.rows[0]!.n > 0;
      });
      await renewal.query('COMMIT');
    }
    assert.deepEqual(await outboxKeys(), [...deleted!].sort(), 'exactly the deleted rows have an event');
    // One deleting statement, one batch: one outbox row holding its 7 events (migration 0031).
    const rows = await world.bed.pool.query<{ outbox_id: string; event_count: number; keys: string[] }>('SELECT outbox_id::text, event_count, keys FROM cleanup_outbox');
    assert.deepEqual(rows.rows.map((row) => [row.event_count, row.keys.length]), [[7, 7]], 'one outbox row for the statement');
    const outboxId = rows.rows[0]!.outbox_id;

    const relay = startReaper('relay', ['relay'], env());
    try {
      const events = await eventsArriving(7);
      const version = policyVersion(parsePolicies(POLICY_YAML, 'test').get('seat-holds')!);
      for (const message of events) {
        const body = JSON.parse(message.content.toString()) as ExpiryEventV2;
        assert.equal(body.version, 2);
        assert.equal(body.policy, 'seat-holds');
        assert.equal(body.policyVersion, version);
        assert.equal(body.observedExpiry, decided.get(body.key), 'each key with its own observed expiry (the two arrays in one order)');
        assert.equal(idOf(message), `seat-holds:${body.key}:${body.observedExpiry}:${outboxId}`, 'message id = the decision and its deletion (the outbox row)');
        assert.equal(body.eventId, idOf(message), 'the body carries the message id');
        assert.equal(message.properties.headers?.[EVENT_CAUSE_HEADER], EVENT_CAUSE_EXPIRY);
        assert.equal(message.properties.deliveryMode, 2, 'persistent');
        assert.equal(message.fields.routingKey, 'seat-holds.expired');
        for (const field of ['cutoff', 'runId', 'batchId', 'deletedAt'] as const) assert.ok(body[field], `${field} is set`);
      }
      assert.deepEqual(events.map((message) => (JSON.parse(message.content.toString()) as ExpiryEventV2).key).sort(), [...deleted!].sort());
      assert.equal(new Set(events.map(idOf)).size, 7, 'seven distinct message ids');
      await eventually('the outbox to be empty', async () => (await outboxKeys()).length === 0);
    } finally {
      await relay.stop();
    }
  });

  test('a row committed behind a pass (a lower outbox id committing late) is published by one of the next passes, not after the backlog (issue 43)', async () => {
    // Passes of PASS events (REAPER_TEST_RELAY_EVENTS_PER_PASS; production 2,000) over a backlog of
    // 12 passes in rows of ROW_EVENTS events, as deleting statements write them (migration 0031): a
    // pass takes rows while fewer than PASS events come before them, so it carries at most
    // PASS - 1 + ROW_EVENTS. The late row is of the older layout (one key).
    const PASS = 200;
    const ROW_EVENTS = 50;
    const MOST_PER_PASS = PASS - 1 + ROW_EVENTS;
    const BACKLOG = 12 * PASS;
    const version = policyVersion(parsePolicies(POLICY_YAML, 'policies.yaml', {}).get('seat-holds')!);
    // The late row takes the lowest id and commits only once the relay has passed it.
    const late = await world.bed.pool.connect();
    let open = false;
    let doneAtCommit = 0;
    const relay = startReaper('relay-behind', ['relay'], env({ REAPER_TEST_RELAY_EVENTS_PER_PASS: String(PASS) }));
    try {
      await late.query('BEGIN');
      open = true;
      await late.query(`INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, policy_version) VALUES ('seat-holds', 'late-row', now() - interval '1 hour', now(), $1)`, [version]);
      await world.bed.pool.query(
        `INSERT INTO cleanup_outbox (policy, keys, observed_expiries, event_count, cutoff, policy_version)
         SELECT 'seat-holds', array_agg('backlog-' || lpad(i::text, 5, '0') ORDER BY i), array_agg(now() - interval '1 hour'), count(*), now(), $1
         FROM generate_series(1, $2) i GROUP BY (i - 1) / $3 ORDER BY (i - 1) / $3`,
        [version, BACKLOG, ROW_EVENTS],
      );
      // Consumed (not fetched one by one): the keys in the order the relay published them.
      const keys: string[] = [];
      const { consumerTag } = await channel.consume(queue(), (message) => message && keys.push((JSON.parse(message.content.toString()) as ExpiryEventV2).key), { noAck: true });
      try {
        await eventually('the first pass to publish', () => keys.length > 0, { intervalMs: 10 });
        await late.query('COMMIT');
        open = false;
        // What the relay had done once the commit returned (it committed no later): the events
        // received, and the backlog rows it had already deleted (confirmed: published, on their way
        // even if not received yet). Read before the commit (as it was), a test process starved
        // between the read and its COMMIT (CI under two busy loops, five files at once, issue 43)
        // let the relay send the whole backlog meanwhile: "event 2401 of 2401, 218 were out at its
        // commit" though the row committed after the backlog was out. Read after, such a run says
        // it cannot tell (the first assertion below) instead of failing the relay.
        doneAtCommit = Math.max(keys.length, BACKLOG - (await outboxEventCount(world.bed.pool)));
        await eventually(`all ${BACKLOG + 1} events`, () => keys.length === BACKLOG + 1, { timeoutMs: 60_000, describe: () => ({ arrived: keys.length }) });
      } finally {
        await channel.cancel(consumerTag);
      }
      const at = keys.indexOf('late-row');
      assert.ok(at >= 0, 'the late row is published');
      // After its commit, at most the pass being published, one claimed before it and one that the
      // count above missed come first; the pass after them starts from the oldest unclaimed row, which
      // is it. Counted from what the relay had done at the commit, not from the first pass: on a slow
      // machine the test's poll saw the first event when three passes were out (a clean run read
      // event 601, with the bound at 600 from the start, when a pass was 200 rows of one event). A relay that went on after its last row
      // would reach it only after the backlog.
      assert.ok(doneAtCommit + 4 * MOST_PER_PASS < BACKLOG, `the commit came before the backlog was mostly out (${doneAtCommit} of ${BACKLOG} events out): else this cannot tell`);
      assert.ok(at < doneAtCommit + 4 * MOST_PER_PASS, `the late row was event ${at + 1} of ${keys.length}, ${doneAtCommit} were out at its commit: left behind a pass`);
      await eventually('the outbox to be empty', async () => (await outboxKeys()).length === 0);
    } finally {
      if (open) await late.query('ROLLBACK').catch(() => undefined); // the test failed before the commit
      late.release();
      await relay.stop();
    }
  });

  test('relay killed after the confirm, before the outbox delete: the event arrives again with the same id', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 5 });
    await deleteThroughWorker(seeded.expiredHeld);
    assert.equal((await outboxKeys()).length, 5);

    const doomed = startReaper('relay-doomed', ['relay'], env({ REAPER_TEST_FAILPOINT: 'relay-after-confirm' }));
    await diedAtFailpoint(doomed);
    const first = await eventsArriving(5);
    assert.equal((await outboxKeys()).length, 5, 'no outbox row is deleted without its confirm being followed by the delete');

    const fresh = startReaper('relay-fresh', ['relay'], env());
    try {
      const again = await eventsArriving(5);
      assert.deepEqual(again.map(idOf).sort(), first.map(idOf).sort(), 'the same events, with the same message ids');
      await eventually('the outbox to be empty', async () => (await outboxKeys()).length === 0);
    } finally {
      await fresh.stop();
    }
  });

  test('relay killed before it publishes: nothing is published, all is published after a restart', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 5 });
    await deleteThroughWorker(seeded.expiredHeld);

    const doomed = startReaper('relay-doomed-early', ['relay'], env({ REAPER_TEST_FAILPOINT: 'relay-before-publish' }));
    await diedAtFailpoint(doomed);
    assert.equal((await drainEvents()).length, 0, 'nothing was published');
    assert.equal((await outboxKeys()).length, 5);

    const fresh = startReaper('relay-after-restart', ['relay'], env());
    try {
      const events = await eventsArriving(5);
      assert.deepEqual(events.map((message) => (JSON.parse(message.content.toString()) as ExpiryEventV2).key).sort(), [...seeded.expiredHeld].sort());
      await eventually('the outbox to be empty', async () => (await outboxKeys()).length === 0);
    } finally {
      await fresh.stop();
    }
    assert.equal((await drainEvents()).length, 0, 'each event once after the restart');
  });

  test('past events.maxOutbox the policy deletes nothing until the relay catches up, and `reaper status` says so', async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 5 });
    const first = seeded.expiredHeld.slice(0, 3);
    const second = seeded.expiredHeld.slice(3);
    const worker = startReaper('worker-limit', ['worker'], env({ REAPER_WORKER_ID: 'events-limit' }));
    let relay: ReaperProcess | null = null;
    try {
      await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
      const batchA = await makeRowBatch(world.bed.pool, first, { policy: 'seat-holds-small' });
      await publishBatch(world.broker, world.names, batchA);
      await worker.waitForLine('the first batch to settle', (line) => line.msg === 'batch settled' && line.batchId === batchA.batchId, 30_000);
      assert.equal((await outboxKeys()).length, 3, 'the outbox is at its limit');

      const batchB = await makeRowBatch(world.bed.pool, second, { policy: 'seat-holds-small' });
      await publishBatch(world.broker, world.names, batchB);
      const delayed = await worker.waitForLine('the second batch to be delayed', (line) => line.msg === 'batch delayed' && line.batchId === batchB.batchId, 30_000);
      assert.equal(delayed.reason, 'outbox-full');
      assert.equal(await countReservations(world.bed.pool, second), 2, 'nothing deleted while the outbox is full');

      const status = await runReaperCli(['status', '--json'], env());
      assert.equal(status.code, 0, status.stdout);
      const row = (JSON.parse(status.stdout) as { policies: Array<{ policy: string; events: { outbox: number; maxOutbox: number; paused: boolean } | null }> }).policies.find(
        (entry) => entry.policy === 'seat-holds-small',
      );
      assert.deepEqual({ outbox: row!.events!.outbox, maxOutbox: row!.events!.maxOutbox, paused: row!.events!.paused }, { outbox: 3, maxOutbox: 3, paused: true });

      relay = startReaper('relay-limit', ['relay'], env());
      await eventsArriving(3);
      // The delayed batch comes back from its tier and, the outbox drained, deletes its rows.
      await eventually('the paused batch to delete once the relay drained the outbox', async () => (await countReservations(world.bed.pool, second)) === 0, { timeoutMs: 40_000 });
      await eventsArriving(2);
    } finally {
      await relay?.stop();
      await worker.stop();
    }
  });

  test("the relay's database connection killed between the confirm and the outbox delete: nothing lost, the same ids again", async () => {
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 4 });
    await deleteThroughWorker(seeded.expiredHeld);
    // A test-only BEFORE DELETE trigger that waits for an advisory lock this session holds: the
    // relay claims and publishes its batch (an UPDATE, not held back) but its DELETE waits, so
    // the relay is held after the confirm, before the delete.
    await world.bed.pool.query(`CREATE FUNCTION test_hold_outbox_delete() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS
      $$ BEGIN PERFORM pg_advisory_xact_lock(424242); RETURN OLD; END $$`);
    await world.bed.pool.query(`CREATE TRIGGER test_hold_outbox_delete BEFORE DELETE ON cleanup_outbox FOR EACH ROW EXECUTE FUNCTION test_hold_outbox_delete()`);
    const lock = await world.bed.pool.connect();
    let relay: ReaperProcess | null = null;
    try {
      await lock.query('BEGIN');
      await lock.query('SELECT pg_advisory_xact_lock(424242)');
      relay = startReaper('relay-db-lost', ['relay'], env());
      const first = await eventsArriving(4);
      const waiting = await eventually('the relay DELETE to wait on the outbox lock', async () => {
        const found = await world.bed.pool.query<{ pid: number }>(
          `SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE 'reaper-relay%' AND wait_event_type = 'Lock'`,
        );
        return found.rows[0]?.pid;
      });
      await world.bed.pool.query('SELECT pg_terminate_backend($1)', [waiting]);
      await world.bed.pool.query('DROP TRIGGER test_hold_outbox_delete ON cleanup_outbox');
      await lock.query('COMMIT');
      const again = await eventsArriving(4);
      assert.deepEqual(again.map(idOf).sort(), first.map(idOf).sort(), 'republished with the same message ids');
      await eventually('the outbox to be empty', async () => (await outboxKeys()).length === 0);
      const stopped = await relay.stop();
      assert.equal(stopped.code, 0, 'the relay survived the lost connection and drains cleanly');
    } finally {
      await lock.query('ROLLBACK').catch(() => undefined); // already committed unless the test failed first
      lock.release();
      await world.bed.pool.query('DROP TRIGGER IF EXISTS test_hold_outbox_delete ON cleanup_outbox; DROP FUNCTION IF EXISTS test_hold_outbox_delete()');
      await relay?.stop();
    }
  });
});
