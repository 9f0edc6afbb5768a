import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import type pg from 'pg';
import { brokerNames } from '../../shared/amqp/topology';
import { makeBatchId } from '../../shared/contracts/batch';
import { ROW_ADMISSION_HOLD_MS } from '../../services/worker/handlers/row-delete';
import { openTestBroker, type TestBroker } from '../support/broker';
import { makeRowBatch, publishBatch, rowDeletePolicyYaml, startServices, stopAllCleanly } from '../support/fixtures';
import { assertNoLeakedProcesses } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

const BATCH = 10;
const BATCHES = 4;
/** A transaction of the worker open longer than this while it waits is a wait inside a transaction. */
const LONG_TRANSACTION_S = 1;
/** The bound a hold must stay within: the wait budget plus a generous margin for the statements. */
const HOLD_BOUND_S = 8;

/**
 * Issue 17 item 10 (docs/design.md invariant 18): no wait inside an open transaction; every message
 * hold is bounded and measured. A row-delete policy with one statement slot; the test holds that
 * slot (the same advisory lock the worker takes) while four batches arrive: the first two each as
 * a group of its own (the two groups a worker runs at once per policy), the last two queued behind
 * them, then run as one group of two chunks. The worker waits for the slot between short
 * transactions, never inside one (pg_stat_activity shows no transaction of the worker open longer
 * than LONG_TRANSACTION_S); the wait budget counts from each message's delivery (not afresh per
 * chunk, nor after time queued behind other groups), so every hold, measured by
 * reaper_message_hold_seconds, stays within HOLD_BOUND_S.
 */
describe('row-delete: waits happen outside transactions, and every message hold is bounded and measured', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let locker: pg.PoolClient | undefined;

  before(async () => {
    bed = await makeTestBed('row_delete_waits');
    // Burst = one batch: each batch is its own chunk of a group. A rate far above what the test needs.
    bed.writePolicies(`${rowDeletePolicyYaml({ batchSize: BATCH })}    admission: { rowsPerSecond: 100000, burst: ${BATCH}, concurrency: 1 }\n`);
    broker = await openTestBroker(bed.amqpUrl);
  });

  after(async () => {
    try {
      await locker?.query('ROLLBACK').catch(() => undefined); // a failed test may still hold the slot
      locker?.release();
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

  /**
   * The worker's transactions open longer than LONG_TRANSACTION_S, with their state. A session in
   * state 'idle' is left out: it holds no transaction, yet PostgreSQL shows one for a moment when an
   * idle backend handles a shared-invalidation catch-up (ProcessCatchupInterrupt starts and commits
   * a transaction whose start time is the session's last statement's). CI saw exactly that once: two
   * idle worker sessions "open" 2.71 s, both at the same instant.
   */
  async function longWorkerTransactions(): Promise<Array<{ state: string; open_s: number }>> {
    const result = await bed.pool.query<{ state: string; open_s: number }>(
      `SELECT state, extract(epoch FROM clock_timestamp() - xact_start)::float8 AS open_s FROM pg_stat_activity
       WHERE datname = current_database() AND application_name = 'reaper-worker' AND xact_start IS NOT NULL
         AND state IS DISTINCT FROM 'idle'
         AND clock_timestamp() - xact_start > $1 * interval '1 second'`,
      [LONG_TRANSACTION_S],
    );
    return result.rows;
  }

  test('waiting for a statement slot holds no transaction open; reaper_message_hold_seconds is exported and bounded', async () => {
    const names = brokerNames(bed.prefix);
    const seeded = await seedHolds(bed.pool, { expiredHeld: BATCH * BATCHES });
    const runId = randomUUID();
    const batches = await Promise.all(
      Array.from({ length: BATCHES }, (_, i) => makeRowBatch(bed.pool, seeded.expiredHeld.slice(i * BATCH, (i + 1) * BATCH), { runId, batchId: makeBatchId(runId, i + 1) })),
    );
    const group = startServices(bed, [{ label: 'waits-worker', kind: 'worker', env: { HTTP_PORT: '0', REAPER_PREFETCH: '8' } }]);
    try {
      const [worker] = group.services;
      const ready = await worker!.waitForLine('worker started', (line) => line.msg === 'worker started', 30_000);
      await worker!.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
      // The policy's only slot, taken the way a worker takes it (shared/db/queries/admission.ts).
      locker = await bed.pool.connect();
      await locker.query('BEGIN');
      await locker.query(`SELECT pg_advisory_xact_lock(hashtext('reaper-rows:' || $1), 0)`, ['seat-holds']);
      // One at a time for the first two (each taken by the worker before the next is sent), then two together.
      const queue = names.workQueue('seat-holds');
      for (const batch of batches.slice(0, 2)) {
        await publishBatch(broker, names, batch);
        await group.eventuallyAlive(`${batch.batchId} taken by the worker`, async () => (await broker.messageCount(queue)) === 0, { intervalMs: 20 });
      }
      for (const batch of batches.slice(2)) await publishBatch(broker, names, batch);
      // While every batch waits for the slot and is handed back: sample the worker's transactions.
      const seen: Array<{ state: string; open_s: number }> = [];
      const delayed = () => new Set(worker!.lines.filter((line) => line.msg === 'batch delayed' && line.reason === 'concurrency').map((line) => line.batchId));
      await group.eventuallyAlive(
        'every batch handed back for want of a slot',
        async () => {
          seen.push(...(await longWorkerTransactions()));
          return delayed().size === BATCHES;
        },
        { timeoutMs: 60_000, intervalMs: 25 },
      );
      assert.deepEqual(seen, [], `no transaction of the worker stayed open over ${LONG_TRANSACTION_S} s while it waited for the slot`);

      await locker.query('ROLLBACK');
      locker.release();
      locker = undefined;
      const ids = seeded.expiredHeld;
      await group.eventuallyAlive('every row deleted once the slot is free', async () => (await countReservations(bed.pool, ids)) === 0, { timeoutMs: 60_000 });

      // Every settle (each hand-back and each delete) measured, each within the bound.
      const text = await (await fetch(`http://127.0.0.1:${Number(ready.httpPort)}/metrics`)).text();
      const sample = (name: string, le?: string) => {
        const line = text
          .split('\n')
          .find((l) => l.startsWith(`${name}{`) && l.includes('policy="seat-holds"') && (le === undefined || l.includes(`le="${le}"`)));
        assert.ok(line, `${name} of seat-holds${le === undefined ? '' : ` (le ${le})`} is exported`);
        return Number(line.split(' ').pop());
      };
      const holds = sample('reaper_message_hold_seconds_count');
      assert.ok(holds >= BATCHES * 2, `every settle measured: ${holds} holds (each batch handed back, then deleted)`);
      assert.equal(sample('reaper_message_hold_seconds_bucket', String(HOLD_BOUND_S)), holds, `every hold within ${HOLD_BOUND_S} s (wait budget ${ROW_ADMISSION_HOLD_MS} ms from delivery)`);
      await stopAllCleanly(group.services);
    } finally {
      await group.stopLeftovers();
    }
  });
});
