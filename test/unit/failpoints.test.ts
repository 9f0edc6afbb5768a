import assert from 'node:assert/strict';
import { test } from 'node:test';
import { spawnSync } from 'node:child_process';
import { cpSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { failpoint, TEST_FAILPOINT_VARIABLE } from '../../shared/testing/failpoints';
import { failpoint as productFailpoint, refuseTestOnlyVariables, TEST_ONLY_VARIABLES } from '../../shared/observability/failpoint-hook';
import { loadTestTimings, TEST_TIMING_VARIABLES } from '../../shared/config/test-timings';
import { RELAY_CLAIM_MS, RELAY_EVENTS_PER_PASS, RELAY_UNROUTABLE_MAX_MS } from '../../services/relay/relay';
import { OUTBOX_FULL_RETRY_MS } from '../../services/worker/outbox-limit';
import { DEFAULT_BREAKER } from '../../shared/remote/client';
import { RETRY_MAX_MS } from '../../services/scheduler/run-executor';

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

test('the product hook delegates to the test module: an unknown name fails every check through it too', () => {
  process.env[TEST_FAILPOINT_VARIABLE] = 'before-comit';
  for (const check of [1, 2, 3]) assert.throws(() => productFailpoint('before-commit'), /names no failpoint/, `check ${check}`);
});

test('without shared/testing (the runtime image) the hook is a no-op when unarmed and refuses an armed variable', () => {
  // The compiled shared/ tree minus shared/testing, as infra/Dockerfile's runtime target copies it.
  const dist = path.resolve(__dirname, '..', '..');
  const image = mkdtempSync(path.join(tmpdir(), 'reaper-image-'));
  try {
    cpSync(path.join(dist, 'shared'), path.join(image, 'shared'), { recursive: true, filter: (source) => !source.startsWith(path.join(dist, 'shared', 'testing')) });
    const script = `require(${JSON.stringify(path.join(image, 'shared', 'observability', 'failpoint-hook.js'))}).failpoint('before-commit'); process.stdout.write('returned')`;
    const unarmed = spawnSync(process.execPath, ['-e', script], { env: { PATH: process.env.PATH }, encoding: 'utf8' });
    assert.equal(unarmed.status, 0, unarmed.stderr);
    assert.equal(unarmed.stdout, 'returned');
    const armed = spawnSync(process.execPath, ['-e', script], { env: { PATH: process.env.PATH, [TEST_FAILPOINT_VARIABLE]: 'before-commit' }, encoding: 'utf8' });
    assert.notEqual(armed.status, 0);
    assert.match(armed.stderr, /REAPER_TEST_FAILPOINT is test-only; this image has no failpoints/);
  } finally {
    rmSync(image, { recursive: true, force: true });
  }
});

test('a test-only variable where the image has no test support stops the service at start, naming it (issue 40)', () => {
  const absent = () => false;
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_FAILPOINT: 'after-commit' }, absent), /REAPER_TEST_FAILPOINT="after-commit": test-only, and this image has no test support: unset it/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_MAX_BATCH_VERSION: '1' }, absent), /REAPER_TEST_MAX_BATCH_VERSION="1": test-only/);
  assert.doesNotThrow(() => refuseTestOnlyVariables({}, absent), 'nothing set: nothing to refuse');
  assert.doesNotThrow(() => refuseTestOnlyVariables({ REAPER_TEST_FAILPOINT: 'after-commit' }, () => true), 'the source tree and test runs keep them');
});

test('the test timings (issue 43) are test-only too, validated once, and unset they are the production values', () => {
  const absent = () => false;
  for (const name of TEST_TIMING_VARIABLES) assert.ok((TEST_ONLY_VARIABLES as readonly string[]).includes(name), `${name} is refused in the runtime image`);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_RELAY_CLAIM_MS: '3000' }, absent), /REAPER_TEST_RELAY_CLAIM_MS="3000": test-only/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_OUTBOX_FULL_RETRY_MS: '1000' }, absent), /REAPER_TEST_OUTBOX_FULL_RETRY_MS="1000": test-only/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_BREAKER_RESET_MS: '2000' }, absent), /REAPER_TEST_BREAKER_RESET_MS="2000": test-only/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_RUN_RETRY_MAX_MS: '2000' }, absent), /REAPER_TEST_RUN_RETRY_MAX_MS="2000": test-only/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_RELAY_UNROUTABLE_MAX_MS: '1000' }, absent), /REAPER_TEST_RELAY_UNROUTABLE_MAX_MS="1000": test-only/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_RELAY_EVENTS_PER_PASS: '200' }, absent), /REAPER_TEST_RELAY_EVENTS_PER_PASS="200": test-only/);
  assert.throws(() => refuseTestOnlyVariables({ REAPER_TEST_CONFIRM_TIMEOUT_MS: '3000' }, absent), /REAPER_TEST_CONFIRM_TIMEOUT_MS="3000": test-only/);
  assert.deepEqual(loadTestTimings({}), { relayClaimMs: undefined, relayUnroutableMaxMs: undefined, relayEventsPerPass: undefined, outboxFullRetryMs: undefined, breakerResetMs: undefined, runRetryMaxMs: undefined, confirmTimeoutMs: undefined });
  assert.deepEqual(loadTestTimings({ REAPER_TEST_RELAY_CLAIM_MS: '3000', REAPER_TEST_OUTBOX_FULL_RETRY_MS: '', REAPER_TEST_BREAKER_RESET_MS: '2000', REAPER_TEST_RUN_RETRY_MAX_MS: '2000', REAPER_TEST_CONFIRM_TIMEOUT_MS: '3000' }), {
    relayClaimMs: 3000,
    relayUnroutableMaxMs: undefined,
    relayEventsPerPass: undefined,
    outboxFullRetryMs: undefined,
    breakerResetMs: 2000,
    runRetryMaxMs: 2000,
    confirmTimeoutMs: 3000,
  });
  assert.throws(() => loadTestTimings({ REAPER_TEST_RELAY_CLAIM_MS: '3s' }), /REAPER_TEST_RELAY_CLAIM_MS="3s": /);
  assert.throws(() => loadTestTimings({ REAPER_TEST_OUTBOX_FULL_RETRY_MS: '10' }), /REAPER_TEST_OUTBOX_FULL_RETRY_MS="10": .*100/);
  // The services use the production constants when nothing is set.
  assert.equal(RELAY_CLAIM_MS, 15_000);
  assert.equal(RELAY_UNROUTABLE_MAX_MS, 30_000);
  assert.equal(RELAY_EVENTS_PER_PASS, 2_000);
  assert.equal(OUTBOX_FULL_RETRY_MS, 10_000);
  assert.equal(DEFAULT_BREAKER.resetTimeoutMs, 10_000);
  assert.equal(RETRY_MAX_MS, 10_000);
});
