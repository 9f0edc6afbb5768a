import assert from 'node:assert/strict';
import { test } from 'node:test';
import { untilSendAt, type S3Grant } from '../../shared/admission/s3';

/**
 * Object storage requests leave on the keys bucket's clock (shared/admission/s3.ts "Sending on the
 * bucket's clock"); within one process they also never leave closer than their keys allow, even
 * when the bucket has not heard yet of a late send's charge.
 */

function grant(keys: number, sendAt: number, keysPerSecond: number): S3Grant {
  return {
    claimed: Array.from({ length: keys }, (_, i) => ({ operationKey: `op-${i}`, assetId: String(i), attemptCount: 1 })),
    requestId: 'request',
    verdict: 'admitted',
    waitMs: 0,
    superseded: 0,
    held: 0,
    sendAt,
    keysPerSecond,
  };
}

/**
 * Whether `leaving` resolves without waiting for any timer: a few turns of the microtask queue,
 * which no setTimeout can fire within, whatever the machine's speed (a time bound would be one).
 */
async function leavesAtOnce(leaving: Promise<void>): Promise<boolean> {
  let left = false;
  void leaving.then(() => (left = true));
  for (let turn = 0; turn < 10 && !left; turn++) await Promise.resolve();
  return left;
}

test('a request waits for its sendAt; one already past it leaves at once', async () => {
  const started = performance.now();
  await untilSendAt('pacing-a', grant(1, started + 80, 1000));
  assert.ok(performance.now() - started >= 79, `left after ${performance.now() - started} ms, before its sendAt`);
  assert.ok(await leavesAtOnce(untilSendAt('pacing-b', grant(1, performance.now() - 500, 1000))), 'a late request is not held (no timer)');
});

test("two requests of one policy in one process leave at least the first one's keys apart, whatever their sendAt says", async () => {
  const now = performance.now();
  // 10 keys at 100 keys/s: 100 ms of keys. Both grants say "now" (the second's charge not seen yet).
  const first = untilSendAt('pacing-c', grant(10, now, 100)).then(() => performance.now());
  const second = untilSendAt('pacing-c', grant(10, now, 100)).then(() => performance.now());
  const [firstLeft, secondLeft] = await Promise.all([first, second]);
  assert.ok(secondLeft - firstLeft >= 95, `the second left ${(secondLeft - firstLeft).toFixed(1)} ms after the first (10 keys at 100 keys/s: 100 ms)`);
  // Another policy is paced on its own.
  assert.ok(await leavesAtOnce(untilSendAt('pacing-d', grant(10, performance.now(), 100))), 'another policy is not held behind pacing-c (no timer)');
});
