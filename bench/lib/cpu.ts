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

async function backendPids(pool: pg.Pool, pattern: string): Promise<number[]> {
  const result = await pool.query<{ pid: number }>(
    `SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE $1 AND pid <> pg_backend_pid()`,
    [pattern],
  );
  return result.rows.map((row) => row.pid);
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

  constructor(
    private readonly pool: pg.Pool,
    private readonly options: CpuMeterOptions,
  ) {}

  /** Call once the contender's connections are open: a backend born later counts from zero, which is right. */
  async start(): Promise<void> {
    for (const service of this.options.services) this.processStart.set(service, service.cpuSeconds());
    for (const pid of await backendPids(this.pool, this.options.backends)) this.backendStart.set(pid, cpuSecondsOf(pid));
    this.rabbitPid = this.options.includeRabbitmq ? rabbitmqServerPid() : null;
    this.rabbitStart = this.rabbitPid === null ? 0 : cpuSecondsOf(this.rabbitPid);
    this.selfStart = selfSeconds();
    this.startedAt = Date.now();
  }

  /** Call before stopping anything: a process or backend that has exited has no counters left to read. */
  async finish(): Promise<CpuSplit> {
    const processSeconds: Record<string, number> = {};
    for (const [service, before] of this.processStart) processSeconds[service.label] = service.cpuSeconds() - before;
    if (this.options.includeSelf) processSeconds.bench = selfSeconds() - this.selfStart;
    let postgres = 0;
    for (const pid of await backendPids(this.pool, this.options.backends)) postgres += cpuSecondsOf(pid) - (this.backendStart.get(pid) ?? 0);
    const rabbitmq = this.rabbitPid === null ? 0 : cpuSecondsOf(this.rabbitPid) - this.rabbitStart;
    const node = Object.values(processSeconds).reduce((sum, seconds) => sum + seconds, 0);
    const total = node + postgres + rabbitmq;
    const share = (part: number): number => (total > 0 ? part / total : 0);
    return {
      wallSeconds: (Date.now() - this.startedAt) / 1000,
      processSeconds,
      postgresBackendSeconds: postgres,
      rabbitmqSeconds: rabbitmq,
      totalSeconds: total,
      shares: { node: share(node), postgres: share(postgres), rabbitmq: share(rabbitmq) },
    };
  }
}
