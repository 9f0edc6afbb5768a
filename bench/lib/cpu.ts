import type pg from 'pg';
import { cpuSecondsOf, rabbitmqServerPid } from './proc';
import type { ChildService } from './services';

/**
 * Where the CPU of one measured window went: the contender's own processes (child services and,
 * for in-process contenders, this process), the PostgreSQL backends serving them, and for reaper
 * the RabbitMQ server. On two shared cores CPU seconds per row are steadier than rows per second
 * (another user's load delays a run but adds little to its CPU), and the split names the
 * bottleneck better than any one process's profile. The RabbitMQ figure is the whole server's and
 * includes other users of the broker during the window.
 */
export interface CpuSplit {
  wallSeconds: number;
  processSeconds: Record<string, number>;
  postgresBackendSeconds: number;
  /** postgresBackendSeconds by the backends' application_name (e.g. reaper-scheduler, reaper-worker). */
  postgresByApplication: Record<string, number>;
  rabbitmqSeconds: number;
  totalSeconds: number;
  /** Shares of the total: node (every Node process of the contender), postgres, rabbitmq. */
  shares: { node: number; postgres: number; rabbitmq: number };
}

export interface CpuMeterOptions {
  /** Child processes of the contender. */
  services: readonly ChildService[];
  /** application_name LIKE pattern of the contender's database connections, e.g. 'reaper-%'. */
  backends: string;
  /** The contender runs (partly) in this process: count this process's CPU too. */
  includeSelf?: boolean;
  includeRabbitmq?: boolean;
}

/** How often the meter reads its backends' CPU while it runs. */
const BACKEND_SAMPLE_MS = 250;

/**
 * The meter's own backends are listed too: the pool runs each query on whichever connection is
 * free, so leaving out "this query's backend" left out a different one each time, and a backend
 * left out at the start but listed later counted its whole life's CPU (a 7 s surplus read as 2.4
 * cores in bench figure 7b, 2026-12-07). Under a pattern matching them they count as their own
 * application_name, a few milliseconds.
 */
async function backendsOf(pool: pg.Pool, pattern: string): Promise<Array<{ pid: number; application: string }>> {
  const result = await pool.query<{ pid: number; application_name: string }>(
    `SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE $1`,
    [pattern],
  );
  return result.rows.map((row) => ({ pid: row.pid, application: row.application_name }));
}

function selfSeconds(): number {
  const usage = process.cpuUsage();
  return (usage.user + usage.system) / 1e6;
}

export class CpuMeter {
  private startedAt = 0;
  private readonly processStart = new Map<ChildService, number>();
  private readonly backendStart = new Map<number, number>();
  private selfStart = 0;
  private rabbitPid: number | null = null;
  private rabbitStart = 0;
  /** The latest CPU reading of every matching backend seen during the window (see sampleBackends). */
  private readonly backendLast = new Map<number, number>();
  private readonly backendApplication = new Map<number, string>();
  private sampler: NodeJS.Timeout | null = null;
  private sampling: Promise<void> = Promise.resolve();

  constructor(
    private readonly pool: pg.Pool,
    private readonly options: CpuMeterOptions,
  ) {}

  /** Call once the contender's connections are open: a backend born later counts from zero, which is right. */
  async start(): Promise<void> {
    for (const service of this.options.services) this.processStart.set(service, service.cpuSeconds());
    for (const { pid } of await backendsOf(this.pool, this.options.backends)) this.backendStart.set(pid, cpuSecondsOf(pid));
    this.rabbitPid = this.options.includeRabbitmq ? rabbitmqServerPid() : null;
    this.rabbitStart = this.rabbitPid === null ? 0 : cpuSecondsOf(this.rabbitPid);
    this.selfStart = selfSeconds();
    this.startedAt = Date.now();
    this.sampler = setInterval(() => {
      this.sampling = this.sampling.then(() => this.sampleBackends()).catch(() => undefined);
    }, BACKEND_SAMPLE_MS);
  }

  /**
   * A backend that disconnects during the window (a pool closing an idle connection, a client
   * replaced after an error) takes its counters with it: sampled every BACKEND_SAMPLE_MS, its CPU
   * up to the last sample still counts. What it used after that sample is lost (a small undercount).
   */
  private async sampleBackends(): Promise<void> {
    for (const { pid, application } of await backendsOf(this.pool, this.options.backends)) {
      const seconds = cpuSecondsOf(pid);
      if (seconds > 0) this.backendLast.set(pid, seconds);
      this.backendApplication.set(pid, application);
    }
  }

  /** Call before stopping anything: a process or backend that has exited has no counters left to read. */
  async finish(): Promise<CpuSplit> {
    const processSeconds: Record<string, number> = {};
    for (const [service, before] of this.processStart) processSeconds[service.label] = service.cpuSeconds() - before;
    if (this.options.includeSelf) processSeconds.bench = selfSeconds() - this.selfStart;
    if (this.sampler) clearInterval(this.sampler);
    await this.sampling;
    await this.sampleBackends();
    let postgres = 0;
    const postgresByApplication: Record<string, number> = {};
    for (const [pid, last] of this.backendLast) {
      const seconds = last - (this.backendStart.get(pid) ?? 0);
      postgres += seconds;
      const application = this.backendApplication.get(pid) ?? 'unknown';
      postgresByApplication[application] = (postgresByApplication[application] ?? 0) + seconds;
    }
    const rabbitmq = this.rabbitPid === null ? 0 : cpuSecondsOf(this.rabbitPid) - this.rabbitStart;
    const node = Object.values(processSeconds).reduce((sum, seconds) => sum + seconds, 0);
    const total = node + postgres + rabbitmq;
    const share = (part: number): number => (total > 0 ? part / total : 0);
    return {
      wallSeconds: (Date.now() - this.startedAt) / 1000,
      processSeconds,
      postgresBackendSeconds: postgres,
      postgresByApplication,
      rabbitmqSeconds: rabbitmq,
      totalSeconds: total,
      shares: { node: share(node), postgres: share(postgres), rabbitmq: share(rabbitmq) },
    };
  }
}
