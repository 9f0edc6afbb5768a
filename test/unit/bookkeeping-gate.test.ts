import assert from 'node:assert/strict';
import { test } from 'node:test';
import pg from 'pg';
import { bookkeepingGate, makeGate } from '../../services/worker/bookkeeping-gate';

/** A work the test ends by hand: it records when it started, and resolves or fails on demand. */
function manualWork(log: string[], name: string) {
  let finish!: (value: string) => void;
  let fail!: (error: Error) => void;
  const started = { value: false };
  const work = () => {
    started.value = true;
    log.push(`start ${name}`);
    return new Promise<string>((resolve, reject) => {
      finish = resolve;
      fail = reject;
    });
  };
  return { work, started, finish: (value = name) => finish(value), fail: (error: Error) => fail(error) };
}

const tick = () => new Promise((resolve) => setImmediate(resolve));

test('the gate runs at most its slots at once, the others in arrival order as slots free; a failed work frees its slot too', async () => {
  const gate = makeGate(2);
  const log: string[] = [];
  const [a, b, c, d] = ['a', 'b', 'c', 'd'].map((name) => manualWork(log, name));
  const runs = [a, b, c, d].map((entry) => gate.run(entry!.work));
  await tick();
  assert.deepEqual(log, ['start a', 'start b'], 'two at once');
  b!.fail(new Error('b failed'));
  await assert.rejects(runs[1]!, /b failed/);
  await tick();
  assert.deepEqual(log, ['start a', 'start b', 'start c'], 'the failed work gave its slot to the first waiting');
  assert.equal(d!.started.value, false);
  a!.finish();
  assert.equal(await runs[0], 'a');
  await tick();
  assert.equal(d!.started.value, true);
  c!.finish();
  d!.finish();
  assert.deepEqual(await Promise.all([runs[2], runs[3]]), ['c', 'd']);
  // All slots given back: two start at once again.
  const [e, f] = ['e', 'f'].map((name) => manualWork(log, name));
  const more = [gate.run(e!.work), gate.run(f!.work)];
  await tick();
  assert.equal(e!.started.value && f!.started.value, true);
  e!.finish();
  f!.finish();
  await Promise.all(more);
});

test("a pool's gate leaves one of its connections to the rate's path (one slot at least), the same gate for every caller of that pool", async () => {
  const pools = [new pg.Pool({ max: 4 }), new pg.Pool({ max: 1 })];
  try {
    const [four, one] = pools as [pg.Pool, pg.Pool];
    assert.equal(bookkeepingGate(four), bookkeepingGate(four), 'one gate per pool');
    for (const [pool, slots] of [[four, 3], [one, 1]] as const) {
      const log: string[] = [];
      const works = Array.from({ length: slots + 1 }, (_, i) => manualWork(log, String(i)));
      const runs = works.map((entry) => bookkeepingGate(pool).run(entry.work));
      await tick();
      assert.equal(log.length, slots, `pool of ${pool.options.max}: ${slots} at once`);
      for (const entry of works) {
        await tick();
        entry.finish();
      }
      await Promise.all(runs);
    }
  } finally {
    // Never connected: nothing to close but the objects.
    await Promise.all(pools.map((pool) => pool.end()));
  }
});
