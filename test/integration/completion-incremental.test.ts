import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { runClaimOf, runsClaimNext, runsInsertIfAbsent, runsMarkPublished, runsRecordProgress, runsSettlePublished } from '../../shared/db/queries/runs';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 18: the completion pass is incremental (migration 0023's completion cursor) and walks at
 * most `walk` batches of a run per pass. A run completes exactly when its last batch is settled,
 * whatever the order receipts arrive in, and never while one batch lacks its receipt.
 */
describe('incremental completion pass', () => {
  let bed: TestBed;

  before(async () => {
    bed = await makeTestBed('completion_incremental');
  });
  after(async () => {
    await bed?.close();
  });

  let policySeq = 0;
  /** A published run with `count` checkpointed batches (ids in order), none with a receipt yet. */
  const publishedRun = async (count: number): Promise<{ runId: string; batchIds: string[] }> => {
    const policy = `incremental-${++policySeq}`;
    const inserted = (await runsInsertIfAbsent(bed.pool, { policy, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const run = (await runsClaimNext(bed.pool, 'scheduler-a', 60_000, [policy]))!;
    const claim = runClaimOf(run, 'scheduler-a');
    const batchIds = Array.from({ length: count }, (_, i) => `${inserted.runId}:${String(i + 1).padStart(6, '0')}`);
    const cursor = { expiry: '2026-01-01T00:00:01.000001Z', key: 'k' };
    assert.equal(await runsRecordProgress(bed.pool, { claim, from: null, cursor, totals: { candidates: count, skipped: 0, batchesConfirmed: count }, batchIds, leaseMs: 60_000 }), true);
    assert.equal(await runsMarkPublished(bed.pool, claim), true);
    return { runId: inserted.runId, batchIds };
  };
  const receipt = (runId: string, batchId: string) =>
    bed.pool.query(`INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id) VALUES ($1, $2, 'p', 1, 1, 0, 'w')`, [batchId, runId]);
  const pass = async (runId: string, walk: number) => {
    const checked = await runsSettlePublished(bed.pool, { limit: 100, incompleteAfterMs: 3_600_000, walk });
    return checked.find((entry) => entry.runId === runId);
  };
  const state = async (runId: string) =>
    (await bed.pool.query<{ state: string; completion_cursor: string | null }>('SELECT state, completion_cursor FROM cleanup_runs WHERE run_id = $1', [runId])).rows[0]!;

  test('the cursor moves over the settled prefix only, a walk is bounded, and the run completes exactly when its last batch is settled', async () => {
    const { runId, batchIds } = await publishedRun(7);
    assert.equal((await pass(runId, 3))?.state, 'published');
    assert.equal((await state(runId)).completion_cursor, null, 'nothing settled: the cursor stays');

    // Receipts out of order: 1, 2 and 4. The cursor stops before 3.
    for (const i of [0, 1, 3]) await receipt(runId, batchIds[i]!);
    assert.deepEqual(await pass(runId, 3), { runId, policy: `incremental-${policySeq}`, state: 'published', batchesConfirmed: 7, batchesMissing: null, moreToWalk: false });
    assert.equal((await state(runId)).completion_cursor, batchIds[1]);

    // Every batch but the last: however many passes, the run stays published.
    for (const i of [2, 4, 5]) await receipt(runId, batchIds[i]!);
    for (let n = 0; n < 5; n++) assert.equal((await pass(runId, 3))?.state, 'published', `pass ${n}: the last batch has no receipt`);
    assert.equal((await state(runId)).completion_cursor, batchIds[5], 'the cursor waits right before the unsettled batch');

    // The last receipt: the next pass completes the run.
    await receipt(runId, batchIds[6]!);
    assert.deepEqual(await pass(runId, 3), { runId, policy: `incremental-${policySeq}`, state: 'completed', batchesConfirmed: 7, batchesMissing: 0, moreToWalk: false });
    assert.equal((await state(runId)).state, 'completed');
  });

  test('a run whose receipts all arrived completes after as many bounded walks as it needs, not before its last batch is walked', async () => {
    const { runId, batchIds } = await publishedRun(5);
    for (const batchId of batchIds) await receipt(runId, batchId);
    // Walks of 2: batches 1-2, 3-4, then 5 (fewer than the walk: nothing left). Each walk that
    // stopped at its bound with every batch settled says so: the scheduler runs the next pass at once.
    assert.deepEqual(await pass(runId, 2), { runId, policy: `incremental-${policySeq}`, state: 'published', batchesConfirmed: 5, batchesMissing: null, moreToWalk: true });
    assert.equal((await state(runId)).completion_cursor, batchIds[1]);
    assert.equal((await pass(runId, 2))?.moreToWalk, true);
    assert.equal((await state(runId)).completion_cursor, batchIds[3]);
    assert.deepEqual(await pass(runId, 2), { runId, policy: `incremental-${policySeq}`, state: 'completed', batchesConfirmed: 5, batchesMissing: 0, moreToWalk: false });
  });

  test('a walk that stops at a batch without its receipt has nothing more to walk now, however many batches follow', async () => {
    const { runId, batchIds } = await publishedRun(6);
    for (const i of [0, 2, 3, 4, 5]) await receipt(runId, batchIds[i]!);
    const checked = await pass(runId, 2);
    assert.deepEqual([checked?.state, checked?.moreToWalk], ['published', false]);
    assert.equal((await state(runId)).completion_cursor, batchIds[0]);
  });

  test('the first batch missing: the cursor does not move, and the run goes incomplete with the exact count after the time without progress', async () => {
    const { runId, batchIds } = await publishedRun(4);
    for (const batchId of batchIds.slice(1)) await receipt(runId, batchId);
    assert.equal((await pass(runId, 10))?.state, 'published');
    assert.equal((await state(runId)).completion_cursor, null);
    await bed.pool.query(`UPDATE cleanup_runs SET published_at = clock_timestamp() - interval '2 hours' WHERE run_id = $1`, [runId]);
    await bed.pool.query(`UPDATE cleanup_batches SET completed_at = clock_timestamp() - interval '2 hours' WHERE run_id = $1`, [runId]);
    const checked = await pass(runId, 10);
    assert.deepEqual([checked?.state, checked?.batchesMissing], ['incomplete', 1]);
  });
});
