import assert from 'node:assert/strict';
import { test } from 'node:test';
import { makeCoalescer } from '../../services/worker/coalescer';

/**
 * The coalescer's grouping rules, driven by hand: each group's `run` is held open until the test
 * lets it finish, so which items went out together is exactly what the rules decide.
 */
function harness(options: { maxGroups: number; maxItems: number; minItemsBeside?: number }) {
  const groups: Array<{ items: number[]; finish: () => void }> = [];
  const coalescer = makeCoalescer<number, string>({
    ...options,
    run: (items) =>
      new Promise<string[]>((resolve) => {
        groups.push({ items, finish: () => resolve(items.map((item) => `done ${item}`)) });
      }),
  });
  return { groups, submit: (item: number) => coalescer.submit(item) };
}

/** Lets the coalescer's setImmediate pump (and the promise callbacks before it) run. */
const turn = (): Promise<void> => new Promise((resolve) => setImmediate(resolve));

test('items submitted in one turn go out as one group, at most maxItems each', async () => {
  const { groups, submit } = harness({ maxGroups: 2, maxItems: 3 });
  const results = [1, 2, 3, 4].map(submit);
  await turn();
  assert.deepEqual(groups.map((group) => group.items), [[1, 2, 3], [4]]);
  for (const group of groups) group.finish();
  assert.deepEqual(await Promise.all(results), ['done 1', 'done 2', 'done 3', 'done 4']);
});

test('minItemsBeside: beside a running group a new one waits for that many items, or for the running group to end', async () => {
  const { groups, submit } = harness({ maxGroups: 2, maxItems: 10, minItemsBeside: 3 });
  const first = submit(1);
  await turn();
  assert.deepEqual(groups.map((group) => group.items), [[1]], 'nothing running: a single item goes out at once');

  const few = [2, 3].map(submit);
  await turn();
  assert.equal(groups.length, 1, 'two items beside a running group wait');
  const third = submit(4);
  await turn();
  assert.deepEqual(groups.map((group) => group.items), [[1], [2, 3, 4]], 'the third makes a group worth starting beside it');

  const late = submit(5);
  await turn();
  assert.equal(groups.length, 2, 'both groups busy: the next waits');
  groups[0]!.finish();
  assert.equal(await first, 'done 1');
  await turn();
  assert.equal(groups.length, 2, 'one group ended, one runs on: a single item still waits beside it');
  groups[1]!.finish();
  await Promise.all([...few, third]);
  await turn();
  assert.deepEqual(groups[2]?.items, [5], 'nothing running: what waits goes out, however few');
  groups[2]!.finish();
  assert.deepEqual(await Promise.all([...few, third, late]), ['done 2', 'done 3', 'done 4', 'done 5']);
});

test('without minItemsBeside a second group starts beside the first with a single item', async () => {
  const { groups, submit } = harness({ maxGroups: 2, maxItems: 10 });
  const results = [submit(1)];
  await turn();
  results.push(submit(2));
  await turn();
  assert.deepEqual(groups.map((group) => group.items), [[1], [2]]);
  for (const group of groups) group.finish();
  await Promise.all(results);
});
