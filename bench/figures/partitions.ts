import { writeFileSync } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import { runsInsertIfAbsent, type RunState } from '../../shared/db/queries/runs';
import { check, reaperEnvironment, type BenchContext } from '../lib/context';
import { OBSERVER_APPLICATION, SAMPLER_APPLICATION } from '../lib/database';
import type { Mode } from '../lib/modes';
import { writePolicies, NEVER, type RowDeletePolicyInput } from '../lib/policies';
import { startServices, stopServices, type ReaperService } from '../lib/services';
import { sleep } from '../lib/wait';
import { latencyOf, Pgbench, settleWrites, TAIL_MS, WaitSampler, WalMeter, WARM_UP_MS, type ForegroundLatency } from './foreground';

/**
 * Figure 10 (issue 44 item 6): retiring whole partitions vs deleting the same expired rows through
 * reaper's row path, on a table range-partitioned by day. Both are reaper's real scheduler and
 * workers (bin/reaper) running one triggered run of the same policy on a fresh copy of the same
 * data; the only difference is `partitions: { retire: true }`.
 *
 *  - row path: the policy without `partitions` (unthrottled, batch 500): scan, batches, DELETEs;
 *  - retirement: the same policy retiring partitions (DETACH ... CONCURRENTLY: the table has no
 *    default partition), each moved into reaper_retired with its audit row;
 *  - retirement again with figure 7's pgbench-style foreground (its Pgbench and WaitSampler) on the
 *    table's live partition and across every partition: the foreground alone just before, then
 *    during the retirement.
 * WAL per row: a CHECKPOINT, then the run; pg_current_wal_flush_lsn before and after (every commit is flushed) (the cluster: other
 * users of a shared server write WAL too) and, with pg_walinspect, the records on the bench
 * database's relations only (catalog changes included; commit records carry no block and are left out).
 */

export const PARTITION_POLICY = 'bench-partitions';
const TABLE = 'day_events';
/** The first expired partition's day; the live partition holds rows expiring in 2999. */
const FIRST_DAY = '2020-01-01';
const LIVE_FROM = '2099-01-01';
const LIVE_TO = '3000-01-01';

export interface PartitionsOptions {
  /** Expired day partitions (each retirable). */
  partitions: number;
  rowsPerPartition: number;
  /** Rows in the live partition (never expired: the foreground works on them). */
  liveRows: number;
  /** The foreground phase (quick, full); smoke runs the two cleanups and checks counts only. */
  foreground: boolean;
  ratePerSecond: number;
  clients: number;
  /** The foreground alone before the retirement (s). */
  aloneSeconds: number;
  /** The row path's batch size (the product default). */
  batchSize: number;
}

export const PARTITIONS_FIGURE: Record<Mode, PartitionsOptions> = {
  smoke: { partitions: 3, rowsPerPartition: 1_000, liveRows: 1_000, foreground: false, ratePerSecond: 300, clients: 4, aloneSeconds: 0, batchSize: 500 },
  quick: { partitions: 10, rowsPerPartition: 20_000, liveRows: 20_000, foreground: true, ratePerSecond: 300, clients: 4, aloneSeconds: 8, batchSize: 500 },
  full: { partitions: 12, rowsPerPartition: 175_000, liveRows: 100_000, foreground: true, ratePerSecond: 300, clients: 4, aloneSeconds: 10, batchSize: 500 },
};

export interface PartitionWal {
  /** pg_wal_lsn_diff over the run: the whole cluster. */
  clusterBytes: number;
  /** The bench database's records (pg_walinspect), full-page images included; null without it. */
  databaseBytes: number | null;
  databaseFpiBytes: number | null;
  /** The bench database's records by resource manager and record type, largest first (bytes, full-page images included). */
  byKind: Array<{ kind: string; records: number; bytes: number; fpiBytes: number }>;
}

export interface PartitionRun {
  name: 'row path' | 'retirement' | 'retirement, foreground on';
  /** Rows gone from the table: deleted (row path) or in retired partitions. */
  rows: number;
  partitionsRetired: number;
  /** Trigger to completed, on the database clock (run row's created_at to finished_at). */
  seconds: number;
  finished: boolean;
  /**
   * Where the run's time went (database clock): trigger to the scheduler's claim; claim to completed;
   * for a retirement, claim to the first partition's retirement begun (classification) and each
   * partition's begun to quarantined (DETACH, re-check of every row, checksum, move), median and longest.
   */
  timing: {
    claimWaitSeconds: number | null;
    claimedToCompletedSeconds: number | null;
    classifySeconds: number | null;
    perPartitionMedianSeconds: number | null;
    perPartitionMaxSeconds: number | null;
    /** Each retired partition's begun to quarantined (s), in the order retired. */
    perPartition: Array<[string, number]>;
  };
  /** reaper's backends' wait samples (50 ms) during the run, most frequent first (RunWatch). */
  reaperWaits: Array<[string, number]>;
  wal: PartitionWal | null;
}

export interface PartitionsForeground {
  ratePerSecond: number;
  clients: number;
  alone: ForegroundLatency;
  /** Transactions that ended while the retirement ran (trigger to completed). */
  during: ForegroundLatency;
  /** The same length of window as `alone`, from the trigger on (the retirement and after): a p99 over as many transactions. */
  afterTrigger: ForegroundLatency;
  /** Longest heavyweight-lock wait of a foreground backend (pg_locks.waitstart, sampled every 50 ms) during the retirement. */
  lockWaitMaxMs: number;
  /** Standbys' longest replay_lag during the retirement (pg_stat_replication, every 50 ms); null: no standby on this server. */
  replayLagMaxMs: number | null;
  standbys: number;
}

export interface PartitionsFigure extends PartitionsOptions {
  expiredRows: number;
  seedSeconds: number;
  rowPath: PartitionRun;
  retirement: PartitionRun;
  withForeground: (PartitionRun & { foreground: PartitionsForeground }) | null;
}

function policy(options: PartitionsOptions, retire: boolean): RowDeletePolicyInput {
  return {
    name: PARTITION_POLICY,
    kind: 'row-delete',
    schedule: NEVER,
    table: TABLE,
    key: 'id',
    expiresAt: 'expires_at',
    guard: { status: 'open' },
    batchSize: options.batchSize,
    admission: { adaptive: false },
    ...(retire ? { partitions: { retire: true, quarantineDays: 7 } } : {}),
  };
}

/** The run's cutoff: the end of the last expired day (every expired partition's upper bound is at or before it). */
function cutoffOf(options: PartitionsOptions): string {
  const end = new Date(`${FIRST_DAY}T00:00:00Z`);
  end.setUTCDate(end.getUTCDate() + options.partitions);
  return end.toISOString().replace(/\.(\d{3})Z$/, '.$1000Z');
}

/** The table, its day partitions and the live one, in the seed database (the bench's copies get it from there). */
async function seedTable(seedUrl: string, options: PartitionsOptions): Promise<void> {
  const client = new pg.Client({ connectionString: seedUrl, application_name: 'reaper-bench-seed' });
  await client.connect();
  try {
    await client.query(`CREATE TABLE ${TABLE} (id bigint NOT NULL, status text NOT NULL, expires_at timestamptz NOT NULL, payload text,
                        PRIMARY KEY (id, expires_at)) PARTITION BY RANGE (expires_at)`);
    for (let day = 0; day < options.partitions; day++) {
      await client.query(
        `CREATE TABLE ${TABLE}_d${day} PARTITION OF ${TABLE} FOR VALUES FROM ('${FIRST_DAY}'::timestamptz + interval '${day} days') TO ('${FIRST_DAY}'::timestamptz + interval '${day + 1} days')`,
      );
    }
    // The (expiresAt, key) index every policy's table needs (docs/configuration.md): the row path's
    // keyset scan and the scheduler's backlog gauge walk it (without it each read every partition).
    await client.query(`CREATE INDEX ${TABLE}_by_expiry ON ${TABLE} (expires_at, id)`);
    await client.query(`CREATE TABLE ${TABLE}_live PARTITION OF ${TABLE} FOR VALUES FROM ('${LIVE_FROM}') TO ('${LIVE_TO}')`);
    const expired = options.partitions * options.rowsPerPartition;
    // Row i (from 0): day i / R, spread over the day; payloads of about 60 bytes.
    await client.query(
      `INSERT INTO ${TABLE} (id, status, expires_at, payload)
       SELECT i + 1, 'open', timestamptz '${FIRST_DAY} 00:00:00+00' + (i / $2) * interval '1 day' + (i % $2) * (interval '1 day' / $2),
              'event ' || i || ' ' || md5(i::text)
       FROM generate_series(0::bigint, $1::bigint - 1) i`,
      [expired, options.rowsPerPartition],
    );
    await client.query(
      `INSERT INTO ${TABLE} (id, status, expires_at, payload)
       SELECT $1::bigint + i, 'open', timestamptz '2999-01-01 00:00:00+00' + i * interval '1 second', 'live ' || i || ' ' || md5(i::text)
       FROM generate_series(1::bigint, $2::bigint) i`,
      [expired, options.liveRows],
    );
    await client.query(`VACUUM (ANALYZE) ${TABLE}`);
  } finally {
    await client.end();
  }
}

/**
 * The foreground's scripts: 40% updates and 50% point reads of live rows through the parent
 * (pruned to the live partition), 10% reads by id alone, which probe every partition's index (the
 * statements a detach's locks would hold up).
 */
function writeScripts(directory: string, options: PartitionsOptions): string[] {
  const expired = options.partitions * options.rowsPerPartition;
  const live = `\\set i random(${expired + 1}, ${expired + options.liveRows})\n`;
  const files: Array<[string, string, number]> = [
    ['update', `${live}UPDATE ${TABLE} SET payload = 'renewed ' || :i WHERE id = :i AND expires_at >= timestamptz '${LIVE_FROM}';\n`, 4],
    ['read', `${live}SELECT status, payload FROM ${TABLE} WHERE id = :i AND expires_at >= timestamptz '${LIVE_FROM}';\n`, 5],
    ['read-any', `\\set j random(1, ${expired + options.liveRows})\nSELECT status, payload FROM ${TABLE} WHERE id = :j;\n`, 1],
  ];
  return files.map(([name, text, weight]) => {
    const file = path.join(directory, `partitions-${name}.sql`);
    writeFileSync(file, text);
    return `${file}@${weight}`;
  });
}

/** WAL over a run: figure 7's meter (a CHECKPOINT, a temporary slot for pg_walinspect), counting the bench database's every record. */
class RunWal extends WalMeter {
  async finishDatabase(): Promise<PartitionWal> {
    const to = (await this.pool.query<{ lsn: string }>('SELECT pg_current_wal_flush_lsn()::text AS lsn')).rows[0]!.lsn;
    const clusterBytes = Number((await this.pool.query<{ bytes: string }>('SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::bigint AS bytes', [this.from, to])).rows[0]!.bytes);
    if (!this.inspect) return { clusterBytes, databaseBytes: null, databaseFpiBytes: null, byKind: [] };
    const kinds = (
      await this.pool.query<{ kind: string; records: number; bytes: string; fpi: string }>(
        `SELECT r.resource_manager || ':' || r.record_type AS kind, count(*)::int AS records, sum(r.record_length)::bigint AS bytes, sum(r.fpi_length)::bigint AS fpi
         FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) r, (SELECT oid::text AS oid FROM pg_database WHERE datname = current_database()) db
         WHERE r.block_ref ~ (' rel [0-9]+/' || db.oid || '/')
         GROUP BY 1 ORDER BY 3 DESC LIMIT 12`,
        [this.from, to],
      )
    ).rows;
    const byKind = kinds.map((k) => ({ kind: k.kind, records: k.records, bytes: Number(k.bytes), fpiBytes: Number(k.fpi) }));
    const row = (
      await this.pool.query<{ bytes: string; fpi: string }>(
        `SELECT coalesce(sum(r.record_length), 0)::bigint AS bytes, coalesce(sum(r.fpi_length), 0)::bigint AS fpi
         FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) r, (SELECT oid::text AS oid FROM pg_database WHERE datname = current_database()) db
         WHERE r.block_ref ~ (' rel [0-9]+/' || db.oid || '/')`,
        [this.from, to],
      )
    ).rows[0]!;
    return { clusterBytes, databaseBytes: Number(row.bytes), databaseFpiBytes: Number(row.fpi), byKind };
  }
}

/**
 * Read every 50 ms while the run runs: what reaper's own backends (application_name reaper-...)
 * wait on, by wait event and the statement's first words (where a retirement's time goes: a
 * DETACH ... CONCURRENTLY waiting for another transaction shows as Lock:virtualxid on ALTER TABLE),
 * and the standbys' longest replay_lag (pg_stat_replication; null when the server has no standby).
 */
class RunWatch {
  readonly samples: Record<string, number> = {};
  replayLagMaxMs: number | null = null;
  standbys = 0;
  private stopped = false;
  private loop: Promise<void> | null = null;

  constructor(private readonly pool: pg.Pool) {}

  start(): void {
    this.loop = (async () => {
      while (!this.stopped) {
        const rows = (
          await this.pool.query<{ what: string }>(
            `SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') || ' ' || left(regexp_replace(query, '\\s+', ' ', 'g'), 48) AS what
             FROM pg_stat_activity WHERE application_name LIKE 'reaper-%' AND state = 'active' AND datname = current_database()`,
          )
        ).rows;
        for (const row of rows) this.samples[row.what] = (this.samples[row.what] ?? 0) + 1;
        const replay = (await this.pool.query<{ n: number; lag_ms: number | null }>('SELECT count(*)::int AS n, max(extract(epoch FROM replay_lag) * 1000)::float8 AS lag_ms FROM pg_stat_replication')).rows[0]!;
        this.standbys = Math.max(this.standbys, replay.n);
        if (replay.n > 0) this.replayLagMaxMs = Math.max(this.replayLagMaxMs ?? 0, replay.lag_ms ?? 0);
        await sleep(50);
      }
    })();
  }

  async stop(): Promise<void> {
    this.stopped = true;
    await this.loop;
  }

  /** The most frequent waits, largest first. */
  top(n: number): Array<[string, number]> {
    return Object.entries(this.samples).sort((a, b) => b[1] - a[1]).slice(0, n);
  }
}

/** After a run: what it removed, checked against the seed (every expired row gone, every live row kept). */
async function checkRun(context: BenchContext, options: PartitionsOptions, pool: pg.Pool, name: PartitionRun['name'], runId: string, finished: boolean): Promise<{ rows: number; partitionsRetired: number }> {
  const figure = `partitions: ${name}`;
  const expired = options.partitions * options.rowsPerPartition;
  const deleted = Number((await pool.query<{ n: string }>('SELECT coalesce(sum(deleted), 0)::bigint AS n FROM cleanup_batches WHERE run_id = $1', [runId])).rows[0]!.n);
  const retired = (
    await pool.query<{ retired_name: string; row_count: string }>(`SELECT retired_name, row_count::text FROM cleanup_partitions WHERE run_id = $1 AND state = 'quarantined' ORDER BY retired_name`, [runId])
  ).rows;
  const retiredRows = retired.reduce((sum, row) => sum + Number(row.row_count), 0);
  if (!finished) {
    if (context.requireFinished) check(context, figure, 'finished within the time bound', 1, 0);
    else context.progress(`${figure}: stopped at the time bound; its counts were not checked`);
    return { rows: deleted + retiredRows, partitionsRetired: retired.length };
  }
  const left = (await pool.query<{ expired: number; live: number }>(
    `SELECT count(*) FILTER (WHERE expires_at < $1::timestamptz)::int AS expired, count(*) FILTER (WHERE expires_at >= $1::timestamptz)::int AS live FROM ${TABLE}`,
    [LIVE_FROM],
  )).rows[0]!;
  check(context, figure, 'expired rows left in the table', 0, left.expired);
  check(context, figure, 'live rows kept', options.liveRows, left.live);
  if (name === 'row path') {
    check(context, figure, 'rows deleted (receipts)', expired, deleted);
    check(context, figure, 'partitions retired', 0, retired.length);
  } else {
    check(context, figure, 'partitions retired (quarantined)', options.partitions, retired.length);
    check(context, figure, 'rows in retired partitions (audit count)', expired, retiredRows);
    check(context, figure, 'rows deleted by the row path', 0, deleted);
    let counted = 0;
    for (const row of retired) counted += (await pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM reaper_retired.${pg.escapeIdentifier(row.retired_name)}`)).rows[0]!.n;
    check(context, figure, 'rows in the tables in reaper_retired', expired, counted);
  }
  return { rows: name === 'row path' ? deleted : retiredRows, partitionsRetired: retired.length };
}

/** One run of the policy on a fresh copy of the seed, with or without the foreground beside it. */
async function runOne(context: BenchContext, options: PartitionsOptions, name: PartitionRun['name'], scripts: readonly string[]): Promise<PartitionRun & { foreground?: PartitionsForeground }> {
  const retire = name !== 'row path';
  const withForeground = name === 'retirement, foreground on';
  await context.databases.fresh();
  await settleWrites(context);
  await context.broker.preparePhase([PARTITION_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const samplerClient = new pg.Client({ connectionString: context.databases.url, application_name: SAMPLER_APPLICATION });
  await samplerClient.connect();
  const sampler = new WaitSampler(samplerClient);
  const watch = new RunWatch(pool);
  let services: ReaperService[] = [];
  let pgbench: Pgbench | null = null;
  try {
    const label = name.replace(/\W+/g, '-');
    const policiesPath = writePolicies(context.workDir, `partitions-${label}`, [policy(options, retire)]);
    services = await startServices(reaperEnvironment(context, policiesPath), [
      { kind: 'scheduler', id: 'bench-scheduler' },
      { kind: 'worker', id: 'bench-worker-1' },
      { kind: 'worker', id: 'bench-worker-2' },
    ]);
    sampler.start();
    const wal = withForeground ? null : new RunWal(pool, samplerClient);
    await wal?.start();
    let aloneFromMs = 0;
    let aloneToMs = 0;
    if (withForeground) {
      pgbench = new Pgbench(path.join(context.workDir, `pgbench-${label}`), context.databases.url, scripts, options, options.aloneSeconds * 2 + context.boundMs / 1000 + 60);
      await sleep(WARM_UP_MS);
      pgbench.assertRunning();
      aloneFromMs = Date.now();
      await sleep(options.aloneSeconds * 1000);
      aloneToMs = Date.now();
    }
    sampler.measure(true);
    watch.start();
    const startedMs = Date.now();
    const run = (await runsInsertIfAbsent(pool, { policy: PARTITION_POLICY, trigger: 'manual', scheduledFor: null, cutoff: cutoffOf(options) }))!;
    const done: RunState[] = ['completed', 'failed', 'incomplete', 'rejected', 'awaiting-approval'];
    const state = await sampler.watchRun(run.runId, done, Date.now() + context.boundMs);
    const endedMs = Date.now();
    sampler.measure(false);
    await watch.stop();
    if (state !== undefined && state !== 'completed') throw new Error(`partitions figure: the ${name} run ended ${state}`);
    const finished = state === 'completed';
    const walRead = (await wal?.finishDatabase()) ?? null;
    for (const service of services) service.assertRunning();
    const timing = (await pool.query<{ seconds: number | null }>('SELECT extract(epoch FROM finished_at - created_at)::float8 AS seconds FROM cleanup_runs WHERE run_id = $1', [run.runId])).rows[0]!;
    const split = (
      await pool.query<{ claim_wait: number | null; claimed: number | null; classify: number | null; median: number | null; longest: number | null }>(
        `SELECT extract(epoch FROM r.started_at - r.created_at)::float8 AS claim_wait, extract(epoch FROM r.finished_at - r.started_at)::float8 AS claimed,
                extract(epoch FROM min(p.created_at) - r.started_at)::float8 AS classify,
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM p.updated_at - p.created_at))::float8 AS median,
                max(extract(epoch FROM p.updated_at - p.created_at))::float8 AS longest
         FROM cleanup_runs r LEFT JOIN cleanup_partitions p ON p.run_id = r.run_id AND p.state = 'quarantined'
         WHERE r.run_id = $1 GROUP BY r.run_id, r.started_at, r.created_at, r.finished_at`,
        [run.runId],
      )
    ).rows[0]!;
    const perPartition = (
      await pool.query<{ name: string; seconds: number }>(
        `SELECT source_name AS name, extract(epoch FROM updated_at - created_at)::float8 AS seconds FROM cleanup_partitions WHERE run_id = $1 AND state = 'quarantined' ORDER BY created_at`,
        [run.runId],
      )
    ).rows.map((row): [string, number] => [row.name, Number(row.seconds.toFixed(3))]);
    let foreground: PartitionsForeground | undefined;
    if (pgbench) {
      pgbench.assertRunning();
      // The window of as many seconds as the alone one, from the trigger on, must have ended.
      await sleep(Math.max(TAIL_MS, startedMs + options.aloneSeconds * 1000 + TAIL_MS - Date.now()));
      await pgbench.stop();
      foreground = {
        ratePerSecond: options.ratePerSecond,
        clients: options.clients,
        alone: latencyOf(pgbench.transactions(aloneFromMs, aloneToMs)),
        during: latencyOf(pgbench.transactions(startedMs, endedMs)),
        afterTrigger: latencyOf(pgbench.transactions(startedMs, startedMs + (aloneToMs - aloneFromMs))),
        lockWaitMaxMs: sampler.lockWaitMaxMs,
        replayLagMaxMs: watch.replayLagMaxMs,
        standbys: watch.standbys,
      };
    }
    const counted = await checkRun(context, options, pool, name, run.runId, finished);
    return {
      name,
      rows: counted.rows,
      partitionsRetired: counted.partitionsRetired,
      seconds: finished && timing.seconds !== null ? timing.seconds : (endedMs - startedMs) / 1000,
      finished,
      timing: { claimWaitSeconds: split.claim_wait, claimedToCompletedSeconds: split.claimed, classifySeconds: split.classify, perPartitionMedianSeconds: split.median, perPartitionMaxSeconds: split.longest, perPartition },
      reaperWaits: watch.top(8),
      wal: walRead,
      ...(foreground ? { foreground } : {}),
    };
  } finally {
    await pgbench?.stop();
    await watch.stop();
    await sampler.stop();
    await samplerClient.end();
    await stopServices(services);
    await pool.end();
  }
}

export async function runPartitions(context: BenchContext, options: PartitionsOptions): Promise<PartitionsFigure> {
  const started = Date.now();
  await context.databases.seed(2); // the seed database, migrated (its two seat rows are not used here)
  await seedTable(context.databases.seedUrl, options);
  const seedSeconds = (Date.now() - started) / 1000;
  const expiredRows = options.partitions * options.rowsPerPartition;
  context.progress(`  seeded ${options.partitions} day partitions x ${options.rowsPerPartition.toLocaleString('en-US')} expired rows + ${options.liveRows.toLocaleString('en-US')} live in ${seedSeconds.toFixed(1)} s`);
  const scripts = writeScripts(context.workDir, options);
  const show = (run: PartitionRun): void => {
    const wal = run.wal ? `, WAL ${(run.wal.clusterBytes / Math.max(1, run.rows)).toFixed(1)} B/row (cluster)${run.wal.databaseBytes !== null ? ` ${(run.wal.databaseBytes / Math.max(1, run.rows)).toFixed(1)} B/row (bench database)` : ''}` : '';
    context.progress(`    ${run.name}: ${run.rows} rows in ${run.seconds.toFixed(2)} s${run.finished ? '' : ' (bounded)'}${wal}`);
  };
  const rowPath = await runOne(context, options, 'row path', scripts);
  show(rowPath);
  const retirement = await runOne(context, options, 'retirement', scripts);
  show(retirement);
  let withForeground: PartitionsFigure['withForeground'] = null;
  if (options.foreground) {
    const run = await runOne(context, options, 'retirement, foreground on', scripts);
    show(run);
    const f = run.foreground!;
    context.progress(`      foreground p99 alone ${f.alone.p99Ms.toFixed(1)} ms, during ${f.during.p99Ms.toFixed(1)} ms (${f.during.transactions} tx), max during ${f.during.maxMs.toFixed(1)} ms, lock wait max ${f.lockWaitMaxMs.toFixed(0)} ms`);
    withForeground = { ...run, foreground: f };
  }
  return { ...options, expiredRows, seedSeconds, rowPath, retirement, withForeground };
}

type AddRow = [figure: string, measure: string, value: string, ratio?: string, target?: string, met?: string];

/** The report's rows (bench/lib/report.ts): per-row WAL and time ratios, the foreground during the retirement. */
export function partitionsRows(f: PartitionsFigure): AddRow[] {
  const out: AddRow[] = [];
  const head = `${f.partitions} day partitions, ${f.expiredRows.toLocaleString('en-US')} expired rows`;
  const perRow = (bytes: number, rows: number): number => bytes / Math.max(1, rows);
  const fixed = (n: number, digits: number): string => (Number.isFinite(n) ? n.toFixed(digits) : '-');
  const yes = (ok: boolean): string => (ok ? 'yes' : 'NO');
  const { rowPath, retirement } = f;
  const secondsPerRow = (run: PartitionRun): number => run.seconds / Math.max(1, run.rows);
  out.push(['10', `retirement: trigger to completed (${head}; ${retirement.partitionsRetired} retired)`, `${fixed(retirement.seconds, 2)} s`]);
  out.push(['10', `row path: trigger to completed (batch ${f.batchSize}, unthrottled, 2 workers)`, `${fixed(rowPath.seconds, 2)} s${rowPath.finished ? '' : ' (bounded)'}`]);
  const timeRatio = secondsPerRow(retirement) / secondsPerRow(rowPath);
  // A retirement's cost is per partition, not per row: what it would be per row at other sizes.
  const perPartition = retirement.partitionsRetired > 0 ? retirement.wal?.databaseBytes ?? retirement.wal?.clusterBytes ?? null : null;
  out.push([
    '10',
    '  retirement per partition: seconds; WAL (bench database)',
    `${fixed(retirement.seconds / Math.max(1, retirement.partitionsRetired), 3)} s; ${perPartition === null ? '-' : `${fixed(perPartition / 1024 / retirement.partitionsRetired, 1)} KiB`}`,
    '',
    '(independent of rows)',
  ]);
  out.push(['10', '  wall time per row: retirement / row path', '', fixed(timeRatio, 4), '<= 0.02', yes(timeRatio <= 0.02)]);
  const t = retirement.timing;
  const claimed = (run: PartitionRun): number => (run.timing.claimedToCompletedSeconds ?? run.seconds) / Math.max(1, run.rows);
  out.push([
    '10',
    `  retirement's time: claim wait ${fixed(t.claimWaitSeconds ?? NaN, 2)} s, classification ${fixed(t.classifySeconds ?? NaN, 2)} s, per partition median ${fixed(t.perPartitionMedianSeconds ?? NaN, 3)} s (longest ${fixed(t.perPartitionMaxSeconds ?? NaN, 3)} s); claimed to completed, per row, retirement / row path`,
    '',
    fixed(claimed(retirement) / claimed(rowPath), 4),
    '(diagnostic)',
  ]);
  if (rowPath.wal && retirement.wal) {
    const db = rowPath.wal.databaseBytes !== null && retirement.wal.databaseBytes !== null;
    if (db) {
      const r = perRow(retirement.wal.databaseBytes!, retirement.rows) / perRow(rowPath.wal.databaseBytes!, rowPath.rows);
      out.push([
        '10',
        'WAL per row, bench database (pg_walinspect): retirement / row path',
        `${fixed(perRow(retirement.wal.databaseBytes!, retirement.rows), 2)} / ${fixed(perRow(rowPath.wal.databaseBytes!, rowPath.rows), 1)} B`,
        fixed(r, 4),
        '<= 0.01',
        yes(r <= 0.01),
      ]);
    }
    if (db) {
      const noFpi = (wal: PartitionWal, rows: number): number => perRow(wal.databaseBytes! - wal.databaseFpiBytes!, rows);
      const r = noFpi(retirement.wal, retirement.rows) / noFpi(rowPath.wal, rowPath.rows);
      out.push(['10', '  the same without full-page images (a CHECKPOINT just before each run)', `${fixed(noFpi(retirement.wal, retirement.rows), 2)} / ${fixed(noFpi(rowPath.wal, rowPath.rows), 1)} B`, fixed(r, 4), '(diagnostic)']);
    }
    const c = perRow(retirement.wal.clusterBytes, retirement.rows) / perRow(rowPath.wal.clusterBytes, rowPath.rows);
    out.push([
      '10',
      `WAL per row, LSN diff (whole shared cluster): retirement / row path`,
      `${fixed(perRow(retirement.wal.clusterBytes, retirement.rows), 2)} / ${fixed(perRow(rowPath.wal.clusterBytes, rowPath.rows), 1)} B`,
      fixed(c, 4),
      db ? '(others write WAL too)' : '<= 0.01',
      db ? '' : yes(c <= 0.01),
    ]);
  }
  const w = f.withForeground;
  if (w) {
    const fg = w.foreground;
    const ratio = fg.during.p99Ms / fg.alone.p99Ms;
    out.push(['10', `foreground (${fg.ratePerSecond}/s, ${fg.clients} connections) longest lock wait during the retirement (pg_locks)`, `${fixed(fg.lockWaitMaxMs, 0)} ms`, '', '<= 200 ms', yes(fg.lockWaitMaxMs <= 200)]);
    out.push(['10', '  longest foreground transaction during it / alone just before', `${fixed(fg.during.maxMs, 1)} / ${fixed(fg.alone.maxMs, 1)} ms`, '', '<= 200 ms', yes(fg.during.maxMs <= 200)]);
    out.push([
      '10',
      `  foreground p99 during the retirement (${fixed(w.seconds, 2)} s, ${fg.during.transactions} tx) / alone (${f.aloneSeconds} s before, ${fg.alone.transactions} tx)`,
      `${fixed(fg.during.p99Ms, 1)} / ${fixed(fg.alone.p99Ms, 1)} ms`,
      fixed(ratio, 2),
      '<= 1.25',
      yes(ratio <= 1.25),
    ]);
    out.push(['10', `  foreground p99 in the ${f.aloneSeconds} s from the trigger / alone`, `${fixed(fg.afterTrigger.p99Ms, 1)} ms`, fixed(fg.afterTrigger.p99Ms / fg.alone.p99Ms, 2), '(diagnostic)']);
    out.push(['10', '  standby replay lag during the retirement', fg.replayLagMaxMs === null ? 'not measured: no standby on this server' : `${fixed(fg.replayLagMaxMs, 0)} ms (${fg.standbys} standbys)`]);
  }
  return out;
}
