import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { assetStatuses, callsByKey, ledgerRows, seedAssets } from '../support/remote-helpers';
import { transitionsWorld } from '../support/remote-transitions-world';

/**
 * The remote ledger's failure transitions (docs/design.md, ledger state machine and "Remote API
 * calls"), each driven by one switch of the stand-in API and observed on reaper's real worker
 * processes, the stand-in's record of calls and the ledger:
 *  - 503 then success: backoff, retried with the SAME Idempotency-Key, confirmed once;
 *  - executed, then answered 500 (ambiguous): retried with the same key, `done` with one execution;
 *  - connection reset: retried, confirmed;
 *  - 403: `rejected`, never called again;
 *  - uncertain on every attempt: `gave-up` after retry.maxAttempts, no further call.
 * The admission side (open circuit, 429 block, late grants) is remote-admission.test.ts.
 */
describe('remote-delete: failure transitions against reaper workers', () => {
  const w = transitionsWorld('fault_remote_transitions');

  test('503 twice: backoff, retried with the same Idempotency-Key, confirmed once', async () => {
    const [id] = await seedAssets(w.bed.pool, 'retried', 1);
    const { worker, metrics } = await w.startWorker('w-503');
    w.api.configure({ failNext: 2, failStatus: 503 });
    await w.trigger();
    const [row] = await w.finished([id!]);
    assert.equal(row!.outcome, 'confirmed');
    assert.deepEqual(w.statusesOf(row!.operation_key), [503, 503, 200], 'three calls, all with the operation key as Idempotency-Key');
    assert.equal(row!.attempt_count, 3, 'each call one attempt');
    assert.equal(w.api.executionsByKey().get(row!.operation_key), 1, 'executed once');
    const calls = callsByKey(w.api).get(row!.operation_key)!;
    // uncertainBackoffMs: 1 s after the first failure, 2 s after the second (plus jitter).
    assert.ok(calls[1]!.startedAt - calls[0]!.finishedAt >= 1_000, `backoff before the 2nd call: ${calls[1]!.startedAt - calls[0]!.finishedAt} ms`);
    assert.ok(calls[2]!.startedAt - calls[1]!.finishedAt >= 2_000, `longer backoff before the 3rd call: ${calls[2]!.startedAt - calls[1]!.finishedAt} ms`);
    const m = await metrics();
    assert.equal(m.sum('reaper_remote_attempts_total', { class: 'uncertain' }), 2);
    assert.equal(m.sum('reaper_remote_attempts_total', { class: 'confirmed' }), 1);
    assert.equal((await assetStatuses(w.bed.pool, [id!])).get(id!), 'deleted');
    await w.stopCleanly(worker);
  });

  test('executed, then answered 500: retried with the same key, done with ONE execution', async () => {
    const [id] = await seedAssets(w.bed.pool, 'ambiguous', 1);
    const { worker } = await w.startWorker('w-500');
    w.api.configure({ executeThenFailNext: 1 });
    await w.trigger();
    const [row] = await w.finished([id!]);
    assert.equal(row!.outcome, 'confirmed', 'the retry learns the outcome (the stand-in replays it for the same key)');
    assert.deepEqual(w.statusesOf(row!.operation_key), [500, 200]);
    assert.deepEqual(callsByKey(w.api).get(row!.operation_key)!.map((call) => call.executed), [true, false], 'the first call executed; the retry did not execute again');
    assert.equal(w.api.executionsByKey().get(row!.operation_key), 1, 'one execution');
    assert.equal(row!.attempt_count, 2);
    assert.equal((await assetStatuses(w.bed.pool, [id!])).get(id!), 'deleted');
    await w.stopCleanly(worker);
  });

  test('connection reset: uncertain, retried with the same key, confirmed', async () => {
    const [id] = await seedAssets(w.bed.pool, 'reset', 1);
    const { worker } = await w.startWorker('w-reset');
    w.api.configure({ resetNext: 1 });
    await w.trigger();
    const [row] = await w.finished([id!]);
    assert.equal(row!.outcome, 'confirmed');
    assert.deepEqual(w.statusesOf(row!.operation_key), ['reset', 200]);
    assert.equal(row!.attempt_count, 2);
    assert.equal(w.api.executionsByKey().get(row!.operation_key), 1);
    await w.stopCleanly(worker);
  });

  test('403: rejected, never called again', async () => {
    const [id] = await seedAssets(w.bed.pool, 'forbidden', 1);
    const { worker } = await w.startWorker('w-403');
    w.api.configure({ rejectIds: new Set([id!]) });
    await w.trigger();
    const [row] = await w.finished([id!]);
    assert.equal(row!.outcome, 'rejected');
    assert.equal(row!.attempt_count, 1);
    // Another run, and several ledger-sweeper passes: the asset is still expired and active, and
    // nothing calls for it again.
    await w.trigger();
    await w.quietFor(3_000);
    assert.deepEqual(w.statusesOf(row!.operation_key), [403], 'one call, never retried');
    assert.deepEqual((await ledgerRows(w.bed.pool, [id!]))[0], row, 'the ledger row did not move');
    assert.equal((await assetStatuses(w.bed.pool, [id!])).get(id!), 'active', 'a rejected asset is not marked deleted');
    w.api.configure({ rejectIds: new Set() });
    await w.stopCleanly(worker);
  });

  test('uncertain on every attempt: gave-up after retry.maxAttempts (3), no call after that', async () => {
    const [id] = await seedAssets(w.bed.pool, 'hopeless', 1);
    const { worker } = await w.startWorker('w-gave-up');
    w.api.configure({ failNext: 3, failStatus: 503 });
    await w.trigger();
    const [row] = await w.finished([id!]);
    assert.equal(row!.outcome, 'gave-up');
    assert.equal(row!.attempt_count, 3);
    await w.trigger();
    await w.quietFor(3_000);
    assert.deepEqual(w.statusesOf(row!.operation_key), [503, 503, 503], 'exactly maxAttempts calls');
    assert.equal((await assetStatuses(w.bed.pool, [id!])).get(id!), 'active');
    await w.stopCleanly(worker);
  });

});
