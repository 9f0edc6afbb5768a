import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import type pg from 'pg';
import pino from 'pino';
import { ADAPTIVE } from '../../shared/admission/adaptive';
import { parsePolicies, type RowDeletePolicy } from '../../shared/config/policies';
import { makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import { makePool } from '../../shared/db/pool';
import { targetResolve } from '../../shared/db/queries/expiring-rows';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeRowDeleteGroupHandler, type BatchGroupHandler } from '../../services/worker/handlers/row-delete';
import type { HandlerContext } from '../../services/worker/handlers/types';
import { makeRowBatch, rowDeletePolicyYaml, runReceipts } from '../support/fixtures';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Adaptive admission at a low rate while an application shares the database: a batch bigger than
 * the statement size in force goes to the database in parts (ADAPTIVE.statementPartRows rows each,
 * each its own transaction and receipt, the last under the batch's own id), so the application's
 * statements never wait behind a whole batch's deletion and commit (issue 18, figure 7). Every
 * receipt rule still holds: nothing deleted twice, the run's totals exact, the batch done for the
 * run only when its last part is.
 */
describe('row-delete: a batch in parts at a low adaptive rate', () => {
  let bed: TestBed;
  let application: pg.PoolClient;
  const pools: pg.Pool[] = [];

  before(async () => {
    bed = await makeTestBed('row_delete_parts');
    // An application shares the database: a connection in a transaction, seen by every admission's sample.
    application = await bed.pool.connect();
    await application.query('BEGIN');
    await application.query('SELECT 1');
  });

  after(async () => {
    try {
      await application?.query('COMMIT');
      application?.release();
      await Promise.all(pools.map((pool) => pool.end()));
    } finally {
      await bed?.close();
    }
  });

  const policyNamed = (name: string): RowDeletePolicy =>
    parsePolicies(rowDeletePolicyYaml({ name, batchSize: 300, audit: true }), 'test', {}).get(name) as RowDeletePolicy;

  /** A worker of its own (its own pool: its own adaptive observer), with the failpoint given. */
  function workerContext(name: string, failpoint: HandlerContext['failpoint'] = () => undefined): HandlerContext {
    const pool = makePool(bed.databaseUrl, 2, `reaper-worker-${name}`);
    pools.push(pool);
    return { pool, workerId: `worker-${name}`, log: pino({ level: 'silent' }), metrics: makeMetrics(), deliveryCount: 1, failpoint };
  }

  async function batchOf(policy: RowDeletePolicy, rows: number): Promise<BatchV1> {
    const seeded = await seedHolds(bed.pool, { expiredHeld: rows });
    const runId = randomUUID();
    return makeRowBatch(bed.pool, seeded.expiredHeld, { runId, batchId: makeBatchId(runId, 1), policy: policy.name });
  }

  /**
   * Two small groups so the worker has read the database (the application there) and the shared
   * rate, put at the floor in between, as a busy database would have put it.
   */
  async function atTheFloor(group: BatchGroupHandler, policy: RowDeletePolicy, context: HandlerContext): Promise<void> {
    assert.equal((await group([await batchOf(policy, 5)], context))[0]!.kind, 'done');
    await bed.pool.query('UPDATE cleanup_admission SET adaptive_rate = $2, adapted_at = clock_timestamp() WHERE policy = $1', [policy.name, ADAPTIVE.floorRowsPerSecond]);
    assert.equal((await group([await batchOf(policy, 5)], context))[0]!.kind, 'done');
  }

  const receiptIds = async (runId: string): Promise<string[]> =>
    (await bed.pool.query<{ batch_id: string }>('SELECT batch_id FROM cleanup_batches WHERE run_id = $1 ORDER BY completed_at, batch_id', [runId])).rows.map((row) => row.batch_id);

  test('a batch of 300 goes as three parts of 100: a receipt each, the last under the batch id, the audit rows under the batch id', async () => {
    const policy = policyNamed('parted');
    const group = makeRowDeleteGroupHandler(policy, await targetResolve(bed.pool, policy));
    const context = workerContext('parted');
    await atTheFloor(group, policy, context);

    const batch = await batchOf(policy, 300);
    assert.deepEqual(await group([batch], context), [{ kind: 'done', deleted: 300, noop: 0, duplicate: false }]);
    assert.equal(await countReservations(bed.pool, batch.items.map((item) => item.id)), 0);
    assert.deepEqual(await receiptIds(batch.runId), [`${batch.batchId}~p1`, `${batch.batchId}~p2`, batch.batchId], 'three transactions, in order');
    assert.deepEqual(await runReceipts(bed.pool, batch.runId), { batches: 3, deleted: 300, noop: 0 });
    const audited = await bed.pool.query<{ batch_id: string; n: number }>('SELECT batch_id, count(*)::int AS n FROM cleanup_audit WHERE run_id = $1 GROUP BY batch_id', [batch.runId]);
    assert.deepEqual(audited.rows, [{ batch_id: batch.batchId, n: 300 }], 'the audit names the message batch, not its parts');

    // Delivered again: every part finds its receipt; nothing deleted twice.
    assert.deepEqual(await group([batch], context), [{ kind: 'done', deleted: 0, noop: 300, duplicate: true }]);
    assert.deepEqual(await runReceipts(bed.pool, batch.runId), { batches: 3, deleted: 300, noop: 0 });
  });

  test('a crash before a part commits: the parts before it stay committed, the batch is not done for its run, and the redelivery deletes the rest once', async () => {
    const policy = policyNamed('crashed');
    const group = makeRowDeleteGroupHandler(policy, await targetResolve(bed.pool, policy));
    let commits = 0;
    // The second part's transaction dies before COMMIT (the process would die at that instant, on the same code).
    const context = workerContext('crashed', (name) => {
      if (name === 'before-commit' && ++commits === 4) throw new Error('killed at before-commit');
    });
    await atTheFloor(group, policy, context); // commits 1 and 2

    const batch = await batchOf(policy, 250);
    const [first] = await group([batch], context);
    assert.equal(first!.kind, 'unknown', 'not acked: the broker would redeliver');
    assert.deepEqual(await receiptIds(batch.runId), [`${batch.batchId}~p1`], 'the first part committed; the second died; the last was not run after it');
    assert.equal(await countReservations(bed.pool, batch.items.map((item) => item.id)), 150);
    const done = await bed.pool.query('SELECT 1 FROM cleanup_batches WHERE batch_id = $1', [batch.batchId]);
    assert.equal(done.rowCount, 0, "no receipt under the batch's own id: its run does not count it done");

    // The redelivery: the first part is a duplicate, the other two delete what is left.
    assert.deepEqual(await group([batch], context), [{ kind: 'done', deleted: 150, noop: 100, duplicate: false }]);
    assert.equal(await countReservations(bed.pool, batch.items.map((item) => item.id)), 0);
    assert.deepEqual(await receiptIds(batch.runId), [`${batch.batchId}~p1`, `${batch.batchId}~p2`, batch.batchId]);
    assert.deepEqual(await runReceipts(bed.pool, batch.runId), { batches: 3, deleted: 250, noop: 0 }, 'the run counts every row once');
  });

  test('alone on the database, the same batch at the same rate is one statement with one receipt', async () => {
    await application.query('COMMIT');
    application.release();
    try {
      const policy = policyNamed('alone');
      const group = makeRowDeleteGroupHandler(policy, await targetResolve(bed.pool, policy));
      const context = workerContext('alone');
      await atTheFloor(group, policy, context);
      const batch = await batchOf(policy, 300);
      assert.deepEqual(await group([batch], context), [{ kind: 'done', deleted: 300, noop: 0, duplicate: false }]);
      assert.deepEqual(await receiptIds(batch.runId), [batch.batchId]);
    } finally {
      // after() ends the application's transaction again: give it one to end.
      application = await bed.pool.connect();
      await application.query('BEGIN');
    }
  });
});
