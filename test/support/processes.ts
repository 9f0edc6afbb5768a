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

  /** SIGTERM, then wait; a process that does not drain in time is killed and the test fails. */
  async stop(timeoutMs = 15_000): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return this.exited;
    this.child.kill('SIGTERM');
    const timer = setTimeout(() => this.child.kill('SIGKILL'), timeoutMs);
    const result = await this.exited;
    clearTimeout(timer);
    return result;
  }
}

const live = new Set<ReaperProcess>();

export function startReaper(label: string, args: string[], env: NodeJS.ProcessEnv): ReaperProcess {
  return new ReaperProcess(label, args, env);
}

/**
 * For `after()` hooks: kills what a test left running and fails if there was anything, so a test
 * that forgets to stop its processes is caught instead of leaking them into the next file.
 */
export async function assertNoLeakedProcesses(): Promise<void> {
  const leaked = [...live];
  for (const process of leaked) process.signal('SIGKILL');
  await Promise.all(leaked.map((process) => process.exited));
  if (leaked.length > 0) throw new Error(`test left processes running: ${leaked.map((p) => p.label).join(', ')}`);
}

/** Runs the CLI to completion and returns its exit code and output. */
export async function runReaperCli(args: string[], env: NodeJS.ProcessEnv): Promise<{ code: number | null; stdout: string }> {
  const cli = new ReaperProcess(`cli ${args[0]}`, args, env);
  const { code } = await cli.exited;
  return { code, stdout: cli.output.join('\n') };
}
