/**
 * A CLI command started as PID 1 stops on SIGTERM (issue 11). PID 1 of a PID namespace (a
 * container, a Kubernetes Job's pod) gets no signal whose handler is the default one: Node installs
 * none for SIGTERM, so without reaper's own handler `docker compose run --rm cli trigger --wait` or
 * a Job ignored `docker stop` / pod deletion until SIGKILL. Here `unshare -fp --mount-proc` makes a
 * new PID namespace in which `reaper trigger --wait` (waiting on a run no scheduler executes) is
 * PID 1, and SIGTERM is sent to it from outside.
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { eventually } from '../support/eventually';
import { REAPER_BIN } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';

let bed: TestBed;

before(async () => {
  bed = await makeTestBed('cli_signals');
});

after(async () => {
  await bed?.close();
});

/** The host pid of the single child of `parent` (unshare --fork's child: PID 1 inside). */
function childOf(parent: number): number | undefined {
  try {
    const children = readFileSync(`/proc/${parent}/task/${parent}/children`, 'utf8').trim();
    return children === '' ? undefined : Number(children.split(/\s+/)[0]);
  } catch {
    return undefined;
  }
}

test('unshare is permitted here (this test needs a new PID namespace)', () => {
  // Checked, not assumed: a sandbox that forbids user or PID namespaces would fail here, naming why.
  assert.equal(execFileSync('unshare', ['-fp', '--mount-proc', 'sh', '-c', 'echo $$'], { encoding: 'utf8' }).trim(), '1');
});

for (const signal of ['SIGTERM', 'SIGINT'] as const) {
  test(`\`reaper trigger --wait\` as PID 1 of a new PID namespace stops on ${signal}`, async () => {
    const output: string[] = [];
    const child = spawn('unshare', ['-fp', '--mount-proc', process.execPath, REAPER_BIN, 'trigger', 'seat-holds', '--wait', '--timeout', '120'], {
      env: bed.processEnv(),
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    child.stdout.on('data', (chunk: Buffer) => output.push(chunk.toString()));
    child.stderr.on('data', (chunk: Buffer) => output.push(chunk.toString()));
    const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
    try {
      // Waiting on the run: it printed its first progress line, so its handlers are installed.
      await eventually('the CLI is waiting on its run', () => /pending/.test(output.join('')), { timeoutMs: 20_000, describe: () => output.join('') });
      const reaper = childOf(child.pid!);
      assert.ok(reaper, 'unshare forked the CLI');
      const inside = readFileSync(`/proc/${reaper}/status`, 'utf8').match(/^NSpid:\s+(.*)$/m)?.[1]?.split(/\s+/);
      assert.equal(inside?.at(-1), '1', `the CLI is PID 1 in its namespace (NSpid ${inside?.join(' ')})`);
      process.kill(reaper, signal);
      const code = await Promise.race([exited, new Promise<'still running'>((resolve) => setTimeout(() => resolve('still running'), 10_000))]);
      assert.equal(code, signal === 'SIGTERM' ? 143 : 130, `exit code after ${signal}; output: ${output.join('')}`);
      assert.match(output.join(''), new RegExp(`stopped by ${signal}`));
    } finally {
      const reaper = childOf(child.pid!);
      if (reaper) process.kill(reaper, 'SIGKILL');
      child.kill('SIGKILL');
      await exited;
    }
  });
}
