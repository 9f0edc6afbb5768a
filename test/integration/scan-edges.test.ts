import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { loadPolicies } from '../../shared/config/policies';
import { decodeBatch, type BatchV1 } from '../../shared/contracts/batch';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startScheduler } from '../../services/scheduler/scheduler';
import { startWorker } from '../../services/worker/worker';
import { type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { closeBedAndBroker, makeRowBatch, openBedAndBroker, publishBatch, readyAtRest, receiptsOf, rowDeletePolicyYaml, runReceipts, runRow } from '../support/fixtures';
import { startReaper } from '../support/processes';
import { countReservations } from '../support/seed';
import { type TestBed } from '../support/testbed';

/**
 * The edges of the keyset scan and of the conditional DELETE (docs/design.md invariants 2, 3, 4):
 *  - rows sharing one expiry across a scan-window boundary are each published exactly once (the
 *    keyset's tie-break on the key);
 *  - a run deletes what expired at or before ITS cutoff, not before "now": rows that expired
 *    between the cutoff and now are kept, by the scan and by the worker's DELETE;
 *  - a worker process told to stop (SIGTERM) while batches are in flight commits them, acks them
 *    and exits 0; nothing is redelivered.
 */
describe('scan and delete edges', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

  before(async () => {
    ({ bed, broker, names } = await openBedAndBroker('scan_edges'));
  });

  after(() => closeBedAndBroker({ bed, broker }));

  /** Inserts held rows expiring at `expiry` (an SQL expression evaluated once per statement). */
  async function insertHolds(count: number, expiry: string, params: unknown[] = []): Promise<string[]> {
    const result = await bed.pool.query<{ id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
       SELECT gen_random_uuid(), 'held', ${expiry}, 'edge-' || i FROM generate_series(1, ${count}) i
       RETURNING reservation_id::text AS id`,
      params,
    );
    return result.rows.map((row) => row.id);
  }

  /** Runs the scan of one run in an in-process scheduler until the run is at least `published`. */
  async function scanRun(cutoff: string | null): Promise<string> {
    const env = bed.env();
    const scheduler = await startScheduler(bed.as(env, 'scheduler'), loadPolicies(env.policiesPath), log);
    try {
      const run = await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: cutoff ? 'replay' : 'manual', scheduledFor: null, cutoff });
      assert.ok(run, 'the run was recorded');
      await eventually('the run to be published', async () => ['published', 'completed'].includes((await runRow(bed.pool, run.runId)).state), {
        timeoutMs: 30_000,
        describe: () => runRow(bed.pool, run.runId),
      });
      return run.runId;
    } finally {
      await scheduler.stop();
    }
  }

  /** Every batch now in the work queue, decoded (taken out of the queue). */
  async function drainBatches(): Promise<BatchV1[]> {
    const messages = await broker.drain(names.workQueue('seat-holds'));
    return messages.map((message) => {
      const decoded = decodeBatch(message.content);
      assert.ok(decoded.ok, `a valid batch: ${message.content.toString().slice(0, 200)}`);
      return decoded.batch;
    });
  }

  test('rows with one expiry across a window boundary are each published exactly once (keyset tie-break on the key)', async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    // batchSize 2: a scan window is 32 batches = 64 rows, so 150 rows sharing ONE expiry (to the
    // microsecond) put two window boundaries inside the tie. Rows just before and after it too.
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 2 }));
    const before = await insertHolds(5, `now() - interval '3 hours' + i * interval '1 second'`);
    const tied = await insertHolds(150, `date_trunc('second', now()) - interval '2 hours' + interval '123456 microseconds'`);
    const later = await insertHolds(7, `now() - interval '1 hour' + i * interval '1 second'`);
    const eligible = [...before, ...tied, ...later];
    const distinctExpiries = await bed.pool.query<{ n: number }>('SELECT count(DISTINCT expires_at)::int AS n FROM seat_reservations WHERE reservation_id = ANY($1::uuid[])', [tied]);
    assert.equal(distinctExpiries.rows[0]!.n, 1, 'the tied rows share one expiry');

    const runId = await scanRun(null);
    const batches = await drainBatches();
    const published = batches.flatMap((batch) => batch.items.map((item) => item.id));
    const seen = new Map<string, number>();
    for (const id of published) seen.set(id, (seen.get(id) ?? 0) + 1);
    assert.deepEqual([...seen].filter(([, n]) => n > 1), [], 'no row published twice');
    assert.deepEqual([...seen.keys()].sort(), [...eligible].sort(), 'every eligible row published: none skipped at a window boundary');
    assert.equal(batches.length, eligible.length / 2, 'full batches of 2');
    assert.equal((await runRow(bed.pool, runId)).candidates, eligible.length, 'the run counts each candidate once');
    // And in keyset order: (expiry, key) strictly increasing across the whole run.
    const expiries = new Map(batches.flatMap((batch) => batch.items.map((item) => [item.id, item.observedExpiry] as const)));
    const ordered = batches
      .sort((a, b) => a.batchId.localeCompare(b.batchId))
      .flatMap((batch) => batch.items.map((item) => `${expiries.get(item.id)} ${item.id}`));
    assert.deepEqual(ordered, [...ordered].sort(), 'batches follow (expiry, key) order');
  });

  test('a run deletes what expired at or before its cutoff; rows expiring between the cutoff and now are kept', async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    bed.writePolicies(rowDeletePolicyYaml());
    const cutoff = (await bed.pool.query<{ at: string }>(`SELECT reaper_iso(date_trunc('second', now()) - interval '10 minutes' + interval '654321 microseconds') AS at`)).rows[0]!.at;
    const beforeCutoff = await insertHolds(6, `$1::timestamptz - interval '1 minute' + i * interval '1 second'`, [cutoff]);
    const atCutoff = await insertHolds(2, `$1::timestamptz`, [cutoff]);
    // Expired by now, but after the cutoff: the run with this cutoff must keep them.
    const afterCutoff = await insertHolds(9, `$1::timestamptz + interval '1 microsecond' + i * interval '30 seconds'`, [cutoff]);
    const expiredNow = await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM seat_reservations WHERE reservation_id = ANY($1::uuid[]) AND expires_at <= now()', [afterCutoff]);
    assert.equal(expiredNow.rows[0]!.n, afterCutoff.length, 'the rows after the cutoff have all expired by now');

    // The scan: only rows <= cutoff become candidates.
    const runId = await scanRun(cutoff);
    assert.equal((await runRow(bed.pool, runId)).cutoff, cutoff, 'the run keeps the cutoff it was given, to the microsecond');
    const batches = await drainBatches();
    const published = batches.flatMap((batch) => batch.items.map((item) => item.id)).sort();
    assert.deepEqual(published, [...beforeCutoff, ...atCutoff].sort(), 'the scan publishes rows expiring at or before the cutoff, and no row after it');
    assert.ok(batches.every((batch) => batch.cutoff === cutoff), 'every batch carries the run cutoff');

    // The DELETE: a batch that lists rows expiring after its cutoff (a scan that used now(), a
    // hand-made message) deletes only what is <= cutoff.
    const env = bed.env();
    const worker = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
    try {
      const forged = await makeRowBatch(bed.pool, [...beforeCutoff, ...atCutoff, ...afterCutoff], { cutoff });
      await publishBatch(broker, names, forged);
      await eventually('the forged batch receipt', async () => (await receiptsOf(bed.pool, forged.batchId)).length === 1);
      const [receipt] = await receiptsOf(bed.pool, forged.batchId);
      assert.deepEqual({ deleted: receipt!.deleted, noop: receipt!.noop }, { deleted: beforeCutoff.length + atCutoff.length, noop: afterCutoff.length });
      assert.equal(await countReservations(bed.pool, afterCutoff), afterCutoff.length, 'rows expiring between the cutoff and now are kept');
      assert.equal(await countReservations(bed.pool, [...beforeCutoff, ...atCutoff]), 0, 'rows expiring at or before the cutoff are deleted');
      assert.equal((await runReceipts(bed.pool, runId)).batches, 0, 'the drained batches of the scan were never delivered');
    } finally {
      await worker.stop();
    }
  });

  test('SIGTERM with batches in flight: the worker commits them, acks them, exits 0, and nothing is redelivered', async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    bed.writePolicies(rowDeletePolicyYaml());
    const PREFETCH = 3;
    const groups = await Promise.all([0, 1, 2, 3].map(() => insertHolds(10, `now() - interval '1 hour' + i * interval '1 ms'`)));
    const batches = await Promise.all(groups.map((ids) => makeRowBatch(bed.pool, ids)));
    const inFlight = batches.slice(0, PREFETCH);
    const queued = batches[PREFETCH]!;

    // Each in-flight batch blocks on one row the test holds locked, so all of them are in the
    // worker's hands, mid-DELETE, when the SIGTERM arrives.
    const holder = await bed.pool.connect();
    let holding = false;
    const worker = startReaper('worker-sigterm', ['worker'], bed.processEnv({
      REAPER_WORKER_ID: 'worker-sigterm',
      REAPER_PREFETCH: String(PREFETCH),
      REAPER_DB_POOL_SIZE: String(PREFETCH),
      REAPER_LOCK_TIMEOUT_MS: '60000',
    }));
    try {
      await holder.query('BEGIN');
      holding = true;
      await holder.query('SELECT 1 FROM seat_reservations WHERE reservation_id = ANY($1::uuid[]) FOR UPDATE', [inFlight.map((batch) => batch.items[0]!.id)]);
      await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming');
      for (const batch of batches) await publishBatch(broker, names, batch);
      const waitingDeletes = async () =>
        (
          await bed.pool.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-worker' AND wait_event_type = 'Lock'`,
          )
        ).rows[0]!.n;
      // The worker coalesces the batches it has in hand (issue 12): the PREFETCH batches wait in one
      // or more DELETEs. All of them are in its hands (only the queued one is still ready in the
      // queue) and at least one DELETE waits on the held rows.
      await eventually(`${PREFETCH} batches in hand, their DELETEs waiting on the held rows`, async () => (await waitingDeletes()) >= 1 && (await broker.messageCount(names.workQueue('seat-holds'))) === 1, { timeoutMs: 20_000, intervalMs: 20 });

      worker.signal('SIGTERM');
      await worker.waitForLine('the worker to start draining', (line) => line.msg === 'worker draining');
      assert.equal(worker.running, true, 'the worker waits for its batches instead of exiting');
      await holder.query('COMMIT');
      holding = false;
      const exit = await worker.exitWithin(30_000, 'drain and exit');
      assert.deepEqual(exit, { code: 0, signal: null }, 'the worker drains and exits 0');
    } finally {
      if (holding) await holder.query('ROLLBACK').catch(() => undefined); // the test failed with the lock held: release it anyway
      holder.release();
      await worker.stop(5_000);
    }

    // The database: every in-flight batch committed, exactly one receipt each; the queued one untouched.
    for (const batch of inFlight) {
      const receipts = await receiptsOf(bed.pool, batch.batchId);
      assert.deepEqual(receipts.map((r) => ({ deleted: r.deleted, noop: r.noop })), [{ deleted: 10, noop: 0 }], `${batch.batchId} committed once`);
    }
    assert.equal(await countReservations(bed.pool, groups.slice(0, PREFETCH).flat()), 0, 'the in-flight batches deleted their rows');
    assert.deepEqual(await receiptsOf(bed.pool, queued.batchId), [], 'the batch beyond the prefetch was never started');
    assert.equal(await countReservations(bed.pool, groups[PREFETCH]!), 10);

    // The broker: once no consumer holds anything, only the never-delivered batch is there, on its first delivery.
    assert.equal(await readyAtRest(broker, names.workQueue('seat-holds')), 1, 'the in-flight batches were acked, not returned');
    const left = await broker.drain(names.workQueue('seat-holds'));
    assert.deepEqual(left.map((m) => [m.properties.messageId, m.fields.redelivered]), [[queued.batchId, false]], 'the one message left is the queued batch, never delivered');
    assert.equal((await broker.drain(names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
  });
});
