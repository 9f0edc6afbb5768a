import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import path from 'node:path';
import { cpuSecondsOf, memoryOf } from './proc';
import { sleep } from './wait';

/**
 * Real reaper processes, started the way an operator starts them (`node bin/reaper scheduler|worker`
 * with the documented environment), so the benchmark measures the shipped code paths: process
 * start-up, topology assertion, JSON logs at warn, the health server.
 */

/** BENCH_REAPER_BIN runs another build's bin/reaper (A/B a product change against this one). */
export const REAPER_BIN = process.env.BENCH_REAPER_BIN ?? path.resolve(__dirname, '..', '..', '..', 'bin', 'reaper');

export interface ReaperEnvironment {
  databaseUrl: string;
  amqpUrl: string;
  prefix: string;
  policiesPath: string;
  /** Another build's bin/reaper; default REAPER_BIN. */
  bin?: string;
  /** More environment for the services (e.g. the object store's credentials for the SDK's default chain). */
  extraEnv?: Record<string, string>;
}

export interface ServiceSpec {
  /** Each serves /livez, /readyz and /metrics on its HTTP_PORT (a relay too: startServices may wait for its /readyz). */
  kind: 'scheduler' | 'worker' | 'relay';
  id: string;
  prefetch?: number;
  poolSize?: number;
  /** Extra node flags, e.g. --cpu-prof. */
  nodeArgs?: readonly string[];
}

/** Every child still running, so an interrupted benchmark can kill what it started. */
const live = new Set<ChildProcess>();

export function killLeftoverServices(): void {
  for (const child of live) child.kill('SIGKILL');
}

/** A port nobody listens on now (the kernel picks it); the service binds it a moment later. */
async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const address = server.address();
  await new Promise<void>((resolve) => server.close(() => resolve()));
  if (address === null || typeof address === 'string') throw new Error('could not pick a free port');
  return address.port;
}

/** A child process of the benchmark, with its last output lines kept for failure messages. */
export class ChildService {
  readonly exited: Promise<number | null>;
  private readonly tail: string[] = [];
  private readonly waiters: Array<{ text: string; resolve: () => void }> = [];

  constructor(
    readonly label: string,
    protected readonly child: ChildProcess,
  ) {
    live.add(child);
    this.exited = new Promise((resolve) =>
      child.once('exit', (code) => {
        live.delete(child);
        resolve(code);
      }),
    );
    const keep = (chunk: Buffer): void => {
      for (const line of chunk.toString('utf8').split('\n')) {
        if (line.trim() === '') continue;
        this.tail.push(line);
        if (this.tail.length > 20) this.tail.shift();
        if (process.env.BENCH_ECHO) process.stderr.write(`[${label}] ${line}\n`);
        for (const waiter of this.waiters.filter((candidate) => line.includes(candidate.text))) waiter.resolve();
      }
    };
    child.stdout!.on('data', keep);
    child.stderr!.on('data', keep);
  }

  get pid(): number {
    return this.child.pid!;
  }

  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  /** Waits for a line containing `text` (among the last lines kept, or still to come); fails if the process exits first. */
  async waitForOutput(text: string, timeoutMs = 30_000): Promise<void> {
    if (this.tail.some((line) => line.includes(text))) return;
    let timer: NodeJS.Timeout | undefined;
    try {
      await Promise.race([
        new Promise<void>((resolve) => this.waiters.push({ text, resolve })),
        this.exited.then((code) => {
          throw new Error(`${this.label} exited (${code}) before printing "${text}":\n${this.lastLines().join('\n')}`);
        }),
        new Promise<void>((_, reject) => {
          timer = setTimeout(() => reject(new Error(`${this.label}: no "${text}" within ${timeoutMs} ms`)), timeoutMs);
        }),
      ]);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Peak and current RSS (MiB), read before stopping: VmHWM covers the whole life of the process. */
  memory(): { peakRssMb: number; rssMb: number } {
    return memoryOf(this.pid) ?? { peakRssMb: 0, rssMb: 0 };
  }

  cpuSeconds(): number {
    return cpuSecondsOf(this.pid);
  }

  lastLines(): string[] {
    return [...this.tail];
  }

  /** A measured service that died mid-run invalidates the figure: say so with what it printed last. */
  assertRunning(): void {
    if (!this.running) throw new Error(`${this.label} exited during the measurement (code ${this.child.exitCode}, signal ${this.child.signalCode}):\n${this.tail.join('\n')}`);
  }

  /** SIGTERM (the process drains and exits), SIGKILL after `timeoutMs`. */
  async stop(timeoutMs = 15_000): Promise<number | null> {
    if (!this.running) return this.exited;
    this.child.kill('SIGTERM');
    const timer = setTimeout(() => this.child.kill('SIGKILL'), timeoutMs);
    const code = await this.exited;
    clearTimeout(timer);
    return code;
  }
}

/** Starts a compiled Node script of the benchmark (a contender's worker) as its own process. */
export function startNodeScript(label: string, script: string, env: Record<string, string>): ChildService {
  const child = spawn(process.execPath, [script], {
    env: { PATH: process.env.PATH, HOME: process.env.HOME, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  return new ChildService(label, child);
}

/** A reaper scheduler or worker. */
export class ReaperService extends ChildService {
  private constructor(
    label: string,
    readonly httpPort: number,
    child: ChildProcess,
  ) {
    super(label, child);
  }

  static async start(environment: ReaperEnvironment, spec: ServiceSpec): Promise<ReaperService> {
    const httpPort = await freePort();
    // BENCH_SERVICE_NODE_ARGS, a diagnosis aid: e.g. '--cpu-prof --cpu-prof-dir=/tmp/prof' (a profile per
    // service, written when it stops; Node refuses --cpu-prof in NODE_OPTIONS, hence arguments).
    const diagnosis = process.env.BENCH_SERVICE_NODE_ARGS?.split(' ').filter(Boolean) ?? [];
    const child = spawn(process.execPath, [...(spec.nodeArgs ?? []), ...diagnosis, environment.bin ?? REAPER_BIN, spec.kind], {
      env: {
        PATH: process.env.PATH,
        HOME: process.env.HOME,
        DATABASE_URL: environment.databaseUrl,
        AMQP_URL: environment.amqpUrl,
        REAPER_AMQP_PREFIX: environment.prefix,
        REAPER_POLICIES: environment.policiesPath,
        REAPER_WORKER_ID: spec.id,
        // Unset: the product's defaults (shared/config/env.ts PREFETCH_DEFAULTS).
        ...(spec.prefetch === undefined ? {} : { REAPER_PREFETCH: String(spec.prefetch) }),
        REAPER_DB_POOL_SIZE: String(spec.poolSize ?? 4),
        LOG_LEVEL: process.env.BENCH_LOG_LEVEL ?? 'warn',
        HTTP_PORT: String(httpPort),
        ...environment.extraEnv,
      },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    return new ReaperService(spec.id, httpPort, child);
  }

  /** Ready = /readyz answers 200: connected to the broker (a worker: consuming), start-up finished. */
  async waitReady(timeoutMs = 30_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline) {
      if (!this.running) throw new Error(`${this.label} exited during start-up:\n${this.lastLines().join('\n')}`);
      const ready = await fetch(`http://127.0.0.1:${this.httpPort}/readyz`).then(
        (response) => response.status === 200,
        () => false, // not listening yet
      );
      if (ready) return;
      await sleep(50);
    }
    throw new Error(`${this.label} not ready after ${timeoutMs} ms:\n${this.lastLines().join('\n')}`);
  }

  /**
   * A Prometheus counter from /metrics, summed per value of `label` (e.g. result="confirmed" ->
   * { confirmed: n }); all series summed under '' when `label` is omitted. Read before stopping:
   * the counters live in the process.
   */
  async metric(name: string, label?: string): Promise<Record<string, number>> {
    const text = await fetch(`http://127.0.0.1:${this.httpPort}/metrics`).then((response) => response.text());
    const sums: Record<string, number> = {};
    for (const line of text.split('\n')) {
      if (!line.startsWith(`${name}{`) && !line.startsWith(`${name} `)) continue;
      const key = label === undefined ? '' : (new RegExp(`${label}="([^"]*)"`).exec(line)?.[1] ?? '');
      sums[key] = (sums[key] ?? 0) + Number(line.slice(line.lastIndexOf(' ') + 1));
    }
    return sums;
  }

}

/** Starts the services together (their start-ups overlap) and waits until every one is ready. */
export async function startServices(environment: ReaperEnvironment, specs: readonly ServiceSpec[]): Promise<ReaperService[]> {
  const services = await Promise.all(specs.map((spec) => ReaperService.start(environment, spec)));
  try {
    await Promise.all(services.map((service) => service.waitReady()));
  } catch (error) {
    await stopServices(services);
    throw error;
  }
  return services;
}

export async function stopServices(services: readonly ChildService[]): Promise<void> {
  await Promise.all(services.map((service) => service.stop()));
}
