import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from '../support/broker';
import { assertCheckerZero, formatChecker, runChecker } from '../support/run-checks';
import { databaseNowIso, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The checker of the fault tests and the chaos run counts what it claims to count: each kind of
 * violation made on purpose shows up in its column, and a clean state reads zero. (A checker that
 * always says zero would make every fault test pass.)
 */
describe('the checker (lost, wrongful, doubled, stuck)', () => {
  let bed: TestBed;
  let broker: TestBroker;
  const policy = 'seat-holds';

  before(async () => {
    bed = await makeTestBed('checker');
    broker = await openTestBroker(bed.amqpUrl);
    const connection = await amqp.connect(bed.amqpUrl);
    const channel = await connection.createChannel();
    await assertTopology(channel, makeTopology({ prefix: bed.prefix, policies: [policy], deliveryLimit: 20 }));
    await connection.close();
  });
  after(async () => {
    await broker?.close();
    await bed?.close();
  });

  test('a clean state reads zero; each violation made on purpose is counted in its column', async () => {
    const names = brokerNames(bed.prefix);
    const seeded = await seedHolds(bed.pool, { expiredHeld: 4, futureHeld: 2, expiredConfirmed: 2 });
    const runId = randomUUID();
    const cutoff = await databaseNowIso(bed.pool);
    await bed.pool.query(`INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, state, candidates) VALUES ($1, $2, 'manual', now(), now(), 'completed', 4)`, [runId, policy]);
    // "The run": the four expired holds deleted, one receipt saying so.
    await bed.pool.query('DELETE FROM seat_reservations WHERE reservation_id = ANY($1::uuid[])', [seeded.expiredHeld]);
    await bed.pool.query(`INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id) VALUES ($1, $2, $3, 4, 4, 0, 'w')`, [`${runId}:000001`, runId, policy]);
    let created = 8;
    const protectedRows = new Map([...seeded.futureHeld, ...seeded.expiredConfirmed].map((id) => [id, 'unexpired or confirmed']));
    const check = (extra: { executions?: Map<string, number>; executed?: Set<string>; protectedAssets?: Map<string, string> } = {}) =>
      runChecker({
        pool: bed.pool,
        broker,
        workQueues: [names.workQueue(policy)],
        deadLetterQueue: names.deadLetterQueue,
        rows: { policy, created, protected: protectedRows, cutoff },
        assets: { policy: 'media-assets', protected: extra.protectedAssets ?? new Map(), cutoff, executionsByKey: extra.executions ?? new Map(), executedIds: extra.executed ?? new Set() },
      });
    assertCheckerZero(await check());

    // lost: an expired, unheld hold left behind (a legally held one is not lost).
    const [left] = (await seedHolds(bed.pool, { expiredHeld: 1 })).expiredHeld;
    const [legallyHeld] = (await seedHolds(bed.pool, { expiredHeld: 1 })).expiredHeld;
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ($1, $2, 'case', 'test')`, [policy, legallyHeld]);
    protectedRows.set(legallyHeld!, 'legal hold');
    created = 10;
    let report = await check();
    assert.equal(report.lost, 1, formatChecker(report));
    await bed.pool.query('DELETE FROM seat_reservations WHERE reservation_id = $1', [left]);
    await bed.pool.query(`UPDATE cleanup_batches SET deleted = 5, items = 5 WHERE run_id = $1`, [runId]);
    await bed.pool.query(`UPDATE cleanup_runs SET candidates = 5 WHERE run_id = $1`, [runId]);

    // wrongful: the legally held row and a confirmed one deleted (and counted, so not "doubled").
    await bed.pool.query('DELETE FROM seat_reservations WHERE reservation_id = ANY($1::uuid[])', [[legallyHeld, seeded.expiredConfirmed[0]]]);
    await bed.pool.query(`UPDATE cleanup_batches SET deleted = 7 WHERE run_id = $1`, [runId]);
    report = await check();
    assert.deepEqual([report.lost, report.wrongful, report.doubled, report.stuck], [0, 2, 0, 0], formatChecker(report));

    // doubled: a receipt counting a row that is not gone; a row published in two batches; a remote key executed twice.
    await bed.pool.query(`INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id) VALUES ($1, $2, $3, 1, 1, 0, 'w')`, [`${runId}:000002`, runId, policy]);
    report = await check({ executions: new Map([['k1', 1], ['k2', 2]]) });
    assert.deepEqual([report.lost, report.wrongful, report.doubled, report.stuck], [0, 2, 3, 0], formatChecker(report));
    await bed.pool.query('DELETE FROM cleanup_batches WHERE batch_id = $1', [`${runId}:000002`]);

    // wrongful (remote): a protected asset's object deleted by the API.
    report = await check({ protectedAssets: new Map([['a1', 'legal hold']]), executed: new Set(['a1', 'a2']) });
    assert.equal(report.wrongful, 3, formatChecker(report));

    // stuck: a run left scanning, a message left in the work queue and one in the dead-letter queue.
    await bed.pool.query(`INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, state) VALUES ($1, $2, 'manual', now() - interval '1 minute', now(), 'scanning')`, [randomUUID(), policy]);
    await broker.publish(names.workExchange, policy, '{}');
    await broker.publish('', names.deadLetterQueue, '{}');
    report = await check();
    assert.deepEqual([report.lost, report.wrongful, report.doubled, report.stuck], [0, 2, 0, 3], formatChecker(report));
    assert.throws(() => assertCheckerZero(report), /checker:/);
  });
});
