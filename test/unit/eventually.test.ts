import assert, { AssertionError } from 'node:assert/strict';
import { test } from 'node:test';
import { eventually } from '../support/eventually';

/**
 * The tests' poll with a deadline (test/support/eventually.ts), issue 43: an assertion failing in a
 * probe is the test's verdict and fails at once with its own message; any other error is a state
 * that may pass (a server restarting) and is retried until the deadline, which then names it.
 */

test('an assertion failing inside the probe fails the wait at once, with its own message, not as a late timeout', async () => {
  let calls = 0;
  const started = performance.now();
  await assert.rejects(
    eventually(
      'a count of 3',
      () => {
        calls += 1;
        assert.equal(calls + 1, 3, 'the count is 3');
        return true;
      },
      { timeoutMs: 10_000, intervalMs: 10 },
    ),
    (error: unknown) => error instanceof AssertionError && error.message.startsWith('the count is 3') && !/timed out/.test(error.message),
  );
  assert.equal(calls, 1, 'the probe ran once: a failed assertion is not retried');
  // Far below the 10 s deadline whatever the machine: the wait never slept out its deadline.
  assert.ok(performance.now() - started < 5_000);
});

test('any other error is retried: a probe that throws, then passes, returns its value', async () => {
  let calls = 0;
  const value = await eventually(
    'the server to answer',
    () => {
      calls += 1;
      if (calls < 3) throw new Error('connect ECONNREFUSED 127.0.0.1:5432');
      return 'answered';
    },
    { timeoutMs: 10_000, intervalMs: 1 },
  );
  assert.equal(value, 'answered');
  assert.equal(calls, 3);
});

test('an error that persists past the deadline is named in the timeout, with the state described', async () => {
  await assert.rejects(
    eventually(
      'the server to answer',
      () => {
        throw new Error('connect ECONNREFUSED 127.0.0.1:5432');
      },
      { timeoutMs: 30, intervalMs: 5, describe: () => ({ attempts: 'many' }) },
    ),
    (error: unknown) =>
      error instanceof Error &&
      !(error instanceof AssertionError) &&
      /^timed out after 30 ms waiting for the server to answer; state: \{"attempts":"many"\}; last error: Error: connect ECONNREFUSED/.test(error.message),
  );
});

test('undefined and false mean "not yet"; the first other value is returned, 0 and "" included', async () => {
  const answers: unknown[] = [undefined, false, 0];
  assert.equal(await eventually('a value', () => answers.shift(), { intervalMs: 1 }), 0);
  assert.equal(await eventually('an empty string', () => '', { intervalMs: 1 }), '');
});
