import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { FAILURES_HEADER } from '../../shared/amqp/headers';
import { brokerNames } from '../../shared/amqp/topology';
import type { BatchV1 } from '../../shared/contracts/batch';
import { startAmqpWiretap, type AmqpWiretap, type HeldFrame, type WireEvent } from '../support/amqp-wiretap';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { makeRowBatch, publishBatch, readyAtRest, receiptsOf, rowDeletePolicyYaml, startServices, stopAllCleanly } from '../support/fixtures';
import { assertNoLeakedProcesses, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The failure side of "ack only after commit" (docs/design.md, ack discipline), with real worker
 * processes whose AMQP traffic passes through a wiretap (test/support/amqp-wiretap.ts), so what
 * the broker was told is read off the wire, not off the worker's logs:
 *  - an unexpected handler error sends the batch to a delay tier with a growing back-off (250 ms,
 *    500 ms, 1 s...; issue 40: it was requeued at once, 20 deliveries in 35 ms), each try acked only
 *    after its copy is confirmed, until it succeeds;
 *  - a poison batch with REAPER_DELIVERY_LIMIT=3 is dead-lettered as `delivery-limit` on its third
 *    failed try (counted across the copies), the count in its headers, and acked only after that publish;
 *  - a database outage (the worker's connections terminated, the database refusing new ones)
 *    pauses consumption: each batch in flight is rejected once, the waiting ones are not delivered
 *    at all meanwhile, and everything completes once the database is back;
 *  - a batch that fails for another reason while that pause is under way (its consumer's cancel
 *    not yet answered, held by the wiretap) is given back only once the consumers are cancelled,
 *    never handed straight back to the consumer still active (issue 43).
 * (An unroutable delay or dead-letter publish leaving the message requeued is
 * test/integration/settle-safety.test.ts.)
 */
describe('ack discipline: the failure side', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let tap: AmqpWiretap;
  let admin: pg.Client;
  let database: string;

  before(async () => {
    bed = await makeTestBed('fault_ack_failures');
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 100 }));
    // The outage test ends the worker's connections; the test's own pool must survive an error on an idle client.
    bed.pool.on('error', () => undefined);
    broker = await openTestBroker(bed.amqpUrl);
    tap = await startAmqpWiretap(bed.amqpUrl);
    database = new URL(bed.databaseUrl).pathname.slice(1);
    const adminUrl = new URL(bed.databaseUrl);
    adminUrl.pathname = '/postgres';
    admin = new pg.Client({ connectionString: adminUrl.toString() });
    await admin.connect();
  });

  after(async () => {
    try {
      await admin?.query(`ALTER DATABASE ${pg.escapeIdentifier(database)} ALLOW_CONNECTIONS true`).catch(() => undefined); // restored in the test's finally already
      await assertNoLeakedProcesses();
    } finally {
      await admin?.end().catch(() => undefined); // closing anyway
      await tap?.close();
      await broker?.close();
      await bed?.close();
    }
  });

  /** The settle actions the worker sent for one batch, in order, as the broker received them. */
  const settlements = (batchId: string) =>
    tap.eventsOf(batchId).flatMap((event) => {
      if (event.kind === 'deliver') return [];
      return [event.kind === 'ack' ? 'ack' : `${event.kind}${event.requeue ? '+requeue' : '-requeue'}`];
    });
  /** One batch's wire events, short: `deliver`, `deliver(redelivered)`, `reject`, `ack`... */
  const wireOf = (batchId: string) => tap.eventsOf(batchId).map((e) => (e.kind === 'deliver' ? `deliver${e.redelivered ? '(redelivered)' : ''}` : e.kind));
  const deliveries = (batchId: string) => tap.eventsOf(batchId).filter((event): event is WireEvent & { kind: 'deliver' } => event.kind === 'deliver');
  const settledLine = (worker: ReaperProcess, batchId: string) =>
    worker.waitForLine(`batch ${batchId} settled`, (line) => line.msg === 'batch settled' && line.batchId === batchId, 30_000);

  /** The first `count` acks of a batch each came after a publish (to `exchange`) since its delivery: publish-then-ack. */
  function assertCopiedBeforeAck(batchId: string, exchange: string, count: number): void {
    let published = false;
    let acks = 0;
    for (const event of tap.events) {
      if (event.kind === 'publish' && event.exchange === exchange) published = true;
      if (!('batchId' in event) || event.batchId !== batchId) continue;
      if (event.kind === 'deliver') published = false;
      if (event.kind === 'ack' && acks++ < count) assert.ok(published, `ack ${acks} of ${batchId} came after its copy to "${exchange}" was published`);
    }
  }

  async function withTrigger<T>(sql: string, body: () => Promise<T>): Promise<T> {
    await bed.pool.query(sql);
    try {
      return await body();
    } finally {
      await bed.pool.query('DROP TRIGGER IF EXISTS reaper_test_fail ON seat_reservations');
    }
  }

  test('an unexpected handler error is retried from a delay tier with a growing back-off until the batch succeeds (issue 40)', async () => {
    const names = brokerNames(bed.prefix);
    const seeded = await seedHolds(bed.pool, { expiredHeld: 5 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    // The DELETE fails with an application error (SQLSTATE P0001) on its first three executions.
    await bed.pool.query('CREATE SEQUENCE IF NOT EXISTS reaper_test_failures');
    await bed.pool.query(`SELECT setval('reaper_test_failures', 1, false)`);
    await bed.pool.query(`CREATE OR REPLACE FUNCTION reaper_test_fail_thrice() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN
        IF nextval('reaper_test_failures') <= 3 THEN RAISE EXCEPTION 'test: the handler fails'; END IF;
        RETURN NULL;
      END $$`);
    const group = startServices(bed, [{ label: 'backoff-worker', kind: 'worker', env: { AMQP_URL: tap.url } }]);
    const [worker] = group.services as [ReaperProcess];
    try {
      await withTrigger('CREATE TRIGGER reaper_test_fail BEFORE DELETE ON seat_reservations FOR EACH STATEMENT EXECUTE FUNCTION reaper_test_fail_thrice()', async () => {
        await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
        await publishBatch(broker, names, batch);
        const settled = await settledLine(worker, batch.batchId);
        assert.equal(settled.outcome, 'done');
        assert.equal(settled.deleted, 5);
        assert.equal(settled.deliveryCount, 1, 'the fourth try is a delay-tier copy on its first delivery');
        const backoffs = worker.lines.filter((line) => line.msg === 'batch outcome unknown; retried after a back-off' && line.batchId === batch.batchId);
        assert.deepEqual(
          backoffs.map((line) => [line.delayMs, line[FAILURES_HEADER]]),
          [
            [250, 1],
            [500, 2],
            [1_000, 3],
          ],
          'three failures, each retried after a longer delay, the failure count carried in the copy',
        );
        assert.match(String(backoffs[0]!.reason), /^unexpected error P0001: test: the handler fails/);
        // Each try came back no sooner than its back-off (the log times of the failures and the success).
        const times = [...backoffs, settled].map((line) => Date.parse(String(line.time)));
        for (let i = 1; i < times.length; i++) {
          const delay = Number(backoffs[i - 1]!.delayMs);
          assert.ok(times[i]! - times[i - 1]! >= delay * 0.8, `try ${i + 1} came ${times[i]! - times[i - 1]!} ms after try ${i}, its back-off ${delay} ms`);
        }
      });
      assert.deepEqual(settlements(batch.batchId), ['ack', 'ack', 'ack', 'ack'], 'each failed try acked only after its delay-tier copy, the success acked');
      assert.equal(tap.events.filter((event) => event.kind === 'nack' || event.kind === 'reject').length, 0, 'nothing rejected, no basic.nack');
      assert.deepEqual(deliveries(batch.batchId).map((event) => event.redelivered), [false, false, false, false], 'four deliveries, each a new copy');
      assertCopiedBeforeAck(batch.batchId, names.delayExchange, 3);
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
      assert.equal((await receiptsOf(bed.pool, batch.batchId)).length, 1, 'one receipt');
      assert.equal((await broker.drain(names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
      await stopAllCleanly(group.services);
      assert.equal(await readyAtRest(broker, names.workQueue('seat-holds')), 0);
    } finally {
      await group.stopLeftovers();
    }
  });

  test('a poison batch with REAPER_DELIVERY_LIMIT=3 is dead-lettered as delivery-limit on its third delivery', async () => {
    // Its own prefix: the work queue's x-delivery-limit is 3 here, 20 for the other tests.
    const prefix = `${bed.prefix}-limit3`;
    const names = brokerNames(prefix);
    const seeded = await seedHolds(bed.pool, { expiredHeld: 4 });
    const poisonId = seeded.expiredHeld[0]!;
    await bed.pool.query(`UPDATE seat_reservations SET seat = 'poison' WHERE reservation_id = $1`, [poisonId]);
    const batch: BatchV1 = await makeRowBatch(bed.pool, seeded.expiredHeld);
    await bed.pool.query(`CREATE OR REPLACE FUNCTION reaper_test_poison() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN
        IF OLD.seat = 'poison' THEN RAISE EXCEPTION 'test: this row cannot be deleted'; END IF;
        RETURN OLD;
      END $$`);
    const group = startServices(bed, [{ label: 'poison-worker', kind: 'worker', env: { AMQP_URL: tap.url, REAPER_AMQP_PREFIX: prefix, REAPER_DELIVERY_LIMIT: '3' } }]);
    const [worker] = group.services as [ReaperProcess];
    try {
      await withTrigger('CREATE TRIGGER reaper_test_fail BEFORE DELETE ON seat_reservations FOR EACH ROW EXECUTE FUNCTION reaper_test_poison()', async () => {
        await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
        await publishBatch(broker, names, batch);
        const dead = await worker.waitForLine('the dead letter', (line) => line.msg === 'message dead-lettered' && line.batchId === batch.batchId, 30_000);
        assert.equal(dead.reason, 'delivery-limit');
        assert.equal(dead.deliveryCount, 1, 'the third try is the second delay-tier copy, on its first delivery');
      });
      const backoffs = worker.lines.filter((line) => line.msg === 'batch outcome unknown; retried after a back-off' && line.batchId === batch.batchId);
      assert.deepEqual(backoffs.map((line) => line.delayMs), [250, 500], 'the first two failures backed off, growing');
      assert.deepEqual(settlements(batch.batchId), ['ack', 'ack', 'ack'], 'each try acked after its copy (delay tier twice, then the dead letter)');
      assertCopiedBeforeAck(batch.batchId, names.delayExchange, 2);
      assert.deepEqual(deliveries(batch.batchId).map((event) => event.redelivered), [false, false, false], 'three deliveries, no fourth');
      const published = tap.events.filter((event) => event.kind === 'publish' && event.routingKey === names.deadLetterQueue);
      assert.equal(published.length, 1, 'one dead-letter publish');
      const ackAt = tap.events.findLastIndex((event) => event.kind === 'ack' && event.batchId === batch.batchId);
      assert.ok(tap.events.indexOf(published[0]!) < ackAt, 'the dead letter was published before the delivery was acked');

      const letters = await broker.drain(names.deadLetterQueue);
      assert.equal(letters.length, 1, 'exactly one dead letter');
      const headers = letters[0]!.properties.headers ?? {};
      assert.equal(letters[0]!.properties.messageId, batch.batchId);
      assert.equal(headers['x-reaper-reason'], 'delivery-limit');
      assert.match(String(headers['x-reaper-detail']), /^failed on 3 deliveries; last: unexpected error P0001: test: this row cannot be deleted/, 'the count and the last error in its headers');
      assert.equal(headers['x-reaper-original-routing-key'], 'seat-holds');
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 4, 'the failing statement deleted nothing of the batch');
      assert.deepEqual(await receiptsOf(bed.pool, batch.batchId), [], 'no receipt');
      await stopAllCleanly(group.services);
      assert.equal(await readyAtRest(broker, names.workQueue('seat-holds')), 0, 'nothing left in the work queue');
    } finally {
      await group.stopLeftovers();
    }
  });

  test('a batch failing while consumption pauses waits for its consumer to be cancelled: not redelivered to it meanwhile', async () => {
    // The interleaving: batch O finds the database unreachable and the worker cancels its
    // consumers, one basic.cancel at a time (presence proof first, then the work queue's). While
    // the first cancel is unanswered (the wiretap holds its cancel-ok) the work consumer is still
    // active on the broker, and batch F fails for another reason (an application error). Given
    // back at once, F would be handed straight back to that consumer (and again on every failure:
    // a busy loop, each turn a delivery toward the limit). It must wait for the cancel.
    const names = brokerNames(bed.prefix);
    const workQueue = names.workQueue('seat-holds');
    await bed.pool.query('DELETE FROM seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 2 });
    const [outageId, failingId] = seeded.expiredHeld as [string, string];
    await bed.pool.query(`UPDATE seat_reservations SET seat = CASE WHEN reservation_id = $1 THEN 'outage' ELSE 'fails' END WHERE reservation_id = ANY($2::uuid[])`, [
      outageId,
      seeded.expiredHeld,
    ]);
    const outageBatch = await makeRowBatch(bed.pool, [outageId]);
    const failingBatch = await makeRowBatch(bed.pool, [failingId]);
    // Each row's DELETE fails once: O's as an unreachable database (SQLSTATE 08006, which pauses
    // consumption), F's as an application error (P0001, which does not). Sequences count across
    // the rollbacks.
    for (const sequence of ['reaper_test_outage_once', 'reaper_test_fails_once']) {
      await bed.pool.query(`CREATE SEQUENCE IF NOT EXISTS ${sequence}`);
      await bed.pool.query(`SELECT setval('${sequence}', 1, false)`);
    }
    await bed.pool.query(`CREATE OR REPLACE FUNCTION reaper_test_outage_then_failure() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN
        IF OLD.seat = 'outage' THEN
          IF nextval('reaper_test_outage_once') = 1 THEN RAISE EXCEPTION 'test: the database went away' USING ERRCODE = '08006'; END IF;
        ELSIF OLD.seat = 'fails' THEN
          IF nextval('reaper_test_fails_once') = 1 THEN RAISE EXCEPTION 'test: this batch fails once'; END IF;
        END IF;
        RETURN OLD;
      END $$`);
    const group = startServices(bed, [{ label: 'pausing-worker', kind: 'worker', env: { AMQP_URL: tap.url } }]);
    const [worker] = group.services as [ReaperProcess];
    let hold: HeldFrame | null = null;
    try {
      await withTrigger('CREATE TRIGGER reaper_test_fail BEFORE DELETE ON seat_reservations FOR EACH ROW EXECUTE FUNCTION reaper_test_outage_then_failure()', async () => {
        await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
        // From here on: this worker's cancels only (the tap is shared with the other tests).
        const startedAt = tap.events.length;
        const answer = tap.holdNextCancelOk();
        hold = answer;
        await publishBatch(broker, names, outageBatch);
        let heldTag: string | null = null;
        void answer.held.then((tag) => (heldTag = tag));
        await group.eventuallyAlive('the pause to send its first basic.cancel, its answer held', () => heldTag !== null, { timeoutMs: 20_000, intervalMs: 20 });
        assert.ok(worker.lines.some((line) => line.msg === 'database unavailable: consumption paused'), 'O paused consumption');
        const cancels = () => tap.events.slice(startedAt).filter((event) => event.kind === 'cancel');
        assert.equal(cancels().length, 1, 'one basic.cancel sent (the presence proof): the work consumer is not cancelled yet');
        assert.equal(await broker.consumerCount(workQueue), 1, 'the work queue still has its consumer');

        await publishBatch(broker, names, failingBatch);
        // F is delivered to the still-active consumer and fails. The worker either says F waits for
        // the pause (the promise) or gives it back on the wire (the fault): wait for whichever comes.
        const waitLine = (line: { msg?: unknown; batchId?: unknown }) =>
          line.msg === 'batch failed while consumption pauses; given back once the consumers are cancelled' && line.batchId === failingBatch.batchId;
        const failWire = () => ({ failing: wireOf(failingBatch.batchId), outage: wireOf(outageBatch.batchId), cancels: cancels().length });
        await group.eventuallyAlive('F to fail: waiting for the pause, or given back', () => worker.lines.some(waitLine) || settlements(failingBatch.batchId).length > 0, {
          timeoutMs: 20_000,
          intervalMs: 20,
          describe: () => ({ wire: failWire(), worker: worker.output.slice(-10) }),
        });
        assert.deepEqual(settlements(failingBatch.batchId), [], `F was not given back while its consumer was active ${JSON.stringify(failWire())}`);
        assert.deepEqual(deliveries(failingBatch.batchId).map((event) => event.redelivered), [false], 'F delivered once so far');
        assert.equal(cancels().length, 1, 'the work consumer is still not cancelled');

        const releasedAt = tap.events.length;
        answer.release();
        await settledLine(worker, outageBatch.batchId);
        await settledLine(worker, failingBatch.batchId);
        const workCancelOk = tap.events.findIndex((event, index) => index >= releasedAt && event.kind === 'cancel-ok' && event.consumerTag !== heldTag);
        assert.ok(workCancelOk >= 0, `the work consumer's cancel answered after the release ${JSON.stringify(tap.events.slice(releasedAt).map((e) => e.kind))}`);
        // O (database unreachable) is rejected with requeue; F (an unexpected error) goes to a delay tier (its copy, then an ack).
        for (const [batch, givenBackAs, wire, redelivered] of [
          [outageBatch, 'reject', ['reject+requeue', 'ack'], [false, true]],
          [failingBatch, 'ack', ['ack', 'ack'], [false, false]],
        ] as const) {
          assert.deepEqual(settlements(batch.batchId), wire, `${batch.batchId}: given back once, then done ${JSON.stringify(failWire())}`);
          assert.deepEqual(deliveries(batch.batchId).map((event) => event.redelivered), redelivered, `${batch.batchId}: the failure cost one delivery`);
          const givenBack = tap.events.findIndex((event) => event.kind === givenBackAs && 'batchId' in event && event.batchId === batch.batchId);
          assert.ok(givenBack > workCancelOk, `${batch.batchId}: given back (event ${givenBack}) after its consumer's cancel-ok (event ${workCancelOk})`);
        }
      });
      for (const batch of [outageBatch, failingBatch]) assert.equal((await receiptsOf(bed.pool, batch.batchId)).length, 1, 'one receipt each');
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0, 'both rows deleted');
      assert.equal((await broker.drain(names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
      await stopAllCleanly(group.services);
      assert.equal(await readyAtRest(broker, workQueue), 0);
    } finally {
      (hold as HeldFrame | null)?.release();
      await group.stopLeftovers();
    }
  });

  test('a database outage pauses consumption, costs each in-flight batch one delivery, and resumes', async () => {
    const names = brokerNames(bed.prefix);
    const workQueue = names.workQueue('seat-holds');
    await bed.pool.query('DELETE FROM seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 18 });
    const batches: BatchV1[] = [];
    for (let i = 0; i < 6; i++) batches.push(await makeRowBatch(bed.pool, seeded.expiredHeld.slice(i * 3, i * 3 + 3)));
    const group = startServices(bed, [
      // Prefetch 4: four batches in flight, two waiting on the broker. A long lock timeout: the
      // in-flight DELETEs wait on the test's row locks until the outage ends them.
      { label: 'outage-worker', kind: 'worker', env: { AMQP_URL: tap.url, REAPER_PREFETCH: '4', REAPER_LOCK_TIMEOUT_MS: '120000' } },
    ]);
    const [worker] = group.services as [ReaperProcess];
    const holder = await bed.pool.connect();
    let holding = false;
    let refusing = false;
    try {
      await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
      await holder.query('BEGIN');
      holding = true;
      // One row of every batch locked: whichever four the broker hands out, they all wait.
      await holder.query('SELECT 1 FROM seat_reservations WHERE reservation_id = ANY($1::uuid[]) FOR UPDATE', [batches.map((b) => b.items[0]!.id)]);
      for (const batch of batches) await publishBatch(broker, names, batch);
      const waitingDeletes = async () =>
        (
          await bed.pool.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-worker' AND wait_event_type = 'Lock'`,
          )
        ).rows[0]!.n;
      // The worker coalesces the batches it holds into one statement per group (at most two groups
      // per policy at once): four batches in flight wait in one or two DELETEs.
      await group.eventuallyAlive(
        'four batches delivered, their DELETEs waiting on the row locks',
        async () => batches.filter((batch) => deliveries(batch.batchId).length === 1).length === 4 && (await waitingDeletes()) >= 1,
        { timeoutMs: 20_000, intervalMs: 50 },
      );
      const inFlight = batches.filter((batch) => deliveries(batch.batchId).length === 1);
      assert.equal(inFlight.length, 4, 'four batches in flight');

      // The outage: no new connection is accepted, and the worker's connections are ended.
      await admin.query(`ALTER DATABASE ${pg.escapeIdentifier(database)} ALLOW_CONNECTIONS false`);
      refusing = true;
      const ended = await admin.query<{ ended: boolean }>(
        `SELECT pg_terminate_backend(pid) AS ended FROM pg_stat_activity WHERE datname = $1 AND application_name = 'reaper-worker'`,
        [database],
      );
      assert.ok(ended.rowCount! >= 1, `the worker's connections were ended (${ended.rowCount})`);
      await holder.query('ROLLBACK');
      holding = false;

      await worker.waitForLine('consumption paused', (line) => line.msg === 'database unavailable: consumption paused');
      const wire = () => batches.map((batch) => ({ batch: batch.batchId.slice(-12), wire: wireOf(batch.batchId) }));
      await group.eventuallyAlive('every in-flight batch to be given back', () => inFlight.every((batch) => settlements(batch.batchId).length >= 1), {
        timeoutMs: 20_000,
        describe: () => ({ wire: wire(), worker: worker.output.slice(-10) }),
      });
      await group.eventuallyAlive('the consumer to be cancelled', async () => (await broker.consumerCount(workQueue)) === 0, { timeoutMs: 20_000, intervalMs: 50 });
      assert.equal(await broker.messageCount(workQueue), 6, 'all six batches wait on the broker while the database is out');
      // Paused: with the database still refusing connections, nothing is delivered for a while
      // (the worker keeps probing it meanwhile).
      const deliveredAtPause = tap.events.filter((event) => event.kind === 'deliver').length;
      const pausedAt = Date.now();
      await eventually('the outage to last 2 s', () => Date.now() - pausedAt >= 2_000, { timeoutMs: 10_000, intervalMs: 50 });
      assert.equal(tap.events.filter((event) => event.kind === 'deliver').length, deliveredAtPause, 'nothing delivered while paused');
      assert.equal(await broker.consumerCount(workQueue), 0, 'still not consuming');

      await admin.query(`ALTER DATABASE ${pg.escapeIdentifier(database)} ALLOW_CONNECTIONS true`);
      refusing = false;
      await worker.waitForLine('consumption resumed', (line) => line.msg === 'database answers again: consumption resumed', 30_000);
      for (const batch of batches) await settledLine(worker, batch.batchId);

      // What the outage cost, per batch, as the broker saw it: exactly one delivery per batch in
      // flight and none for the batches waiting. (The worker cancels its consumers BEFORE it gives
      // a failed batch back, so the broker cannot hand it straight back into the freed slot.)
      const cost = batches.map((batch) => ({
        batch: batch.batchId,
        inFlight: inFlight.includes(batch),
        settlements: settlements(batch.batchId),
        redelivered: deliveries(batch.batchId).map((event) => event.redelivered),
      }));
      for (const c of cost) {
        const promised = c.inFlight ? 1 : 0;
        const rejects = c.settlements.length - 1;
        assert.equal(c.settlements[c.settlements.length - 1], 'ack', `${c.batch}: acked once the database is back`);
        assert.ok(c.settlements.slice(0, -1).every((s) => s === 'reject+requeue'), `${c.batch}: every failed delivery was a reject with requeue (${c.settlements.join(', ')})`);
        // On failure: what the worker logged about each failed delivery (why it failed).
        const failures = () => worker.output.filter((line) => /"level":(40|50)/.test(line) || /reject|fail|unavailable|resumed|paused/i.test(line)).slice(-30);
        assert.equal(rejects, promised, `${c.batch}: the outage cost ${rejects} deliveries (promised ${promised}) ${JSON.stringify(cost)}\n${failures().join('\n')}`);
        assert.deepEqual(c.redelivered, c.settlements.map((_, index) => index > 0), `${c.batch}: redelivered after the first delivery`);
      }
      assert.deepEqual(
        cost.filter((c) => c.inFlight).map((c) => c.settlements[0]),
        inFlight.map(() => 'reject+requeue'),
        'every batch in flight at the outage was given back (not acked, not dead-lettered)',
      );
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0, 'every row deleted once the database is back');
      for (const batch of batches) assert.equal((await receiptsOf(bed.pool, batch.batchId)).length, 1);
      assert.equal((await broker.drain(names.deadLetterQueue)).length, 0, 'an outage dead-letters nothing');
      await stopAllCleanly(group.services);
      assert.equal(await readyAtRest(broker, workQueue), 0);
    } finally {
      if (refusing) await admin.query(`ALTER DATABASE ${pg.escapeIdentifier(database)} ALLOW_CONNECTIONS true`).catch(() => undefined); // reported by the test already
      if (holding) await holder.query('ROLLBACK').catch(() => undefined); // terminated with the rest, or already rolled back
      holder.release(true);
      await group.stopLeftovers();
    }
  });
});
