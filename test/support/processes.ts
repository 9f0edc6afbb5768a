import { spawn, type ChildProcess, type SpawnOptions } from 'node:child_process';
import { createWriteStream, readFileSync } from 'node:fs';
import path from 'node:path';
import { eventually } from './eventually';
import type { DbRoleNames } from '../../shared/db/queries/roles';
import { AS_DEPLOYED_ROLES_VARIABLE, SUPERUSER_REASON_VARIABLE, type AsDeployedRoles } from './as-deployed';

/** The compiled CLI; tests run reaper exactly as an operator does. */
export const REAPER_BIN = path.resolve(__dirname, '..', '..', '..', 'bin', 'reaper');

export interface LogLine {
  msg?: string;
  [key: string]: unknown;
}

/** A reaper process started by a test, with its JSON log lines collected. */
export class ReaperProcess {
  readonly lines: LogLine[] = [];
  readonly output: string[] = [];
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  private readonly child: ChildProcess;

  constructor(
    readonly label: string,
    args: string[],
    env: NodeJS.ProcessEnv,
    /** Every line the process prints is also appended here (the chaos run keeps each service's log). */
    logFile?: string,
  ) {
    const logStream = logFile ? createWriteStream(logFile, { flags: 'a' }) : null;
    this.child = spawnOwned(process.execPath, [REAPER_BIN, ...args], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    live.add(this);
    this.exited = new Promise((resolve) =>
      this.child.once('exit', (code, signal) => {
        live.delete(this);
        resolve({ code, signal });
      }),
    );
    let buffer = '';
    const onData = (chunk: Buffer) => {
      buffer += chunk.toString('utf8');
      let newline: number;
      while ((newline = buffer.indexOf('\n')) >= 0) {
        const text = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        this.output.push(text);
        logStream?.write(`${text}\n`);
        if (process.env.TEST_ECHO) process.stderr.write(`[${label}] ${text}\n`);
        try {
          this.lines.push(JSON.parse(text) as LogLine);
        } catch {
          // Not a log line (a CLI printing text): kept in `output` only.
        }
      }
    };
    this.child.stdout!.on('data', onData);
    this.child.stderr!.on('data', onData);
    if (logStream) {
      logStream.on('error', () => undefined); // a full disk must not end the run that keeps the log
      // 'close' comes after the last output: nothing is written after end().
      this.child.once('close', (code, signal) => logStream.end(`# exit ${JSON.stringify({ code, signal })}\n`));
    }
  }

  get pid(): number {
    return this.child.pid!;
  }

  /** Waits for a log line matching `predicate` (already seen or still to come). */
  waitForLine(what: string, predicate: (line: LogLine) => boolean, timeoutMs = 20_000): Promise<LogLine> {
    return eventually(`${this.label}: ${what}`, () => this.lines.find(predicate), {
      timeoutMs,
      describe: () => this.output.slice(-8),
    });
  }

  /** To the process's own group (it leads one: see spawnOwned). */
  signal(signal: NodeJS.Signals): void {
    signalGroup(this.child, signal);
  }

  /** True until the process has exited. */
  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  /** SIGTERM, then wait; a process that does not drain in time is killed and the test fails. */
  async stop(timeoutMs = 15_000): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    if (!this.running) return this.exited;
    this.signal('SIGTERM');
    const timer = setTimeout(() => this.signal('SIGKILL'), timeoutMs);
    const result = await this.exited;
    clearTimeout(timer);
    return result;
  }

  /**
   * The exit, or a failure naming the process (which is then SIGKILLed) if it still runs after
   * `timeoutMs`: never a bare `await exited`, which hangs the file when the process does not end.
   */
  async exitWithin(timeoutMs: number, what = 'to exit'): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), timeoutMs)));
    const result = await Promise.race([this.exited, late]);
    clearTimeout(timer);
    if (result === 'late') {
      this.signal('SIGKILL');
      await this.exited;
      throw new Error(`${this.label} did not ${what.replace(/^to /, '')} within ${timeoutMs} ms (killed): ${this.output.slice(-8).join(' | ')}`);
    }
    return result;
  }
}

const live = new Set<ReaperProcess>();

export function startReaper(label: string, args: string[], env: NodeJS.ProcessEnv, logFile?: string): ReaperProcess {
  return new ReaperProcess(label, args, asDeployedEnv(args, env), logFile);
}

/** The role a reaper command logs in as when deployed (docs/deploying.md "Deploying"); null: no database role of its own. */
function deployedRoleOf(command: string | undefined): keyof DbRoleNames | null {
  switch (command) {
    case 'scheduler':
    case 'relay': // README: the relay runs with the scheduler's role
      return 'scheduler';
    case 'worker':
      return 'worker';
    case 'migrate':
      return 'migrator';
    case 'roles':
    case 'demo':
    case 'topology':
    case 'sql':
    case undefined:
      return null;
    default:
      return 'operator'; // the CLI's operator commands
  }
}

/**
 * An as-deployed test bed (testbed.ts `asDeployed`): the process logs in as its command's role
 * instead of the bed's superuser, unless its environment names why it must not
 * (REAPER_TEST_SUPERUSER_BECAUSE). A DATABASE_URL that names another user (a test that chose a
 * role itself) is left alone; only the user changes, so a proxy's host and port stay.
 */
export function asDeployedEnv(args: readonly string[], env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const carried = env[AS_DEPLOYED_ROLES_VARIABLE];
  if (carried === undefined) {
    // The suite's check: a process given a database but neither a bed's roles nor a reason would
    // run as whatever user the URL names, likely the superuser, and prove nothing as deployed.
    if (env.DATABASE_URL !== undefined && !env[SUPERUSER_REASON_VARIABLE] && deployedRoleOf(args[0]) !== null) {
      throw new Error(
        `reaper ${args[0]} started with a DATABASE_URL that is not a test bed's (no ${AS_DEPLOYED_ROLES_VARIABLE}): start it with bed.processEnv(), or set ${SUPERUSER_REASON_VARIABLE} to why it must be the superuser`,
      );
    }
    return env;
  }
  const { [AS_DEPLOYED_ROLES_VARIABLE]: _roles, ...rest } = env;
  const role = deployedRoleOf(args[0]);
  if (rest[SUPERUSER_REASON_VARIABLE] || role === null || rest.DATABASE_URL === undefined) return rest;
  const deployed = JSON.parse(carried) as AsDeployedRoles;
  const url = new URL(rest.DATABASE_URL);
  if (decodeURIComponent(url.username) !== deployed.superuser) return rest;
  url.username = deployed.roles[role];
  url.password = '';
  return { ...rest, DATABASE_URL: url.toString() };
}

/** Labels of processes found still running by a clean-up helper before it stopped them. */
const leakedBeforeCleanup: string[] = [];

/**
 * For clean-up helpers that stop what a test left behind (remote-helpers' stopStarted, a fault
 * file's killLeftovers): records every process still running as leaked BEFORE stopping it, so
 * assertNoLeakedProcesses() still fails the file. Stopping quietly would hide the leak. A frozen
 * process is continued first so it can drain; one that does not drain in `timeoutMs` is killed.
 */
export async function stopLeftovers(processes: Iterable<ReaperProcess>, timeoutMs = 5_000): Promise<void> {
  const running = [...processes].filter((process) => process.running);
  for (const process of running) {
    leakedBeforeCleanup.push(process.label);
    process.signal('SIGCONT');
  }
  await Promise.all(running.map((process) => process.stop(timeoutMs)));
}

/**
 * For `after()` hooks: kills what a test left running and fails if there was anything, including
 * processes a clean-up helper already stopped through stopLeftovers(), so a test that forgets to
 * stop its processes is caught instead of leaking them into the next file.
 */
export async function assertNoLeakedProcesses(): Promise<void> {
  const leaked = [...live];
  for (const process of leaked) process.signal('SIGKILL');
  await Promise.all(leaked.map((process) => process.exited));
  const labels = [...leakedBeforeCleanup.splice(0), ...leaked.map((p) => p.label)];
  if (labels.length > 0) throw new Error(`test left processes running: ${labels.join(', ')}`);
}

/** Runs the CLI to completion (bounded: a CLI still running after `timeoutMs` is killed and fails). */
export async function runReaperCli(args: string[], env: NodeJS.ProcessEnv, timeoutMs = 60_000): Promise<{ code: number | null; stdout: string }> {
  const cli = new ReaperProcess(`cli ${args[0]}`, args, asDeployedEnv(args, env));
  const { code } = await cli.exitWithin(timeoutMs, 'to finish');
  return { code, stdout: cli.output.join('\n') };
}

/**
 * Marks a process a test started: `<pid>/<start time>` of the test file's process. The sweeper of
 * a later run (test/support/sweeper.ts) kills a marked process whose owner is gone, i.e. one left
 * behind by a test file that was SIGKILLed and could not clean up.
 */
export const OWNER_ENV = 'REAPER_TEST_OWNER';

/** A process's start time in clock ticks since boot (/proc/<pid>/stat, field 22), or undefined once it is gone. */
export function processStartTicks(pid: number): number | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    return Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19]);
  } catch {
    return undefined; // no such process
  }
}

export const OWNER_MARK = `${process.pid}/${processStartTicks(process.pid) ?? 0}`;

/** Every process group this test process started and has not seen exit. */
const ownedGroups = new Set<ChildProcess>();
const exitActions = new Set<() => void>();

/** Sends `signal` to the child's whole process group; a group already gone is not an error. */
export function signalGroup(child: ChildProcess, signal: NodeJS.Signals): void {
  if (child.pid === undefined) return;
  try {
    process.kill(-child.pid, signal);
  } catch {
    child.kill(signal); // the group is gone (or the child never led one): the process itself, if still there
  }
}

/**
 * Spawns a service for a test in its own process group (detached), marked with its owner, and
 * kills the group (SIGCONT, then SIGKILL: a SIGSTOPped process as well) when this test process
 * exits for any reason it can see: a normal end, a `process.exit` (--test-force-exit), SIGINT,
 * SIGTERM or SIGHUP. A SIGKILL of the test process cannot be seen: the next run's sweeper finds
 * the marked orphans.
 */
export function spawnOwned(command: string, args: readonly string[], options: SpawnOptions = {}): ChildProcess {
  installExitHandlers();
  const child = spawn(command, [...args], { ...options, detached: true, env: { ...(options.env ?? process.env), [OWNER_ENV]: OWNER_MARK } });
  ownedGroups.add(child);
  child.once('exit', () => ownedGroups.delete(child));
  return child;
}

/** Runs `action` (synchronous: it may run in an 'exit' handler) when this test process exits; returns its removal. */
export function atTestProcessExit(action: () => void): () => void {
  installExitHandlers();
  exitActions.add(action);
  return () => exitActions.delete(action);
}

function killOwned(): void {
  for (const child of ownedGroups) {
    signalGroup(child, 'SIGCONT');
    signalGroup(child, 'SIGKILL');
  }
  ownedGroups.clear();
  for (const action of exitActions) {
    try {
      action();
    } catch {
      // the process is ending: one failed clean-up must not stop the others (the sweeper is the net)
    }
  }
  exitActions.clear();
}

let installed = false;
function installExitHandlers(): void {
  if (installed) return;
  installed = true;
  process.once('exit', killOwned);
  for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.once(signal, () => {
      killOwned();
      // Ends the way the signal would have ended it without this handler (once: it is gone now).
      process.kill(process.pid, signal);
    });
  }
}
