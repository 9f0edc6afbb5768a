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
describe('the checker (lost, wrongful, doubled, stuck, events)', () => {
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
    const stuckRun = randomUUID();
    await bed.pool.query(`INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, state) VALUES ($1, $2, 'manual', now() - interval '1 minute', now(), 'scanning')`, [stuckRun, policy]);
    await broker.publish(names.workExchange, policy, '{}');
    await broker.publish('', names.deadLetterQueue, '{}');
    report = await check();
    assert.deepEqual([report.lost, report.wrongful, report.doubled, report.stuck], [0, 2, 0, 3], formatChecker(report));
    // What the stuck run left behind is in the report (a chaos database is dropped afterwards).
    const detail = (report.details.stuck as { unfinishedDetail?: Array<{ runId: string; receipts?: number; keptBatches?: unknown[] }> }).unfinishedDetail;
    assert.deepEqual(detail?.map((run) => [run.runId, run.receipts, run.keptBatches]), [[stuckRun, 0, []]], JSON.stringify(detail));
    assert.throws(() => assertCheckerZero(report), /checker:/);
  });

  test('events: a deletion whose event never arrived is missing, an event for no deletion is spurious; duplicates are allowed', async () => {
    const names = brokerNames(bed.prefix);
    const rowsPolicy = 'events-holds';
    const assetsPolicy = 'events-assets';
    // Deletions: two audited rows (row-delete) and one asset marked deleted (remote-delete).
    const audited = await bed.pool.query<{ id: string }>(
      `INSERT INTO cleanup_audit (policy, key, observed_expiry, policy_version)
       SELECT $1, 'row-' || i, timestamptz '2026-11-30 10:00:00.123456+00' + i * interval '1 second', 'v' FROM generate_series(1, 2) i
       RETURNING policy || ':' || key || ':' || reaper_iso(observed_expiry) AS id`,
      [rowsPolicy],
    );
    const asset = await bed.pool.query<{ id: string }>(
      `INSERT INTO media_assets (asset_id, status, retention_expires_at) VALUES ('events-asset', 'deleted', timestamptz '2026-11-30 10:00:00.654321+00')
       RETURNING $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at) AS id`,
      [assetsPolicy],
    );
    const deletions = [...audited.rows, ...asset.rows].map((row) => row.id);
    const cutoff = await databaseNowIso(bed.pool);
    const check = async (delivered: string[]) =>
      (
        await runChecker({
          pool: bed.pool,
          broker,
          workQueues: [names.workQueue(policy)],
          deadLetterQueue: names.deadLetterQueue,
          rows: { policy: rowsPolicy, created: 0, protected: new Map(), cutoff },
          assets: { policy: assetsPolicy, protected: new Map(), cutoff, executionsByKey: new Map(), executedIds: new Set() },
          events: { delivered },
        })
      ).events!;
    const all = await check([...deletions, deletions[0]!]);
    assert.deepEqual({ ...all, outboxLeft: 0 }, { deletions: 3, delivered: 4, distinct: 3, duplicates: 1, missing: 0, spurious: 0, outboxLeft: 0 });
    const short = await check(deletions.slice(1));
    assert.deepEqual([short.missing, short.spurious], [1, 0]);
    const extra = await check([...deletions, `${rowsPolicy}:row-9:2026-11-30T10:00:09.123456Z`, `${rowsPolicy}:row-1:2026-11-30T10:00:01.999999Z`]);
    assert.deepEqual([extra.missing, extra.spurious], [0, 2], 'an event for a row never deleted, and one with another expiry than the deletion observed');
  });
});
