import { spawn, type ChildProcess } from 'node:child_process';
import path from 'node:path';
import { eventually } from './eventually';

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
  ) {
    this.child = spawn(process.execPath, [REAPER_BIN, ...args], { env, stdio: ['ignore', 'pipe', 'pipe'] });
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

  signal(signal: NodeJS.Signals): void {
    this.child.kill(signal);
  }

  /** True until the process has exited. */
  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  /** SIGTERM, then wait; a process that does not drain in time is killed and the test fails. */
  async stop(timeoutMs = 15_000): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    if (!this.running) return this.exited;
    this.child.kill('SIGTERM');
    const timer = setTimeout(() => this.child.kill('SIGKILL'), timeoutMs);
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
      this.child.kill('SIGKILL');
      await this.exited;
      throw new Error(`${this.label} did not ${what.replace(/^to /, '')} within ${timeoutMs} ms (killed): ${this.output.slice(-8).join(' | ')}`);
    }
    return result;
  }
}

const live = new Set<ReaperProcess>();

export function startReaper(label: string, args: string[], env: NodeJS.ProcessEnv): ReaperProcess {
  return new ReaperProcess(label, args, env);
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
  const cli = new ReaperProcess(`cli ${args[0]}`, args, env);
  const { code } = await cli.exitWithin(timeoutMs, 'to finish');
  return { code, stdout: cli.output.join('\n') };
}
