import { after, before, describe, test } from 'node:test';

/**
 * Not a test of reaper: a file the timeout test (test/unit/test-timeout.test.ts) runs through
 * test/run.js to show that a test, or a hook, that waits forever fails with its name within the
 * per-test timeout, the rest of the file still runs, and the file ends. What hangs is chosen by
 * REAPER_FIXTURE_HANG (`test`, `hook`, or `context-hook`: a t.after of a test); the hang holds a timer, as a stuck socket would.
 */
const hang = () => new Promise<void>(() => setInterval(() => undefined, 1_000));

describe('fixture suite', () => {
  before(async () => {
    if (process.env.REAPER_FIXTURE_HANG === 'hook') await hang();
  });

  after(() => {
    process.stdout.write('fixture: the after hook ran\n');
  });

  test('fixture test that waits forever', async () => {
    if (process.env.REAPER_FIXTURE_HANG === 'test') await hang();
  });

  test('fixture test after the hanging one', () => undefined);

  test('fixture test whose own after hook waits forever', (t) => {
    if (process.env.REAPER_FIXTURE_HANG === 'context-hook') t.after(hang);
  });
});
