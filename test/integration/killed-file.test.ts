import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, test } from 'node:test';
import pg from 'pg';
import { listBrokerObjects, namesUnder } from '../support/broker';
import { eventually } from '../support/eventually';
import { findServers } from '../support/servers';
import { sweepLeftovers } from '../support/sweeper';

/**
 * Issue 22 item 3: nothing survives a killed test file. A fixture file (test/support/
 * killed-file-fixture.ts) run by `node --test` makes a test bed, a queue of its own, a worker it
 * freezes, and a standby's slot and folder; then the file's process is killed. SIGTERM (Ctrl-C, a
 * runner giving up): the file's exit handler takes the worker's process group with it at once and
 * the standby helper's clean-up drops the slot. SIGKILL (nothing runs): the worker, database,
 * queues, slot and folders stay; the sweeper of the next run removes them — not while
 * they are younger than its age threshold (an hour; other runs may be using theirs), and all of
 * them with threshold 0 (limited to this test's own names).
 */
const ROOT = path.resolve(__dirname, '..', '..', '..');
const FIXTURE = path.join(ROOT, 'dist', 'test', 'support', 'killed-file-fixture.js');
const folder = mkdtempSync(path.join(tmpdir(), 'reaper-killed-file-'));
after(() => rmSync(folder, { recursive: true, force: true }));

interface Made {
  pid: number;
  workerPid: number;
  database: string;
  prefix: string;
  slot: string;
  standbyDir: string;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** Field 3 (state) and field 5 (process group) of /proc/<pid>/stat. */
function procState(pid: number): { state: string; group: number } {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return { state: fields[0]!, group: Number(fields[2]) };
}

/** Runs the fixture file under `node --test` until it has made everything, then sends `signal` to the file's process. */
async function runAndKill(label: string, signal: NodeJS.Signals): Promise<Made> {
  const report = path.join(folder, `${label}.json`);
  const { NODE_TEST_CONTEXT: _context, ...env } = process.env; // the child is a runner of its own
  const runner = spawn(process.execPath, ['--test', '--test-reporter=tap', FIXTURE], {
    cwd: ROOT,
    env: { ...env, REAPER_FIXTURE_LABEL: label, REAPER_FIXTURE_REPORT: report },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  runner.stdout.on('data', (chunk: Buffer) => (output += chunk.toString('utf8')));
  runner.stderr.on('data', (chunk: Buffer) => (output += chunk.toString('utf8')));
  const ended = new Promise<void>((resolve) => runner.once('exit', () => resolve()));
  try {
    const made = await eventually('the fixture file to make its test bed and freeze its worker', () => (existsSync(report) ? (JSON.parse(readFileSync(report, 'utf8')) as Made) : undefined), {
      timeoutMs: 90_000,
      intervalMs: 200,
      describe: () => output.slice(-2000),
    });
    assert.deepEqual(procState(made.workerPid), { state: 'T', group: made.workerPid }, 'the worker is frozen and leads its own process group');
    process.kill(made.pid, signal);
    await ended;
    return made;
  } finally {
    runner.kill('SIGKILL'); // the runner itself, if an assertion above failed before it ended
  }
}

/** Whether the admin connection finds a row for `sql` (one parameter). */
async function exists(sql: string, value: string): Promise<boolean> {
  const admin = new pg.Client({ connectionString: (await findServers()).databaseUrl });
  await admin.connect();
  try {
    return (await admin.query(sql, [value])).rowCount === 1;
  } finally {
    await admin.end();
  }
}
const databaseExists = (name: string) => exists('SELECT 1 FROM pg_database WHERE datname = $1', name);
const slotExists = (name: string) => exists('SELECT 1 FROM pg_replication_slots WHERE slot_name = $1', name);

async function brokerNamesOf(prefix: string): Promise<string[]> {
  const listed = await listBrokerObjects((await findServers()).amqpUrl);
  assert.ok(listed, 'this test needs the broker listed (management API or a local rabbitmqctl)');
  const under = namesUnder(listed, [prefix]);
  return [...under.queues, ...under.exchanges];
}

/** The test bed's folder (the standby's is `reaper-test-standby-...`, checked by path). */
const foldersOf = (label: string) => readdirSync(tmpdir()).filter((entry) => entry.startsWith(`reaper-test-${label}-`));

test("a test file ended by SIGTERM takes its services with it (a frozen one too) and drops its standby's slot", async () => {
  const label = `killedterm${randomBytes(3).toString('hex')}`;
  try {
    const made = await runAndKill(label, 'SIGTERM');
    await eventually('the frozen worker to be gone', () => !alive(made.workerPid), { timeoutMs: 10_000 });
    assert.equal(await slotExists(made.slot), false, "the standby helper's exit clean-up dropped its slot");
    assert.equal(existsSync(made.standbyDir), false, "and removed the standby's folder");
  } finally {
    await sweepLeftovers({ olderThanMs: 0, scope: label }); // its database and queues: after hooks do not run on a signal
  }
});

test('after a SIGKILLed test file, the next run removes its worker, database, queues, standby slot and folders once they are old enough', async () => {
  const label = `killedkill${randomBytes(3).toString('hex')}`;
  try {
    const made = await runAndKill(label, 'SIGKILL');
    assert.equal(alive(made.pid), false);
    // What a killed file leaves: the frozen worker (adopted by init), the database, the queues
    // (the topology's and the file's own probe queue), the folder.
    assert.equal(procState(made.workerPid).state, 'T', 'the frozen worker outlived its file');
    assert.equal(await databaseExists(made.database), true);
    const names = await brokerNamesOf(made.prefix);
    assert.ok(names.includes(`${made.prefix}.settle-probe`) && names.includes(`${made.prefix}.dead-letter`), names.join(', '));
    assert.equal(foldersOf(label).length, 1);
    assert.equal(await slotExists(made.slot), true, "the standby's slot stayed");
    assert.equal(existsSync(made.standbyDir), true, "the standby's folder stayed");

    // The next run's sweep at its real threshold: all of it is younger than an hour, so it stays.
    const fresh = await sweepLeftovers({ scope: label });
    assert.deepEqual([fresh.processes, fresh.slots, fresh.databases, fresh.brokerObjects, fresh.folders], [[], [], [], [], []], 'nothing younger than an hour is touched');
    assert.equal(alive(made.workerPid), true);

    // Once old enough (threshold 0 here): everything goes.
    const swept = await sweepLeftovers({ olderThanMs: 0, scope: label });
    assert.deepEqual(swept.skipped, []);
    await eventually('the frozen worker to be gone', () => !alive(made.workerPid), { timeoutMs: 10_000 });
    assert.equal(await databaseExists(made.database), false);
    assert.deepEqual(await brokerNamesOf(made.prefix), []);
    assert.deepEqual(foldersOf(label), []);
    assert.equal(await slotExists(made.slot), false);
    assert.equal(existsSync(made.standbyDir), false);
    assert.deepEqual(swept.slots, [made.slot]);
    assert.deepEqual(swept.databases, [made.database]);
    assert.equal(swept.processes.length, 1, swept.processes.join(', '));
  } finally {
    await sweepLeftovers({ olderThanMs: 0, scope: label });
  }
});
