import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { type MediaApiCall } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import {
  assertRetention,
  remoteWorldSuite,
  allConfirmed,
  callsByKey,
  ledgerRows,
  MEDIA_POLICY,
  seedAssets,
  startRemoteServices,
} from '../support/remote-helpers';
import { stopAllCleanly } from '../support/fixtures';

/**
 * 429 + Retry-After (docs/design.md "Remote API calls", invariants 7, 10 and 11), two worker processes:
 * the stand-in first throttles every call for a few seconds from the first call on (Retry-After
 * counting down to the end of the throttle), then answers the next THROTTLED_AFTER calls 429 with
 * Retry-After: 1 (a number of calls, not a rate: how many 429s come does not depend on how fast
 * this machine is). For every key, no call starts before the previous 429's Retry-After elapsed
 * (a slow worker only makes the margin larger); every operation ends confirmed; each key executed
 * once; each call is one cleanup attempt.
 */
const ASSETS = 20;
const THROTTLE_MS = 2_500;
const THROTTLED_AFTER = 6;
const API_RETRY_AFTER_S = 1;

describe('remote-delete: 429 with Retry-After', () => {
  const world = remoteWorldSuite('remote_429', { ratePerSecond: 20, burst: 5, concurrency: 4, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 });

  test('no key is called again before its Retry-After; all confirmed; each key executed once', async () => {
    const ids = await seedAssets(world.bed.pool, 'throttled', ASSETS);
    const { all } = await startRemoteServices(world.bed, { scheduler: 'r429-scheduler', workers: ['r429-worker-1', 'r429-worker-2'] });

    // The throttle window starts at the first call that arrives (however long the trigger, the
    // scan and the first grant take on this machine), and the Retry-After of every 429 is read
    // from what the stand-in actually sent: no wall-clock window, no recomputed rounding.
    const callsBefore = world.api.calls.length;
    world.api.configure({ throttleForMs: THROTTLE_MS, throttleNext: THROTTLED_AFTER, throttleRetryAfterSeconds: API_RETRY_AFTER_S });
    const trigger = await runReaperCli(['trigger', MEDIA_POLICY], world.bed.processEnv());
    assert.equal(trigger.code, 0, trigger.stdout);

    await allConfirmed(world, ASSETS, 45_000);
    const retryAfterMsOf = (call: MediaApiCall): number => call.retryAfterSeconds! * 1000;

    const byKey = callsByKey(world.api);
    // Told apart by arrival order, not by time: every 429 of the window comes before the counted
    // ones, and the counted ones are the calls right after the window.
    const answered429 = world.api.calls.slice(callsBefore).filter((call) => call.status === 429);
    const counted = answered429.slice(-THROTTLED_AFTER);
    const throttled = answered429.length - counted.length;
    const violations: string[] = [];
    let smallestMarginMs = Infinity;
    for (const [key, calls] of byKey) {
      for (let i = 1; i < calls.length; i++) {
        const previous = calls[i - 1]!;
        if (previous.status !== 429) continue;
        const earliest = previous.finishedAt + retryAfterMsOf(previous);
        smallestMarginMs = Math.min(smallestMarginMs, calls[i]!.startedAt - earliest);
        if (calls[i]!.startedAt < earliest) {
          violations.push(`${key}: call ${calls[i]!.seq} at +${calls[i]!.startedAt - previous.finishedAt} ms after a 429 with Retry-After ${retryAfterMsOf(previous)} ms`);
        }
      }
    }
    console.log(
      `[remote-429] calls=${world.api.calls.length} 429-throttle=${throttled} 429-after-it=${counted.length} ` +
        `keys-with-429=${[...byKey.values()].filter((c) => c.some((x) => x.status === 429)).length} smallest-margin-after-retry-after=${smallestMarginMs} ms`,
    );
    if (process.env.TEST_TIMELINE) {
      const t0 = world.api.calls[0]!.startedAt;
      console.log(world.api.calls.map((call) => `+${call.startedAt - t0} ms ${call.status} ${call.id}`).join('\n'));
    }
    assert.ok(throttled > 0, 'the throttle answered 429 to some calls (else this test proves nothing)');
    assert.deepEqual(
      counted.map((call, index) => ({ afterPrevious: index === 0 ? 1 : call.seq - counted[index - 1]!.seq, retryAfterSeconds: call.retryAfterSeconds })),
      counted.map(() => ({ afterPrevious: 1, retryAfterSeconds: API_RETRY_AFTER_S })),
      `after the throttle window, the next ${THROTTLED_AFTER} calls got 429 with Retry-After ${API_RETRY_AFTER_S} s`,
    );
    assert.deepEqual(violations, [], 'no call before the previous 429 Retry-After elapsed');

    const rows = await ledgerRows(world.bed.pool);
    assert.equal(rows.length, ASSETS, 'one operation per asset');
    assert.deepEqual(rows.map((row) => row.asset_id).sort(), ids);
    const executions = world.api.executionsByKey();
    for (const row of rows) {
      assert.equal(row.outcome, 'confirmed', `${row.operation_key} confirmed`);
      assert.equal(executions.get(row.operation_key), 1, `${row.operation_key} executed exactly once`);
      const calls = byKey.get(row.operation_key) ?? [];
      // Invariant 11: attempts are remote calls (a 429 is an attempt); deliveries are counted apart.
      assert.equal(row.attempt_count, calls.length, `${row.operation_key}: attempt_count ${row.attempt_count} = calls ${calls.length}`);
      assert.equal(calls.filter((call) => call.status === 200).length, 1, `${row.operation_key}: one 200`);
      assert.equal(calls[calls.length - 1]!.status, 200, `${row.operation_key}: the last call is the one that deleted`);
    }
    assert.equal(byKey.size, ASSETS, 'every call carried a ledger operation key');
    assertRetention(rows);

    await stopAllCleanly(all);
  });
});
