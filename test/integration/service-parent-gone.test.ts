/**
 * A service started with an IPC channel stops when its parent is gone (services/cli/services.ts
 * runService). `reaper demo` starts its scheduler and workers so: a demo killed abruptly (SIGKILL,
 * a closed terminal) used to leave its scheduler claiming runs in the demo database until somebody
 * found it. Here a stand-in parent starts `reaper scheduler` the way the demo does and is SIGKILLed;
 * the scheduler must drain and exit by itself, and say why.
 */
import assert from 'node:assert/strict';
import { createInterface } from 'node:readline';
import { after, before, test } from 'node:test';
import type { ChildProcess } from 'node:child_process';
import { asDeployedEnv, assertNoLeakedProcesses, processStartTicks, REAPER_BIN, signalGroup, spawnOwned } from '../support/processes';
import { eventually } from '../support/eventually';
import { makeTestBed, type TestBed } from '../support/testbed';

let bed: TestBed;
let parent: ChildProcess | undefined;

before(async () => {
  bed = await makeTestBed('service_parent_gone');
});

after(async () => {
  try {
    if (parent) signalGroup(parent, 'SIGKILL'); // the scheduler is in the parent's group: a failed test leaves neither behind
    await assertNoLeakedProcesses();
  } finally {
    await bed?.close();
  }
});

/** Starts `reaper scheduler` with stdio and an IPC channel as `reaper demo` does, and prints its pid. */
const PARENT_SCRIPT = `
const { spawn } = require('node:child_process');
const child = spawn(process.execPath, [process.argv[1], 'scheduler'], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
process.stdout.write(JSON.stringify({ msg: 'parent started the scheduler', pid: child.pid }) + '\\n');
setInterval(() => undefined, 60_000);
`;

test('a scheduler whose parent (the demo) is SIGKILLed drains and exits by itself', async () => {
  parent = spawnOwned(process.execPath, ['-e', PARENT_SCRIPT, REAPER_BIN], { env: asDeployedEnv(['scheduler'], bed.processEnv()), stdio: ['ignore', 'pipe', 'pipe'] });
  const lines: Array<Record<string, unknown>> = [];
  createInterface({ input: parent.stdout! }).on('line', (line) => {
    try {
      lines.push(JSON.parse(line) as Record<string, unknown>);
    } catch {
      lines.push({ msg: line });
    }
  });
  const logged = (msg: string) => lines.find((line) => line.msg === msg);
  const started = await eventually('the parent started the scheduler', () => logged('parent started the scheduler'), { timeoutMs: 30_000 });
  const schedulerPid = Number(started.pid);
  await eventually('the scheduler started', () => logged('scheduler started'), { timeoutMs: 30_000 });

  process.kill(parent.pid!, 'SIGKILL'); // the parent alone, not its group: the scheduler is left an orphan
  await eventually('the orphaned scheduler exited', () => processStartTicks(schedulerPid) === undefined, { timeoutMs: 30_000, intervalMs: 100 });
  assert.equal(logged('scheduler draining')?.signal, 'parent gone', 'the scheduler said why it stopped');
  assert.ok(logged('scheduler stopped'), 'the scheduler drained before it exited (not killed)');
});
