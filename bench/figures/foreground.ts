import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readdirSync, readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import { ADAPTIVE } from '../../shared/admission/adaptive';
import { runsInsertIfAbsent, type RunState } from '../../shared/db/queries/runs';
import { check, checkFinished, reaperEnvironment, type BenchContext } from '../lib/context';
import { cutoffAfterCandidates, withAdmin, type Seed, OBSERVER_APPLICATION, SAMPLER_APPLICATION } from '../lib/database';
import { seatHoldsPolicy, writePolicies } from '../lib/policies';
import { quantileRank } from '../lib/bootstrap';
import { CpuMeter, type CpuSplit } from '../lib/cpu';
import { onDatabaseCpu } from '../lib/pin';
import { median } from '../lib/stats';
import { startServices, stopServices, type ReaperService } from '../lib/services';
import { pollUntil, sleep } from '../lib/wait';

/**
 * Figure 7 (issue 12): what a cleanup does to the application's own queries. A fixed foreground
 * workload on seat_reservations (renewals, confirmations and point reads at a fixed rate, driven by
 * pgbench with custom scripts and -R) runs alone (baseline: the seconds just before each cleanup,
 * with everything that cleanup needs already started, so a baseline and its cleanup see the same
 * moment of a shared machine), then during each cleanup of the same rows: reaper unthrottled, reaper throttled, one `DELETE ... WHERE expires_at <= cutoff AND status =
 * 'held'` (what a pg_cron job runs; pg_cron itself is not installed: it needs
 * shared_preload_libraries and a restart of a shared server), and a plain batched-delete loop.
 *
 * The foreground never changes which rows are candidates, so every cleanup must delete exactly the
 * seed's expired held rows: renewals push a future hold further out, confirmations confirm a hold
 * only while it is unexpired (`expires_at > now()`; on a candidate they match nothing), and reads
 * read any row. So counts are checked as everywhere else, and the foreground still reaches every
 * kind of row, candidates included, through the same primary key and heap pages the cleanup writes.
 *
 * Latency is pgbench's own per-transaction log: with -R each latency is measured from the
 * transaction's scheduled start, so a stall is counted for every transaction it delayed
 * (no coordinated omission). Each script is one autocommitted statement, so a transaction is a
 * statement.
 */

export const FOREGROUND_POLICY = 'bench-foreground-holds';
export const FOREGROUND_APPLICATION = 'bench-foreground';
const APPLICATION_NAME = FOREGROUND_APPLICATION;
/** Weights of the three scripts: 40% renewals, 10% confirmations, 50% point reads. */
const SCRIPTS = { renew: 4, confirm: 1, read: 5 } as const;
/** pgbench numbers the -f scripts in the order given: renew is script 0. */
const RENEW_SCRIPT = 0;

export interface ForegroundOptions {
  /** Run the pgbench workload (quick, full); smoke runs the cleanups and checks their counts only. */
  foreground: boolean;
  ratePerSecond: number;
  /**
   * Issue 18: the foreground rate of a quiet database, where reaper unthrottled and reaper adaptive
   * (no rate set) run once more: adaptive should be nearly as fast there (fast when quiet, gentle when busy).
   */
  quietRatePerSecond: number;
  clients: number;
  baselineSeconds: number;
  /** reaper's batch size here: the product default. */
  reaperBatchSize: number;
  throttle: { rowsPerSecond: number; concurrency: number };
  loopBatchSize: number;
  /**
   * Every cleanup deletes the first this-many candidates of the seed (a cutoff at the n-th expiry):
   * the same rows for each, and a throttled run short enough for CI.
   */
  rows: number;
  /**
   * Only these phases, by label (`reaper-adaptive-300`, `no-cleanup-300`, ...; BENCH_FOREGROUND_PHASES,
   * a diagnostic): a question about one contender in a minute or two instead of the whole figure.
   */
  onlyPhases?: readonly string[];
}

export interface ForegroundLatency {
  transactions: number;
  p50Ms: number;
  p99Ms: number;
  maxMs: number;
  /** Longest renewal (an UPDATE by primary key): every row-lock wait would show here. */
  renewalMaxMs: number;
}

export interface ForegroundPhase {
  name: 'reaper unthrottled' | 'reaper throttled' | 'reaper adaptive' | 'single DELETE' | 'batched DELETE loop' | 'no cleanup';
  /** The foreground's statements/s during this phase (ForegroundOptions.ratePerSecond, or the quiet rate). */
  ratePerSecond: number;
  /**
   * reaper: `publishedAfterSeconds`, the run's claim to its last window published (run row,
   * database clock): near the run's start unpaced, near its end when the scheduler paced it by the
   * workers' adaptive rate (run-executor.ts paceWindow).
   */
  cleanup: { rows: number; seconds: number; rowsPerSecond: number; publishedAfterSeconds?: number | null };
  /** The foreground alone during the `baselineSeconds` just before this cleanup (null in smoke). */
  baseline: ForegroundLatency | null;
  /**
   * The phases with a target (and the control): the foreground alone for as long as the cleanup
   * ran, just before it (the last that-many seconds of a longer alone window; null for the others
   * and in smoke). A p99 over 60 s rests on about 180 of 18,000 transactions; one over the 4 s just
   * before on about 12, so one slow second of a shared machine in or out of the short window moved
   * every ratio (the control's ratio of two 4 s windows: 0.85-1.42 in one evening); and a longer
   * window takes in rarer stalls. Windows of one length compare like with like.
   */
  baselineMatched: (ForegroundLatency & { seconds: number; p99BySecond: number[] }) | null;
  /** The foreground while the cleanup ran. */
  foreground: ForegroundLatency | null;
  /** Longest heavyweight-lock wait of a foreground backend seen by sampling pg_locks.waitstart every 50 ms. */
  lockWaitMaxMs: number;
  /** Samples in which some foreground backend waited, by wait event (type:event, e.g. IO:WALSync, LWLock:WALWrite, Lock:transactionid). */
  waitSamples: Record<string, number>;
  samples: number;
  /** The same, alone just before (the whole alone window): which waits the cleanup added. Null in smoke. */
  aloneWaits: { waitSamples: Record<string, number>; samples: number } | null;
  wal: WalRead;
  /** The cleanup's WAL (cluster-wide without pg_walinspect) per deleted row, full-page images included. */
  walBytesPerRow: number;
  walBytesPerRowWithoutFpi: number;
  /** Reaper adaptive: its shared rate (rows/s) and the pressure it reacted to (back-off at ADAPTIVE.backOffAbove), sampled every 50 ms; null otherwise. */
  adaptive: { rateMedian: number; rateLowest: number; pressureMedian: number; pressureHighest: number; samples: number; series: Array<[number, number]> } | null;
  /** The foreground's p99 (ms) in each whole second of the cleanup's window (where a cleanup hurts: its start, or throughout). */
  foregroundP99BySecond: number[];
  /**
   * The database's CPU (backend seconds per second of the window: a share of one core) by client
   * application_name, alone just before (the whole alone window) and during the cleanup; null in
   * smoke. Pinned, the database has one core: this says how much of it reaper's own statements take
   * beside the foreground's.
   */
  databaseCpu: { alone: Record<string, number>; cleanup: Record<string, number> } | null;
}

export interface ForegroundFigure {
  ratePerSecond: number;
  /** The short alone window just before every cleanup (s). */
  baselineSeconds: number;
  quietRatePerSecond: number;
  clients: number;
  candidates: number;
  reaperBatchSize: number;
  throttle: { rowsPerSecond: number; concurrency: number };
  loopBatchSize: number;
  phases: ForegroundPhase[];
}

export function percentile(sorted: readonly number[], q: number): number {
  if (sorted.length === 0) return 0;
  return sorted[quantileRank(sorted.length, q)]!;
}

/** pgbench's connection options from the bench database's URL. */
function pgbenchConnection(url: string): { args: string[]; env: Record<string, string> } {
  const parsed = new URL(url);
  const args = ['-h', parsed.hostname, '-p', parsed.port || '5432', '-U', decodeURIComponent(parsed.username || 'postgres'), parsed.pathname.slice(1)];
  const env: Record<string, string> = { PGAPPNAME: APPLICATION_NAME };
  if (parsed.password) env.PGPASSWORD = decodeURIComponent(parsed.password);
  return { args, env };
}

/** pgbench's -f arguments for the three scripts with `weights` (figure 7's by default; a weight of 0 leaves a script out). */
export function writeScripts(directory: string, seed: Seed, weights: Readonly<Record<keyof typeof SCRIPTS, number>> = SCRIPTS): string[] {
  const total = seed.totalRows;
  // Row i of the seed: i % 4 = 2 is held until 2999 (see database.ts); ids are md5('bench-hold-' || i)::uuid.
  const files = {
    renew: `\\set i 4 * random(0, ${total / 4 - 1}) + 2
UPDATE seat_reservations SET expires_at = expires_at + interval '1 second', updated_at = now()
  WHERE reservation_id = md5('bench-hold-' || :i)::uuid AND status = 'held';
`,
    confirm: `\\set i random(1, ${total})
UPDATE seat_reservations SET status = 'confirmed', updated_at = now()
  WHERE reservation_id = md5('bench-hold-' || :i)::uuid AND status = 'held' AND expires_at > now();
`,
    read: `\\set i random(1, ${total})
SELECT status, expires_at, seat, holder FROM seat_reservations WHERE reservation_id = md5('bench-hold-' || :i)::uuid;
`,
  };
  return (Object.keys(SCRIPTS) as Array<keyof typeof SCRIPTS>)
    .filter((name) => weights[name] > 0)
    .map((name) => {
      const file = path.join(directory, `foreground-${name}.sql`);
      writeFileSync(file, files[name]);
      return `${file}@${weights[name]}`;
    });
}

/** A pgbench run at a fixed rate, logging every transaction; stopped with SIGINT once the phase is over. */
export class Pgbench {
  private readonly child: ChildProcess;
  private readonly exited: Promise<number | null>;
  private stderr = '';
  private spawnError: Error | null = null;

  constructor(
    private readonly logPrefix: string,
    url: string,
    scripts: readonly string[],
    options: Pick<ForegroundOptions, 'ratePerSecond' | 'clients'>,
    maxSeconds: number,
  ) {
    const connection = pgbenchConnection(url);
    const args = ['-n', ...scripts.flatMap((script) => ['-f', script]), '-R', String(options.ratePerSecond), '-c', String(options.clients), '-j', '1'];
    args.push('-T', String(Math.ceil(maxSeconds)), '--log', `--log-prefix=${logPrefix}`, ...connection.args);
    const [command, commandArgs] = onDatabaseCpu('pgbench', args); // --pin: beside the database, apart from reaper's Node processes
    this.child = spawn(command, commandArgs, { env: { PATH: process.env.PATH, HOME: process.env.HOME, ...connection.env }, stdio: ['ignore', 'ignore', 'pipe'] });
    this.child.stderr!.on('data', (chunk: Buffer) => {
      this.stderr = (this.stderr + chunk.toString()).slice(-2000);
    });
    this.exited = new Promise((resolve, reject) => {
      this.child.once('error', (error) => {
        this.spawnError = error; // pgbench not installed: say so instead of reporting empty percentiles
        reject(error);
      });
      this.child.once('exit', (code) => resolve(code));
    });
    this.exited.catch(() => undefined);
  }

  get running(): boolean {
    return this.spawnError === null && this.child.exitCode === null && this.child.signalCode === null;
  }

  assertRunning(): void {
    if (this.spawnError) throw new Error(`pgbench could not start (${this.spawnError.message}): the foreground figure needs PostgreSQL's pgbench on PATH`);
    if (!this.running) throw new Error(`pgbench exited early (${this.child.exitCode}):\n${this.stderr}`);
  }

  /**
   * SIGINT ends pgbench at once; its log is written through stdio buffers, so the last partial
   * line is dropped when read. The phases keep a tail after the window they measure for that.
   */
  async stop(): Promise<void> {
    if (this.running) this.child.kill('SIGINT');
    await this.exited.catch(() => undefined);
  }

  /** The whole log, parsed once (after stop: the phase reads every window from it). */
  private log: Array<{ endMs: number; ms: number; script: number }> | null = null;

  /** Transactions ending in [fromMs, toMs] (epoch ms): latency (ms) and script number. Call after stop. */
  transactions(fromMs: number, toMs: number): Array<{ ms: number; script: number }> {
    if (this.running) throw new Error('pgbench is still running: its log is read once it has stopped');
    this.log ??= this.readLog();
    return this.log.filter((t) => t.endMs >= fromMs && t.endMs <= toMs);
  }

  private readLog(): Array<{ endMs: number; ms: number; script: number }> {
    const directory = path.dirname(this.logPrefix);
    const base = path.basename(this.logPrefix);
    const out: Array<{ endMs: number; ms: number; script: number }> = [];
    for (const file of readdirSync(directory).filter((name) => name.startsWith(`${base}.`))) {
      for (const line of readFileSync(path.join(directory, file), 'utf8').split('\n')) {
        // client_id transaction_no time script_no time_epoch time_us schedule_lag (with -R)
        const fields = line.trim().split(' ');
        if (fields.length !== 7) continue; // the cut last line
        out.push({ endMs: Number(fields[4]) * 1000 + Number(fields[5]) / 1000, ms: Number(fields[2]) / 1000, script: Number(fields[3]) });
      }
    }
    return out;
  }
}

export function latencyOf(transactions: ReadonlyArray<{ ms: number; script: number }>): ForegroundLatency {
  const sorted = transactions.map((t) => t.ms).sort((a, b) => a - b);
  // A loop, not Math.max(...): pooled over rounds a busy shape has hundreds of thousands of
  // transactions, past what a spread call takes (figure 7b, reads at 2,000/s over 10 rounds:
  // "Maximum call stack size exceeded" after 11 minutes of measuring).
  const renewalMaxMs = transactions.reduce((most, t) => (t.script === RENEW_SCRIPT && t.ms > most ? t.ms : most), 0);
  return {
    transactions: sorted.length,
    p50Ms: percentile(sorted, 0.5),
    p99Ms: percentile(sorted, 0.99),
    maxMs: sorted.at(-1) ?? 0,
    renewalMaxMs,
  };
}

/** One sample of the foreground's waits: each wait event seen counts once. */
function countWaits(into: { waitSamples: Record<string, number>; samples: number }, waits: ReadonlyArray<{ wait: string | null }>): void {
  into.samples++;
  for (const type of new Set(waits.map((row) => row.wait).filter((type): type is string => type !== null))) {
    into.waitSamples[type] = (into.waitSamples[type] ?? 0) + 1;
  }
}

/** A run id no run has: what the sampler reads while no run is watched, so its statements stay the same. */
const NO_RUN = '00000000-0000-0000-0000-000000000000';

/**
 * Samples the foreground's backends every 50 ms: the longest heavyweight-lock wait (pg_locks.waitstart
 * is when the wait began, so only its end is uncertain, by one interval) and which wait events show;
 * and reads the state of the run a reaper cleanup waits for (watchRun).
 *
 * Its statements run at the same pace from the foreground's warm-up to the end of the phase, and
 * count only inside the measured window: the window before the cleanup ("alone just before") then
 * has the bench's own statements on the database as the cleanup's window has them. Before
 * 2026-12-03 they ran only in the cleanup's window (about 60 statements/s with the run-state poll,
 * on the pinned database's one core beside a foreground of 300), so every contender's ratio, the
 * control's too, carried them.
 */
export class WaitSampler {
  lockWaitMaxMs = 0;
  samples = 0;
  readonly waitSamples: Record<string, number> = {};
  /** Wait samples of the window alone just before the cleanup (measureAlone). */
  readonly aloneWaits = { waitSamples: {} as Record<string, number>, samples: 0 };
  private aloneActive = false;
  /** Adaptive admission's shared state, sampled with the waits: the rate in force and the pressure its last step reacted to. */
  readonly adaptiveRates: number[] = [];
  readonly adaptivePressures: number[] = [];
  /** [ms since the window opened, rate] of every sample: how fast the rate came down (or up). */
  readonly adaptiveSeries: Array<[number, number]> = [];
  private windowFromMs = 0;
  private stopped = false;
  private loop: Promise<void> | null = null;
  private active = false;
  /** The run a cleanup waits for: its state is read by every sample (a run id nobody has before one is watched). */
  private watched: { runId: string; state: RunState | null } = { runId: NO_RUN, state: null };

  constructor(private readonly client: pg.Client) {}

  start(): void {
    this.loop = (async () => {
      while (!this.stopped) {
        const watched = this.watched;
        const run = (await this.client.query<{ state: RunState }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [watched.runId])).rows[0];
        watched.state = run?.state ?? null;
        const waits = (
          await this.client.query<{ wait: string | null; lock_ms: number | null }>(
            `SELECT a.wait_event_type || ':' || a.wait_event AS wait, (extract(epoch FROM clock_timestamp() - l.waitstart) * 1000)::float8 AS lock_ms
             FROM pg_stat_activity a LEFT JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted
             WHERE a.application_name = $1 AND a.state = 'active'`,
            [APPLICATION_NAME],
          )
        ).rows;
        const adaptive = (
          await this.client.query<{ rate: number | null; pressure: number | null }>(
            `SELECT adaptive_rate AS rate, adaptive_pressure AS pressure FROM cleanup_admission WHERE policy = $1`,
            [FOREGROUND_POLICY],
          )
        ).rows[0];
        if (this.active) this.record(waits, adaptive);
        if (this.aloneActive) countWaits(this.aloneWaits, waits);
        await sleep(50);
      }
    })();
  }

  private record(waits: ReadonlyArray<{ wait: string | null; lock_ms: number | null }>, adaptive: { rate: number | null; pressure: number | null } | undefined): void {
    countWaits(this, waits);
    for (const row of waits) this.lockWaitMaxMs = Math.max(this.lockWaitMaxMs, row.lock_ms ?? 0);
    if (adaptive?.rate != null) {
      this.adaptiveRates.push(adaptive.rate);
      this.adaptiveSeries.push([Date.now() - this.windowFromMs, Math.round(adaptive.rate)]);
    }
    if (adaptive?.pressure != null) this.adaptivePressures.push(adaptive.pressure);
  }

  /**
   * Until the watched run is in one of `states` (undefined after `deadline`): read by the samples, so
   * waiting adds no statement of its own. A failed run throws.
   */
  async watchRun(runId: string, states: readonly RunState[], deadline: number): Promise<RunState | undefined> {
    const watched = { runId, state: null as RunState | null };
    this.watched = watched;
    try {
      return await pollUntil(
        async () => {
          if (this.stopped) throw new Error('the sampler stopped while a run was watched');
          if (watched.state === 'failed') throw new Error(`run ${runId} failed`);
          return watched.state !== null && states.includes(watched.state) ? watched.state : undefined;
        },
        { deadline, everyMs: 10 },
      );
    } finally {
      this.watched = { runId: NO_RUN, state: null };
    }
  }

  /** Wait samples count in aloneWaits while on (the window alone just before). */
  measureAlone(on: boolean): void {
    this.aloneActive = on;
  }

  /** Samples count only inside the measured window. */
  measure(on: boolean): void {
    if (on) this.windowFromMs = Date.now();
    this.active = on;
  }

  async stop(): Promise<void> {
    this.stopped = true;
    await this.loop;
  }
}

/**
 * WAL a cleanup wrote. The server is shared (other engineers' tests write WAL) and the foreground
 * writes the same table, so the cluster-wide pg_wal_lsn_diff is only reported; the figure counts,
 * with pg_walinspect (PostgreSQL 15 contrib), the records of the bench database's blocks that the
 * cleanup can have written: every record on another relation (reaper's receipts, runs, admission
 * state) and, on seat_reservations and its indexes, the heap DELETE records only (the foreground
 * only updates there). Full-page images are counted and also shown apart: a CHECKPOINT just before
 * each cleanup makes every phase start equal, but during it the foreground may be first to touch a
 * page, saving the cleanup that page's image. Commit records carry no block and are left out (a few
 * dozen bytes per transaction).
 */
export interface WalRead {
  /** The whole cluster (pg_current_wal_flush_lsn), other users of the server included. */
  clusterBytes: number;
  /** Records attributable to the cleanup (see above), full-page images included; null without pg_walinspect. */
  cleanupBytes: number | null;
  /** Of those, full-page images. */
  cleanupFpiBytes: number | null;
}

export class WalMeter {
  protected from = '';
  protected inspect = false;

  /** `slotHolder`: a connection of its own for the phase, holding a temporary slot (gone with the session). */
  constructor(
    protected readonly pool: pg.Pool,
    private readonly slotHolder: pg.Client,
  ) {}

  async start(): Promise<void> {
    this.inspect = await this.pool.query('CREATE EXTENSION IF NOT EXISTS pg_walinspect').then(
      () => true,
      () => false, // contrib not installed: the cluster-wide figure is all there is
    );
    await this.pool.query('CHECKPOINT');
    if (this.inspect) {
      // A busy shared server recycles WAL segments within seconds: a temporary physical slot keeps
      // them from here until this phase's session ends (also if the benchmark dies: no slot is left behind).
      const name = `reaper_bench_wal_${randomBytes(4).toString('hex')}`;
      await this.slotHolder.query('SELECT pg_create_physical_replication_slot($1, true, true)', [name]);
    }
    this.from = (await this.pool.query<{ lsn: string }>('SELECT pg_current_wal_flush_lsn()::text AS lsn')).rows[0]!.lsn;
  }

  async finish(): Promise<WalRead> {
    const to = (await this.pool.query<{ lsn: string }>('SELECT pg_current_wal_flush_lsn()::text AS lsn')).rows[0]!.lsn;
    const clusterBytes = Number((await this.pool.query<{ bytes: string }>('SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::bigint AS bytes', [this.from, to])).rows[0]!.bytes);
    if (!this.inspect) return { clusterBytes, cleanupBytes: null, cleanupFpiBytes: null };
    const row = (
      await this.pool.query<{ bytes: string; fpi: string }>(
        `WITH db AS (SELECT oid::text AS oid FROM pg_database WHERE datname = current_database()),
              seat AS (SELECT string_agg(pg_relation_filenode(c)::text, '|') AS nodes
                       FROM unnest(array_append((SELECT array_agg(indexrelid::regclass) FROM pg_index WHERE indrelid = 'seat_reservations'::regclass),
                                                'seat_reservations'::regclass)) AS c)
         SELECT coalesce(sum(r.record_length), 0)::bigint AS bytes, coalesce(sum(r.fpi_length), 0)::bigint AS fpi
         FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) r, db, seat
         WHERE r.block_ref ~ (' rel [0-9]+/' || db.oid || '/')
           AND (r.block_ref !~ (' rel [0-9]+/' || db.oid || '/(' || seat.nodes || ') ') OR (r.resource_manager = 'Heap' AND r.record_type = 'DELETE'))`,
        [this.from, to],
      )
    ).rows[0]!;
    return { clusterBytes, cleanupBytes: Number(row.bytes), cleanupFpiBytes: Number(row.fpi) };
  }
}

/** Deletes every candidate expiring at or before `cutoff` (ISO, microseconds). */
type Cleanup = (pool: pg.Pool, cutoff: string, sampler: WaitSampler) => Promise<{ rows: number; finished: boolean; publishedAfterSeconds?: number | null }>;

/** The first `expected` candidates gone once, nothing else: the rest of the candidates and every non-candidate kept (some confirmed by the foreground). */
export async function checkCounts(context: BenchContext, figure: string, seed: Seed, pool: pg.Pool, expected: number, deleted: number): Promise<void> {
  const row = (
    await pool.query<{ expired_held: number; others: number }>(
      `SELECT count(*) FILTER (WHERE status = 'held' AND expires_at < timestamptz '2100-01-01')::int AS expired_held,
              count(*) FILTER (WHERE NOT (status = 'held' AND expires_at < timestamptz '2100-01-01'))::int AS others
       FROM seat_reservations`,
    )
  ).rows[0]!;
  check(context, figure, 'rows the cleanup deleted', expected, deleted);
  check(context, figure, 'expired held rows left', seed.candidates - expected, row.expired_held);
  check(context, figure, 'rows that must survive (held until 2999, confirmed)', seed.futureHeld + seed.expiredConfirmed, row.others);
}

function reaperCleanup(context: BenchContext): Cleanup {
  return async (pool, cutoff, sampler) => {
    const run = (await runsInsertIfAbsent(pool, { policy: FOREGROUND_POLICY, trigger: 'manual', scheduledFor: null, cutoff }))!;
    const finished = (await sampler.watchRun(run.runId, ['completed'], Date.now() + context.boundMs)) !== undefined;
    const receipts = (
      await pool.query<{ deleted: number; noop: number }>(
        'SELECT coalesce(sum(deleted), 0)::int AS deleted, coalesce(sum(noop), 0)::int AS noop FROM cleanup_batches WHERE run_id = $1',
        [run.runId],
      )
    ).rows[0]!;
    if (finished) check(context, 'foreground: reaper', 'no-ops', 0, receipts.noop);
    const published = (
      await pool.query<{ seconds: number | null }>('SELECT extract(epoch FROM published_at - started_at)::float8 AS seconds FROM cleanup_runs WHERE run_id = $1', [run.runId])
    ).rows[0]!;
    return { rows: receipts.deleted, finished, publishedAfterSeconds: published.seconds };
  };
}

const singleDelete: Cleanup = async (pool, cutoff) => {
  const result = await pool.query(`DELETE FROM seat_reservations WHERE expires_at <= $1::timestamptz AND status = 'held'`, [cutoff]);
  return { rows: result.rowCount ?? 0, finished: true };
};

/**
 * The control: no cleanup at all, for `seconds` (as long as the adaptive contender's window at
 * most). Its "p99 / alone as long just before" is the ratio's own noise on this machine at this
 * moment (two windows of the same foreground, one after the other): a contender's ratio means
 * something only where it stands clear of this one. Its "p99 / alone just before" (the short
 * window) shows what comparing windows of different lengths reads with no cleanup at all.
 */
function noCleanup(seconds: number): Cleanup {
  return async () => {
    await sleep(seconds * 1000);
    return { rows: 0, finished: true };
  };
}

function batchedLoop(context: BenchContext, batchSize: number): Cleanup {
  return async (pool, cutoff) => {
    const deadline = Date.now() + context.boundMs;
    let rows = 0;
    for (;;) {
      if (Date.now() > deadline) return { rows, finished: false };
      const result = await pool.query(
        `DELETE FROM seat_reservations WHERE reservation_id IN (
           SELECT reservation_id FROM seat_reservations WHERE expires_at <= $1::timestamptz AND status = 'held' LIMIT $2)`,
        [cutoff, batchSize],
      );
      if (!result.rowCount) return { rows, finished: true };
      rows += result.rowCount;
    }
  };
}

/** A phase's name in file names and BENCH_FOREGROUND_PHASES, e.g. reaper-adaptive-300. */
function phaseLabel(name: ForegroundPhase['name'], ratePerSecond: number): string {
  return `${name.replace(/\W+/g, '-')}-${ratePerSecond}`;
}

/** Backend CPU seconds per second of the window, by application_name. */
function perSecond(split: CpuSplit): Record<string, number> {
  return Object.fromEntries(Object.entries(split.postgresByApplication).map(([application, seconds]) => [application, Number((seconds / split.wallSeconds).toFixed(4))]));
}

/** The foreground's p99 (ms) in each whole second from `fromMs` to `toMs`. */
function p99BySecond(pgbench: Pgbench, fromMs: number, toMs: number): number[] {
  const out: number[] = [];
  for (let from = fromMs; from + 1000 <= toMs; from += 1000) out.push(Number(latencyOf(pgbench.transactions(from, from + 1000)).p99Ms.toFixed(2)));
  return out;
}

/** Seconds pgbench may run at most in one phase (it is stopped when the phase is over). */
function pgbenchMaxSeconds(context: BenchContext, aloneSeconds: number): number {
  return aloneSeconds + context.boundMs / 1000 + 60;
}

/**
 * Before each phase: the previous phase's writes (and the database copy) flushed, by PostgreSQL
 * (CHECKPOINT) and by the kernel (sync). Without it a phase inherits the last one's write-back: the
 * control phase (no cleanup at all) once saw its p99 at 65x the window before it, from one stall of
 * about 200 ms (bench/results/2026-12-02-quick-foreground-control-pinned.md).
 */
export async function settleWrites(context: BenchContext): Promise<void> {
  await withAdmin(context.databases.adminUrl, (admin) => admin.query('CHECKPOINT'));
  execFileSync('sync');
}

/** Warm-up before a measured window, and a tail after it (longer than pgbench's unflushed log buffer). */
export const WARM_UP_MS = 1000;
export const TAIL_MS = 1500;

async function runPhase(
  context: BenchContext,
  seed: Seed,
  options: ForegroundOptions,
  scripts: readonly string[],
  name: ForegroundPhase['name'],
  cleanup: Cleanup,
  reaperPolicy: Parameters<typeof seatHoldsPolicy>[3] | null,
  ratePerSecond: number,
  matchedAloneSeconds: number | null,
): Promise<ForegroundPhase> {
  const aloneSeconds = Math.max(options.baselineSeconds, matchedAloneSeconds ?? 0);
  const label = phaseLabel(name, ratePerSecond);
  await context.databases.fresh();
  await settleWrites(context);
  if (reaperPolicy) await context.broker.preparePhase([FOREGROUND_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const samplerClient = new pg.Client({ connectionString: context.databases.url, application_name: SAMPLER_APPLICATION });
  await samplerClient.connect();
  const sampler = new WaitSampler(samplerClient);
  let services: ReaperService[] = [];
  let pgbench: Pgbench | null = null;
  try {
    if (reaperPolicy) {
      const policiesPath = writePolicies(context.workDir, `foreground-${label}`, [seatHoldsPolicy(FOREGROUND_POLICY, options.reaperBatchSize, undefined, reaperPolicy)]);
      services = await startServices(reaperEnvironment(context, policiesPath), [
        { kind: 'scheduler', id: 'bench-scheduler' },
        { kind: 'worker', id: 'bench-worker-1' },
        { kind: 'worker', id: 'bench-worker-2' },
      ]);
    }
    sampler.start();
    const logPrefix = path.join(context.workDir, `pgbench-${label}`);
    if (options.foreground) {
      pgbench = new Pgbench(logPrefix, context.databases.url, scripts, { ...options, ratePerSecond }, pgbenchMaxSeconds(context, aloneSeconds));
      await sleep(WARM_UP_MS);
      pgbench.assertRunning();
    }
    const aloneCpu = pgbench ? new CpuMeter(pool, { services: [], backends: '%' }) : null;
    await aloneCpu?.start();
    const baselineFromMs = Date.now();
    sampler.measureAlone(true);
    if (pgbench) await sleep(aloneSeconds * 1000);
    sampler.measureAlone(false);
    const baselineToMs = Date.now();
    const aloneCpuSplit = await aloneCpu?.finish();
    // Read before the window: the n-th candidate's exact expiry (the seed's expiries are unique).
    const cutoff = await cutoffAfterCandidates(pool, options.rows);
    const wal = new WalMeter(pool, samplerClient);
    await wal.start();
    // The WAL meter's CHECKPOINT makes the foreground's next write to each page carry a full-page
    // image too, which slows its own first second with no cleanup at all (the control's first
    // second: 1.5-2x its later ones, 2026-12-03). The window before it starts at least WARM_UP_MS
    // after its CHECKPOINT (settleWrites), so this one does too: the foreground's images are
    // written before the cleanup starts, the cleanup's own are still counted (its pages are not
    // the foreground's), and the two windows stand alike towards a checkpoint.
    if (pgbench) await sleep(WARM_UP_MS);
    const cleanupCpu = pgbench ? new CpuMeter(pool, { services: [], backends: '%' }) : null;
    await cleanupCpu?.start();
    sampler.measure(true);
    const startedMs = Date.now();
    const result = await cleanup(pool, cutoff, sampler);
    const endedMs = Date.now();
    sampler.measure(false);
    const cleanupCpuSplit = await cleanupCpu?.finish();
    const walRead = await wal.finish();
    const walBytes = walRead.cleanupBytes ?? walRead.clusterBytes;
    for (const service of services) service.assertRunning();
    let foreground: ForegroundLatency | null = null;
    let baseline: ForegroundLatency | null = null;
    let baselineMatched: ForegroundPhase['baselineMatched'] = null;
    const foregroundP99BySecond: number[] = [];
    if (pgbench) {
      pgbench.assertRunning();
      await sleep(TAIL_MS);
      await pgbench.stop();
      baseline = latencyOf(pgbench.transactions(baselineToMs - options.baselineSeconds * 1000, baselineToMs));
      foreground = latencyOf(pgbench.transactions(startedMs, endedMs));
      foregroundP99BySecond.push(...p99BySecond(pgbench, startedMs, endedMs));
      if (matchedAloneSeconds !== null) {
        // The cleanup's length, within the alone window (never shorter than the short one).
        const ms = Math.min(baselineToMs - baselineFromMs, Math.max(options.baselineSeconds * 1000, endedMs - startedMs));
        baselineMatched = { ...latencyOf(pgbench.transactions(baselineToMs - ms, baselineToMs)), seconds: ms / 1000, p99BySecond: p99BySecond(pgbench, baselineToMs - ms, baselineToMs) };
      }
    }
    await stopServices(services);
    const seconds = (endedMs - startedMs) / 1000;
    const figure = `foreground: ${name} (foreground ${ratePerSecond}/s), ${options.rows} of ${seed.candidates} candidates`;
    if (checkFinished(context, figure, result.finished) && name !== 'no cleanup') await checkCounts(context, figure, seed, pool, options.rows, result.rows);
    return {
      name,
      ratePerSecond,
      cleanup: { rows: result.rows, seconds, rowsPerSecond: seconds > 0 ? result.rows / seconds : 0, ...(result.publishedAfterSeconds !== undefined ? { publishedAfterSeconds: result.publishedAfterSeconds } : {}) },
      baseline,
      baselineMatched,
      foreground,
      lockWaitMaxMs: sampler.lockWaitMaxMs,
      foregroundP99BySecond,
      databaseCpu: aloneCpuSplit && cleanupCpuSplit ? { alone: perSecond(aloneCpuSplit), cleanup: perSecond(cleanupCpuSplit) } : null,
      waitSamples: sampler.waitSamples,
      samples: sampler.samples,
      aloneWaits: pgbench ? sampler.aloneWaits : null,
      wal: walRead,
      walBytesPerRow: result.rows > 0 ? walBytes / result.rows : 0,
      walBytesPerRowWithoutFpi: result.rows > 0 ? (walBytes - (walRead.cleanupFpiBytes ?? 0)) / result.rows : 0,
      adaptive:
        name === 'reaper adaptive' && sampler.adaptiveRates.length > 0
          ? {
              rateMedian: median(sampler.adaptiveRates),
              rateLowest: Math.min(...sampler.adaptiveRates),
              pressureMedian: median(sampler.adaptivePressures),
              pressureHighest: sampler.adaptivePressures.length > 0 ? Math.max(...sampler.adaptivePressures) : NaN,
              samples: sampler.adaptiveRates.length,
              series: sampler.adaptiveSeries,
            }
          : null,
    };
  } finally {
    await pgbench?.stop();
    await sampler.stop();
    await samplerClient.end();
    await stopServices(services);
    await pool.end();
  }
}

export async function runForeground(context: BenchContext, seed: Seed, options: ForegroundOptions): Promise<ForegroundFigure> {
  const scripts = writeScripts(context.workDir, seed);
  const phases: ForegroundPhase[] = [];
  const show = (phase: ForegroundPhase): void => {
    const fg =
      phase.foreground && phase.baseline
        ? `foreground p50 ${phase.foreground.p50Ms.toFixed(1)} ms, p99 ${phase.foreground.p99Ms.toFixed(1)} ms (${phase.foreground.transactions} tx; alone just before: ${phase.baseline.p50Ms.toFixed(1)} / ${phase.baseline.p99Ms.toFixed(1)} ms${phase.baselineMatched ? `, p99 ${phase.baselineMatched.p99Ms.toFixed(1)} ms over ${phase.baselineMatched.seconds.toFixed(0)} s` : ''}); `
        : '';
    const cleanup = `${Math.round(phase.cleanup.rowsPerSecond)} rows/s, ${phase.walBytesPerRow.toFixed(0)} WAL B/row; `;
    context.progress(`    ${phase.name} (foreground ${phase.ratePerSecond}/s): ${cleanup}${fg}lock wait max ${phase.lockWaitMaxMs.toFixed(0)} ms`);
  };
  // Adaptive admission is the product default (issue 18): the unthrottled and the fixed-rate
  // contenders turn it off; "reaper adaptive" is the default policy with no rate set.
  const busy = options.ratePerSecond;
  // The contenders with a target at the busy rate, and the control, are compared with the
  // foreground alone for as long as they run (ForegroundPhase.baselineMatched): the throttled one
  // for its rows at its rate (and a little), the adaptive one for as long as its rows take at the
  // floor at most, within the time bound; the control for as long as the adaptive one.
  const boundSeconds = context.boundMs / 1000;
  const throttledSeconds = Math.min(boundSeconds, Math.ceil(options.rows / options.throttle.rowsPerSecond) + 2);
  const adaptiveSeconds = Math.min(boundSeconds, Math.ceil(options.rows / ADAPTIVE.floorRowsPerSecond));
  const plans: Array<[ForegroundPhase['name'], Cleanup, Parameters<typeof seatHoldsPolicy>[3] | null, number, number | null]> = [
    ['reaper unthrottled', reaperCleanup(context), { admission: { adaptive: false } }, busy, null],
    ['reaper throttled', reaperCleanup(context), { admission: { ...options.throttle, adaptive: false } }, busy, throttledSeconds],
    ['reaper adaptive', reaperCleanup(context), {}, busy, adaptiveSeconds],
    ['single DELETE', singleDelete, null, busy, null],
    ['batched DELETE loop', batchedLoop(context, options.loopBatchSize), null, busy, null],
  ];
  if (options.foreground) plans.push(['no cleanup', noCleanup(adaptiveSeconds), null, busy, adaptiveSeconds]);
  if (options.foreground) {
    plans.push(['reaper unthrottled', reaperCleanup(context), { admission: { adaptive: false } }, options.quietRatePerSecond, null]);
    plans.push(['reaper adaptive', reaperCleanup(context), {}, options.quietRatePerSecond, null]);
  }
  const label = ([name, , , ratePerSecond]: (typeof plans)[number]): string => phaseLabel(name, ratePerSecond);
  const unknown = options.onlyPhases?.filter((wanted) => !plans.some((plan) => label(plan) === wanted)) ?? [];
  if (unknown.length > 0) throw new Error(`BENCH_FOREGROUND_PHASES: no phase ${unknown.map((name) => JSON.stringify(name)).join(', ')}; the phases are ${plans.map(label).join(', ')}`);
  for (const plan of plans) {
    if (options.onlyPhases && !options.onlyPhases.includes(label(plan))) continue;
    const [name, cleanup, policy, ratePerSecond, matchedAloneSeconds] = plan;
    const phase = await runPhase(context, seed, options, scripts, name, cleanup, policy, ratePerSecond, options.foreground ? matchedAloneSeconds : null);
    phases.push(phase);
    show(phase);
  }
  return {
    ratePerSecond: options.ratePerSecond,
    baselineSeconds: options.baselineSeconds,
    quietRatePerSecond: options.quietRatePerSecond,
    clients: options.clients,
    candidates: options.rows,
    reaperBatchSize: options.reaperBatchSize,
    throttle: options.throttle,
    loopBatchSize: options.loopBatchSize,
    phases,
  };
}
