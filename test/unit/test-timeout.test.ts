import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import path from 'node:path';
import { test } from 'node:test';

/**
 * Issue 22 item 2: every test and hook is bounded on the Node that runs the suite (20 and 24 in
 * CI), through test/run.js exactly as `npm test` runs it. A fixture file that hangs runs with a
 * 2 s timeout: it must fail with the hanging test's (or hook's) name well within the bound, and
 * end (a hang that holds a timer does not keep the file alive).
 */
const ROOT = path.resolve(__dirname, '..', '..', '..');
const TIMEOUT_MS = 2_000;

function withoutTestContext(env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const { NODE_TEST_CONTEXT: _context, ...rest } = env;
  return rest;
}

async function runFixture(hang: 'test' | 'hook' | 'context-hook'): Promise<{ code: number | null; output: string; elapsedMs: number }> {
  const started = Date.now();
  const child = spawn(process.execPath, [path.join(ROOT, 'test', 'run.js'), 'test/support/hanging-fixture.ts', '--test-reporter=tap'], {
    cwd: ROOT,
    // Without NODE_TEST_CONTEXT, set for this file's process: the child is a runner of its own, not a part of this file.
    env: { ...withoutTestContext(process.env), REAPER_TEST_TIMEOUT_MS: String(TIMEOUT_MS), REAPER_FIXTURE_HANG: hang, REAPER_TEST_NO_SWEEP: '1' },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout.on('data', (chunk: Buffer) => (output += chunk.toString('utf8')));
  child.stderr.on('data', (chunk: Buffer) => (output += chunk.toString('utf8')));
  // The bound of this test itself: a runner that does not end the file would hang here.
  const killer = setTimeout(() => child.kill('SIGKILL'), 60_000);
  const code = await new Promise<number | null>((resolve) => child.once('exit', (exitCode) => resolve(exitCode)));
  clearTimeout(killer);
  return { code, output, elapsedMs: Date.now() - started };
}

test('a test that waits forever fails with its name after REAPER_TEST_TIMEOUT_MS; the rest of its file runs and the file ends', async () => {
  const { code, output, elapsedMs } = await runFixture('test');
  assert.notEqual(code, 0, output);
  assert.match(output, /not ok \d+ - fixture test that waits forever[\s\S]*?test timed out after 2000ms/, output);
  assert.match(output, /^\s*ok \d+ - fixture test after the hanging one/m, output);
  assert.match(output, /fixture: the after hook ran/, output);
  assert.ok(elapsedMs < 45_000, `the file ended in ${elapsedMs} ms (the hang holds a timer)`);
});

test("a hook that waits forever fails its suite after REAPER_TEST_TIMEOUT_MS ('failed running before hook'), and the file ends", async () => {
  const { code, output, elapsedMs } = await runFixture('hook');
  assert.notEqual(code, 0, output);
  assert.match(output, /not ok \d+ - fixture suite[\s\S]*?failureType: 'hookFailed'[\s\S]*?failed running before hook/, output);
  assert.match(output, /fixture: the after hook ran/, output);
  assert.ok(elapsedMs < 45_000, `the file ended in ${elapsedMs} ms`);
});

test("a test's own hook (t.after) that waits forever fails that test after REAPER_TEST_TIMEOUT_MS, and the file ends", async () => {
  const { code, output, elapsedMs } = await runFixture('context-hook');
  assert.notEqual(code, 0, output);
  assert.match(output, /not ok \d+ - fixture test whose own after hook waits forever[\s\S]*?failed running after hook/, output);
  assert.ok(elapsedMs < 45_000, `the file ended in ${elapsedMs} ms`);
});
