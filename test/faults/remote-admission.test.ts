import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { MediaApiCall } from '../../tools/media-api/server';
import { recordAdmissionEvents } from '../support/admission-events';
import { eventually } from '../support/eventually';
import { callsByKey, MEDIA_POLICY, seedAssets } from '../support/remote-helpers';
import { transitionsWorld } from '../support/remote-transitions-world';

/**
 * The remote ledger's failure transitions on the admission side, with real worker processes:
 *  - an open circuit: refused calls are not made and not counted as attempts;
 *  - a 429: the WHOLE policy is blocked for the Retry-After, and the bucket starts empty after it;
 *  - a grant that cannot be used in time (today's contract, shared/admission/controller.ts: late
 *    grants are not thrown away; when the bucket could have filled meanwhile and no fresh token is
 *    left, no call is made and the attempt is not counted: the claim's attempt is refunded, the
 *    operation is due again at once, and the token it took stays spent).
 * Each test has its own worker (a fresh circuit breaker) and its own assets.
 */
describe('remote-delete: admission failure transitions against reaper workers', () => {
  const w = transitionsWorld('fault_remote_admission');

  test('an open circuit makes no call and counts no attempt', async () => {
    const ids = await seedAssets(w.bed.pool, 'breaker', 12);
    // Concurrency 4: the first ten calls fail within the breaker's window (volume 10, 50%): it opens.
    // The open circuit tries again after 2 s, not the production 10 s (shared/config/test-timings.ts).
    const { worker, metrics } = await w.startWorker('w-breaker', { concurrency: 4 }, { REAPER_TEST_BREAKER_RESET_MS: '2000' });
    const callsBefore = w.api.calls.length;
    w.api.configure({ failNext: 10, failStatus: 503 });
    await w.trigger();
    const rows = await w.finished(ids, 60_000);
    const m = await metrics();
    const calls = w.api.calls.slice(callsBefore);
    const refused = m.sum('reaper_remote_calls_total', { outcome: 'circuit-open' });
    console.log(`[remote-transitions] breaker: calls=${calls.length} refused by the open circuit=${refused}`);
    assert.ok(refused >= 1, `the circuit opened and refused calls (${refused})`);
    assert.equal(m.sum('reaper_remote_attempts_total'), calls.length, 'attempts counted = calls made (a refused call is none)');
    for (const row of rows) {
      assert.equal(row.outcome, 'confirmed', `${row.operation_key} confirmed once the circuit closed`);
      assert.equal(row.attempt_count, (callsByKey(w.api).get(row.operation_key) ?? []).length, `${row.operation_key}: attempt_count = its calls`);
      assert.equal(w.api.executionsByKey().get(row.operation_key), 1);
    }
    await w.stopCleanly(worker);
  });

  test('a 429 blocks the whole policy for its Retry-After, and the bucket starts empty after it', async () => {
    const RATE = 4;
    const RETRY_AFTER_S = 2;
    const ids = await seedAssets(w.bed.pool, 'blocked', 12);
    await w.bed.pool.query('DELETE FROM cleanup_admission WHERE policy = $1', [MEDIA_POLICY]); // a full bucket to start from
    // What admission decided, stamped by the database itself: every claim (a grant of one call)
    // and the moment the block was recorded. Grants and the block serialise on the admission row,
    // so "no grant after the block was recorded until it ends" is exact, whatever the machine speed.
    const recorded = await recordAdmissionEvents(w.bed.pool);
    const { worker } = await w.startWorker('w-429', { ratePerSecond: RATE, burst: 8, concurrency: 4 });
    const callsBefore = w.api.calls.length;
    w.api.configure({ throttleNext: 1, throttleRetryAfterSeconds: RETRY_AFTER_S });
    try {
      await w.trigger();
      const rows = await w.finished(ids);
      const calls = w.api.calls.slice(callsBefore);
      const throttled = calls.filter((call) => call.status === 429);
      assert.equal(throttled.length, 1, 'one 429');
      assert.equal(throttled[0]!.retryAfterSeconds, RETRY_AFTER_S);
      const events = await recorded.read();
      const blocks = events.filter((e) => e.kind === 'block');
      assert.equal(blocks.length, 1, 'one block recorded');
      const blockedAt = blocks[0]!.ms;
      const blockedUntil = (
        await w.bed.pool.query<{ ms: number }>(`SELECT (extract(epoch FROM blocked_until) * 1000)::float8 AS ms FROM cleanup_admission WHERE policy = $1`, [MEDIA_POLICY])
      ).rows[0]!.ms;
      // Blocked for exactly the Retry-After from an instant inside the statement that recorded it
      // (between its start and its trigger), not "within 50 ms" of a stamp a loaded machine delays.
      const blockFrom = blockedUntil - RETRY_AFTER_S * 1000;
      assert.ok(blockFrom >= blocks[0]!.statementMs - 1 && blockFrom <= blockedAt + 1, `blocked for the Retry-After from the block's statement (${blockFrom} in [${blocks[0]!.statementMs}, ${blockedAt}])`);
      const claims = events.filter((e) => e.kind === 'claim');
      const duringBlock = claims.filter((c) => c.ms > blockedAt && c.ms < blockedUntil);
      assert.deepEqual(duringBlock, [], 'no grant for ANY asset of the policy from the block until its end');
      const afterBlock = claims.filter((c) => c.ms >= blockedUntil);
      assert.ok(afterBlock.length >= 2, `assets other than the throttled one waited for the block (${afterBlock.length} grants after it)`);
      // From an EMPTY bucket at the end of the block, the i-th grant after it needs i tokens:
      // not before i / RATE seconds. (A bucket left full would grant 4 at once at the end.)
      // Decided instants (the bucket's own clock), not the trigger's stamps taken after them.
      const early = afterBlock.map((c, index) => ({ grant: index + 1, atMs: Math.round(c.decidedMs! - blockedUntil) })).filter((g) => g.grant > (g.atMs * RATE) / 1000 + 0.01);
      assert.deepEqual(early, [], `grants after the block are paced from an empty bucket at ${RATE}/s`);
      const callsInBlock = calls.filter((call) => call.startedAt > blockedAt && call.startedAt < blockedUntil).length;
      console.log(`[remote-transitions] 429: grants during the block=0, after it=${afterBlock.length}; calls reaching the stand-in during the block (granted before it)=${callsInBlock}`);
      for (const row of rows) {
        assert.equal(row.outcome, 'confirmed');
        assert.equal(w.api.executionsByKey().get(row.operation_key), 1);
        assert.equal(row.attempt_count, (callsByKey(w.api).get(row.operation_key) ?? []).length, 'a 429 is an attempt');
      }
      await w.stopCleanly(worker);
    } finally {
      w.api.configure({ throttleNext: 0 });
      await recorded.remove();
    }
  });

  test('a grant that cannot be used in time: no call, no attempt counted, due again at once (today: no token refund)', async () => {
    const ids = await seedAssets(w.bed.pool, 'late-grant', 4);
    await w.bed.pool.query('DELETE FROM cleanup_admission WHERE policy = $1', [MEDIA_POLICY]); // a full bucket: capacity 4 at 0.5/s, burst 5
    // A slow COMMIT of the first claim (as a busy or synchronously replicated database has): the
    // grant is read before the commit and used after it, 300 ms late. A deferred constraint
    // trigger runs at COMMIT. The same commit spends the bucket far ahead (-1000 tokens), so when
    // the worker asks for a fresh token for its late grant there is none, however late this
    // machine makes it (a CPU-starved worker late by seconds would otherwise find one refilled).
    await w.bed.pool.query(`CREATE TABLE reaper_test_late_once (done boolean NOT NULL)`);
    await w.bed.pool.query(`INSERT INTO reaper_test_late_once VALUES (false)`);
    await w.bed.pool.query(`CREATE OR REPLACE FUNCTION reaper_test_slow_commit() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN
        IF NOT (SELECT done FROM reaper_test_late_once) THEN
          UPDATE reaper_test_late_once SET done = true;
          UPDATE cleanup_admission SET tokens = -1000 WHERE policy = NEW.policy;
          PERFORM pg_sleep(0.3);
        END IF;
        RETURN NULL;
      END $$`);
    await w.bed.pool.query(`CREATE CONSTRAINT TRIGGER reaper_test_slow_commit AFTER UPDATE ON cleanup_ledger DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW WHEN (NEW.state = 'in_flight' AND OLD.state <> 'in_flight') EXECUTE FUNCTION reaper_test_slow_commit()`);
    try {
      const { worker, metrics } = await w.startWorker('w-late-grant', { ratePerSecond: 0.5, burst: 5, concurrency: 4 });
      const callsBefore = w.api.calls.length;
      await w.trigger();
      // The first grant expired unused; then the bucket starts again from empty (0.5/s).
      await eventually('the first grant to expire unused', async () => (await metrics()).sum('reaper_operations_total', { result: 'grant-expired' }) >= 1, { timeoutMs: 30_000 });
      await w.bed.pool.query(`UPDATE cleanup_admission SET tokens = 0, refilled_at = clock_timestamp() WHERE policy = $1`, [MEDIA_POLICY]);
      const rows = await w.finished(ids);
      const calls = w.api.calls.slice(callsBefore);
      const m = await metrics();
      const expired = m.sum('reaper_operations_total', { result: 'grant-expired' });
      const granted = m.sum('reaper_remote_grants_admitted_total');
      console.log(`[remote-transitions] late grants: granted=${granted} expired unused=${expired} calls=${calls.length}`);
      // The first grant takes the full bucket (4); 300 ms later the bucket could have refilled
      // past its capacity, so each call needs a fresh token, and there is none: no call.
      assert.ok(expired >= 1, `claims of the first grant expired unused (${expired})`);
      assert.equal(granted, calls.length + expired, 'every grant either became a call or expired unused');
      assert.equal(calls.length, 4, 'one call per asset');
      assert.equal(m.sum('reaper_remote_attempts_total'), 4, 'attempts are calls made');
      for (const row of rows) {
        assert.equal(row.outcome, 'confirmed');
        assert.equal(row.attempt_count, 1, `${row.operation_key}: the unused claim's attempt was refunded`);
        assert.equal(w.api.executionsByKey().get(row.operation_key), 1);
      }
      // Paced by the bucket, not by the late grants: never more than capacity + rate × t.
      const starts = calls.map((call: MediaApiCall) => call.startedAt).sort((a, b) => a - b);
      assert.ok(starts.every((at, index) => index + 1 <= 4 + Math.floor((at - starts[0]!) / 1000) + 1));
      await w.stopCleanly(worker);
    } finally {
      await w.bed.pool.query('DROP TRIGGER IF EXISTS reaper_test_slow_commit ON cleanup_ledger');
      await w.bed.pool.query('DROP TABLE IF EXISTS reaper_test_late_once');
    }
  });
});
