import assert from 'node:assert/strict';
import { test } from 'node:test';
import { failpoint, TEST_FAILPOINT_VARIABLE } from '../../shared/testing/failpoints';

/**
 * A failpoint name that is not a known point (a typo in a crash test) must fail EVERY check, not
 * only the first: a process that caught the first error (a handler's catch-all, a retry loop)
 * would otherwise run on as if no point were armed, and the crash test would pass without its
 * crash. This file runs in its own process (node --test), so arming the variable here touches
 * nothing else.
 */
test('an unknown REAPER_TEST_FAILPOINT fails every check, not only the first', () => {
  process.env[TEST_FAILPOINT_VARIABLE] = 'before-comit';
  for (const check of [1, 2, 3]) {
    assert.throws(() => failpoint('before-commit'), /names no failpoint/, `check ${check} refuses the unknown name`);
    assert.throws(() => failpoint('after-commit'), /names no failpoint/, `check ${check}, another point, refuses it too`);
  }
});
