/**
 * reaper's benchmark (issue 4): throughput, memory, latency and rate-limit accuracy, each as a
 * ratio to a contender measured in the same run.
 *
 *   npm run bench -- --quick      the whole picture: under three minutes, plus about ten for figure 7b (--only shapes)
 *   npm run bench -- --full       the sizes the README reports (500k and 2M candidates)
 *   npm run bench -- --smoke      CI: small sizes; exits 1 if any count is wrong (never on speed)
 *   add --profile                 one extra end-to-end run under --cpu-prof (scheduler, worker 1), summarised
 *   add --only remote             figure 5 alone, BENCH_REMOTE_ROUNDS times (default 5): achieved ÷ R and the 429s of each round
 *   add --only remote-backlog     figure 5b alone (with --full: its sizes), e.g. while tuning the ledger
 *   add --only events-archive     figure 8 alone: expiry events and archive on ÷ off, relay throughput
 *   add --only foreground         figure 7 alone (on the mode's first seed size)
 *   add --pin                     root only: PostgreSQL on CPU 0, everything else on CPU 1 (taskset; restored afterwards)
 *                                 (BENCH_FOREGROUND_BATCH_SIZE=<n> runs figure 7's reaper contenders at batch n,
 *                                 BENCH_FOREGROUND_THROTTLE=<rows/s> its fixed-rate contender at that rate,
 *                                 BENCH_FOREGROUND_ROWS=<n> every cleanup on n rows instead of the mode's)
 *   add --only shapes             figure 7b alone (issue 41): four foreground shapes, each with a sweep of fixed rates,
 *                                 unthrottled and adaptive reaper; written as <date>-shapes-<mode>.json and .md
 *                                 (BENCH_SHAPES_ROUNDS=n repeats the sweep n times with short cleanups only, pooling each
 *                                 contender's windows; with BENCH_SHAPES_LONG=<s> long cleanups instead, the long
 *                                 window <s> seconds, both windows reported; BENCH_SHAPES_RATES=500,16000 replaces the fixed rates;
 *                                 BENCH_SHAPES=mixed-300,quiet-30 measures only those shapes;
 *                                 BENCH_ADAPTIVE_LAW=harm|load the adaptive contender's law, issue 41)
 *   add --only s3                 figure 9 alone (object storage), written as <date>-s3-<mode>.json and .md
 *   add --only partitions         figure 10 alone (retiring day partitions vs the row path), written as <date>-partitions-<mode>.json and .md
 *   add --only cost               PostgreSQL CPU per deleted row and scheduler memory alone (bench/figures/cost.ts;
 *                                 BENCH_COST_BEFORE_BIN=<other build>/bin/reaper measures it A/B in the same rounds,
 *                                 BENCH_COST_MEMORY_AT=200000,2000000 sets the scheduler-memory sizes, =none skips them)
 *
 *   BENCH_ECHO=1 prints every reaper process's log lines (prefixed with its name); BENCH_LOG_LEVEL=debug
 *   sets their LOG_LEVEL (warn otherwise), e.g. to see each object storage request leave and each batch park.
 *   BENCH_SERVICE_NODE_ARGS are node arguments for every reaper process, e.g. '--cpu-prof --cpu-prof-dir=/tmp/prof'
 *   (one CPU profile per service, written when the bench stops it).
 *
 * Figure 10's standby replay lag needs a server with a streaming standby: bench/standby-cluster.sh
 * start makes a scratch primary (port 5544) and standby (5545); DATABASE_URL=postgres://postgres@127.0.0.1:5544/postgres.
 *
 * It needs PostgreSQL and RabbitMQ (DATABASE_URL / AMQP_URL, defaults 127.0.0.1). It creates and
 * drops its own databases (reaper_bench_<random>, reaper_bench_<random>_seed: two runs at once never
 * touch each other's) and broker objects under a random prefix, and writes bench/results/<date>-<mode>.json and .md.
 */
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { cpus, loadavg, tmpdir } from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import pg from 'pg';
import { loadEnv } from '../shared/config/env';
import { runPgBoss, type PgBossOptions, type PgBossResult } from './contenders/pgboss';
import { runRawDelete } from './contenders/raw';
import { renderCostMarkdown, runCostFigure, writeCostReport } from './figures/cost';
import { runForeground } from './figures/foreground';
import { runLatency } from './figures/latency';
import { EVENTS_ARCHIVE_CANDIDATES, runEventsArchive } from './figures/events-archive';
import { runRemoteBacklog, runRemoteDelete } from './figures/remote-delete';
import { runS3Delete } from './figures/s3-delete';
import { roundsOf, runShapes, shapeRowsNeeded, withRounds, type ShapesFigure } from './figures/shapes';
import { PARTITIONS_FIGURE, runPartitions } from './figures/partitions';
import { runReaperEndToEnd, runStageSplit, type ReaperRun } from './figures/row-delete';
import { BenchBroker } from './lib/broker';
import type { BenchContext, Measured, Throughput } from './lib/context';
import { BenchDatabases, type Seed } from './lib/database';
import { MODES, type Mode, type ModeConfig } from './lib/modes';
import { summariseProfile } from './lib/profile';
import { renderMarkdown, renderShapesTable, renderText, type BenchReport, type SizeResult } from './lib/report';
import { killLeftoverServices } from './lib/services';
import { assertCanPin, pinDatabaseApart, type Pinning } from './lib/pin';
import { PREFETCH_DEFAULTS } from '../shared/config/env';

const RESULTS_DIR = path.resolve(__dirname, '..', '..', 'bench', 'results');

/** pg-boss's best settings found on this machine (loops per worker process, jobs per fetch). */
const PGBOSS_BATCH: Omit<PgBossOptions, 'batchSize'> = { mode: 'batch', workers: 2, loopsPerWorker: 2, fetchSize: 4 };
const PGBOSS_ROW: Omit<PgBossOptions, 'batchSize'> = { mode: 'row', workers: 2, loopsPerWorker: 4, fetchSize: 100 };

/** Figures that can be measured alone (--only). */
const ONLY = ['remote', 'remote-backlog', 'events-archive', 'foreground', 's3', 'cost', 'shapes', 'partitions'] as const;
type Only = (typeof ONLY)[number];

function parseMode(): { config: ModeConfig; profile: boolean; only: Only | null; pin: boolean } {
  const { values } = parseArgs({
    options: { quick: { type: 'boolean' }, full: { type: 'boolean' }, smoke: { type: 'boolean' }, profile: { type: 'boolean' }, only: { type: 'string' }, pin: { type: 'boolean' } },
    strict: true,
  });
  if (values.only !== undefined && !(ONLY as readonly string[]).includes(values.only)) throw new Error(`--only takes one of: ${ONLY.join(', ')}`);
  const chosen = (['quick', 'full', 'smoke'] as const).filter((mode) => values[mode]);
  if (chosen.length > 1) throw new Error('give one of --quick, --full, --smoke');
  const mode: Mode = chosen[0] ?? 'quick';
  if (values.pin) assertCanPin(); // refuse before anything is seeded
  return { config: MODES[mode], profile: !!values.profile, only: (values.only as Only | undefined) ?? null, pin: !!values.pin };
}

async function serverVersions(adminUrl: string): Promise<{ postgres: string; rabbitmq: string }> {
  const client = new pg.Client({ connectionString: adminUrl });
  await client.connect();
  const postgres = `PostgreSQL ${(await client.query<{ server_version: string }>('SHOW server_version')).rows[0]!.server_version}`;
  await client.end();
  let rabbitmq = 'unknown';
  try {
    rabbitmq = execFileSync('rabbitmqctl', ['version'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] }).trim();
  } catch {
    // rabbitmqctl is not on every machine (a remote broker): the version is then just not reported.
  }
  return { postgres, rabbitmq };
}

/** The fastest of several runs: other load on a shared machine only ever slows a run down. */
function fastest<T>(runs: readonly T[], rowsPerSecond: (run: T) => number): T {
  return runs.reduce((best, run) => (rowsPerSecond(run) > rowsPerSecond(best) ? run : best));
}

/**
 * Figure 1 and 2 for one size. The contenders of figure 1 run in turns, `repeats` rounds, and each
 * reports its fastest round (all rounds are kept in the JSON): interleaving puts every contender
 * through the same moments of the machine's other load.
 */
async function measureSize(context: BenchContext, config: ModeConfig, candidates: number, first: boolean): Promise<{ size: SizeResult; seed: Seed }> {
  const batchSize = config.batchSize;
  context.progress(`seeding ${candidates.toLocaleString('en-US')} candidates (+ as many rows that must survive)`);
  const seed = await context.databases.seed(candidates);
  context.progress(`  seeded in ${seed.seedSeconds.toFixed(1)} s`);

  const reaperRuns: ReaperRun[] = [];
  const raw2Runs: Measured[] = [];
  const statementRuns: Measured[] = [];
  const pgbossRuns: PgBossResult[] = [];
  const auditRuns: ReaperRun[] = [];
  const show = (label: string, t: Throughput): void => context.progress(`    ${label}: ${Math.round(t.rowsPerSecond)} rows/s${t.bounded ? ' (bounded)' : ''}`);
  for (let round = 1; round <= config.repeats; round++) {
    context.progress(`  round ${round} of ${config.repeats}`);
    reaperRuns.push(await runReaperEndToEnd(context, seed, { batchSize }));
    show('reaper end to end', reaperRuns.at(-1)!.endToEnd);
    // Issue 9: the same run with the audit trail on, right after it (same data, same moment of the machine).
    auditRuns.push(await runReaperEndToEnd(context, seed, { batchSize, audit: true }));
    show('reaper end to end, audit on', auditRuns.at(-1)!.endToEnd);
    raw2Runs.push(await runRawDelete(context, seed, { clients: 2, batchSize }));
    show('raw DELETE, 2 clients', raw2Runs.at(-1)!);
    statementRuns.push(await runRawDelete(context, seed, { clients: 2, batchSize, statement: 'reaper' }));
    show("reaper's statement alone, 2 clients", statementRuns.at(-1)!);
    pgbossRuns.push(await runPgBoss(context, seed, { ...PGBOSS_BATCH, batchSize }));
    show('pg-boss, batch jobs', pgbossRuns.at(-1)!);
  }
  let raw4 = null;
  if (config.rawFourClients) {
    raw4 = await runRawDelete(context, seed, { clients: 4, batchSize });
    show('raw DELETE, 4 clients', raw4);
  }
  let pgbossRow = null;
  if (first) {
    pgbossRow = await runPgBoss(context, seed, { ...PGBOSS_ROW, batchSize, limitRows: Math.min(config.rowJobRows, candidates) });
    show(`pg-boss, one job per row (${config.rowJobRows} rows)`, pgbossRow);
  }
  const stages = await runStageSplit(context, seed, { batchSize });
  show('stage split, scheduler alone', stages.scheduler);
  show('stage split, workers alone', stages.workers);
  const size: SizeResult = {
    candidates,
    seedSeconds: seed.seedSeconds,
    reaper: fastest(reaperRuns, (run) => run.endToEnd.rowsPerSecond),
    raw2: fastest(raw2Runs, (run) => run.rowsPerSecond),
    raw4,
    reaperStatement: fastest(statementRuns, (run) => run.rowsPerSecond),
    pgbossBatch: fastest(pgbossRuns, (run) => run.rowsPerSecond),
    pgbossRow,
    reaperAudited: fastest(auditRuns, (run) => run.endToEnd.rowsPerSecond),
    stages,
    rounds: {
      reaperEndToEnd: reaperRuns.map((run) => run.endToEnd.rowsPerSecond),
      reaperClaimedToCompleted: reaperRuns.map((run) => run.claimedToCompleted.rowsPerSecond),
      raw2: raw2Runs.map((run) => run.rowsPerSecond),
      reaperStatement: statementRuns.map((run) => run.rowsPerSecond),
      pgbossBatch: pgbossRuns.map((run) => run.rowsPerSecond),
      reaperAudited: auditRuns.map((run) => run.endToEnd.rowsPerSecond),
    },
  };
  return { size, seed };
}

/** Figures that need only the first size's seed: scheduler memory at 200k, the batch-size sweep, the profile. */
async function measureFirstSizeExtras(context: BenchContext, config: ModeConfig, seed: Seed, size: SizeResult, report: BenchReport, profile: boolean): Promise<void> {
  if (config.schedulerMemoryAt !== null && config.schedulerMemoryAt < seed.candidates) {
    context.progress(`  scheduler memory at ${config.schedulerMemoryAt} candidates`);
    const stages = await runStageSplit(context, seed, { batchSize: config.batchSize, candidates: config.schedulerMemoryAt });
    report.schedulerMemory.push({ candidates: config.schedulerMemoryAt, peakRssMb: stages.schedulerPeakRssMb, restRssMb: stages.schedulerRestRssMb });
  }
  for (const batchSize of config.sweep?.batchSizes ?? []) {
    if (batchSize === config.batchSize) {
      report.sweep.push({ batchSize, endToEnd: size.reaper.endToEnd, claimedToCompleted: size.reaper.claimedToCompleted });
      continue;
    }
    context.progress(`  sweep: batch ${batchSize}`);
    const run = await runReaperEndToEnd(context, seed, { batchSize });
    report.sweep.push({ batchSize, endToEnd: run.endToEnd, claimedToCompleted: run.claimedToCompleted });
  }
  report.sweep.sort((a, b) => a.batchSize - b.batchSize);
  if (profile) {
    // The raw profiles (several MB) stay out of bench/results; open them in Chrome DevTools.
    const profileDir = mkdtempSync(path.join(tmpdir(), 'reaper-bench-profiles-'));
    context.progress(`  profiled end-to-end run (--cpu-prof on the scheduler and worker 1) into ${profileDir}`);
    await runReaperEndToEnd(context, seed, { batchSize: config.batchSize, profileDir });
    for (const file of readdirSync(profileDir).filter((name) => name.endsWith('.cpuprofile')).sort()) {
      report.profiles.push(summariseProfile(path.join(profileDir, file)));
    }
  }
}

async function measureRemoteBacklog(context: BenchContext, config: ModeConfig, report: BenchReport): Promise<void> {
  if (!config.remoteBacklog) throw new Error(`figure 5b (remote backlog) is measured in --full mode only`);
  const b = config.remoteBacklog;
  context.progress(`remote backlog: ${b.assets} assets, R=${b.ratePerSecond}, a run every ${b.runEverySeconds} s while it drains`);
  report.remoteBacklog = await runRemoteBacklog(context, b);
}

/** Figure 8 (issue 19): on a seed of its own size (the relay drains every event of each events run). */
async function measureEventsArchive(context: BenchContext, config: ModeConfig, report: BenchReport): Promise<void> {
  const candidates = EVENTS_ARCHIVE_CANDIDATES[config.mode];
  context.progress(`events and archive: ${candidates.toLocaleString('en-US')} candidates, ${config.repeats} rounds`);
  const seed = await context.databases.seed(candidates);
  report.eventsArchive = await runEventsArchive(context, seed, { batchSize: config.batchSize, repeats: config.repeats });
}

/**
 * Figure 7's diagnostic overrides, each a whole number from an environment variable (unset or
 * empty: the mode's own value):
 *  - BENCH_FOREGROUND_BATCH_SIZE=<n>: its reaper contenders at that batch size (the unit of deletion);
 *  - BENCH_FOREGROUND_THROTTLE=<rows/s>: its fixed-rate contender at that rate (where the foreground's p99 holds);
 *  - BENCH_FOREGROUND_ROWS=<n>: every cleanup deletes that many rows (at most the seed's candidates),
 *    e.g. to see the adaptive rate after its ramp from the start rate, which a run of 50k rows at 30
 *    statements/s (1-2 s) mostly spends in.
 */
const FOREGROUND_OVERRIDES = {
  batchSize: { name: 'BENCH_FOREGROUND_BATCH_SIZE', most: 10_000, unit: '', mark: 'batch' },
  throttle: { name: 'BENCH_FOREGROUND_THROTTLE', most: 1_000_000, unit: ' of rows/s', mark: 'throttle' },
  rows: { name: 'BENCH_FOREGROUND_ROWS', most: 10_000_000, unit: ' of rows', mark: 'rows' },
} as const;

/** A whole number from 1 to `most` from the environment variable `name`; null when absent or empty. */
function wholeNumberFromEnv(name: string, most: number, unit: string): number | null {
  const text = process.env[name];
  if (text === undefined || text === '') return null;
  const n = Number(text);
  if (!Number.isInteger(n) || n < 1 || n > most) throw new Error(`${name} must be a whole number${unit} from 1 to ${most}, got ${JSON.stringify(text)}`);
  return n;
}

function foregroundOverride(which: keyof typeof FOREGROUND_OVERRIDES): number | null {
  const { name, most, unit } = FOREGROUND_OVERRIDES[which];
  return wholeNumberFromEnv(name, most, unit);
}

/** The results file's mark of figure 7's overrides, e.g. "-batch100-throttle1000" (or "-some-phases" with BENCH_FOREGROUND_PHASES). */
function foregroundSuffix(): string {
  const marks = (Object.keys(FOREGROUND_OVERRIDES) as Array<keyof typeof FOREGROUND_OVERRIDES>).map((which) => {
    const value = foregroundOverride(which);
    return value === null ? '' : `-${FOREGROUND_OVERRIDES[which].mark}${value}`;
  });
  return `${marks.join('')}${process.env.BENCH_FOREGROUND_PHASES ? '-some-phases' : ''}`;
}

async function measureForeground(context: BenchContext, config: ModeConfig, seed: Seed, report: BenchReport): Promise<void> {
  const batchSize = foregroundOverride('batchSize');
  const throttleRate = foregroundOverride('throttle');
  const rows = foregroundOverride('rows');
  if (rows !== null && rows > seed.candidates) throw new Error(`BENCH_FOREGROUND_ROWS must be at most the seed's ${seed.candidates} candidates, got ${rows}`);
  const counted = rows === null ? config.foreground : { ...config.foreground, rows };
  const sized = batchSize === null ? counted : { ...counted, reaperBatchSize: batchSize };
  const throttled = throttleRate === null ? sized : { ...sized, throttle: { ...sized.throttle, rowsPerSecond: throttleRate } };
  const phases = process.env.BENCH_FOREGROUND_PHASES;
  const f = phases ? { ...throttled, onlyPhases: phases.split(',').map((label) => label.trim()).filter(Boolean) } : throttled;
  context.progress(`foreground impact: ${f.foreground ? `pgbench at ${f.ratePerSecond}/s (and ${f.quietRatePerSecond}/s) on ${f.clients} connections, ` : 'counts only, '}throttle ${f.throttle.rowsPerSecond} rows/s`);
  report.foreground = await runForeground(context, seed, f);
}

/** Figure 9 (object storage): one request a full 1,000 keys, two a second at 2,000 keys/s; the backlog lasts this many seconds at that rate. */
const S3_FIGURE = { keysPerSecond: 2000, requestsPerSecond: 10, concurrency: 4, maxKeysPerRequest: 1000, workers: 2 };
const S3_BACKLOG_SECONDS: Record<Mode, number> = { smoke: 3, quick: 10, full: 30 };

async function measureS3(context: BenchContext, config: ModeConfig, report: BenchReport): Promise<void> {
  const backlogSeconds = S3_BACKLOG_SECONDS[config.mode];
  context.progress(`object storage: ${S3_FIGURE.keysPerSecond} keys/s, ${S3_FIGURE.requestsPerSecond} requests/s, backlog ${S3_FIGURE.keysPerSecond * backlogSeconds} keys`);
  report.s3 = await runS3Delete(context, { ...S3_FIGURE, backlogSeconds });
}

/** The results file's mark of figure 7b's overrides, e.g. "-quiet-30-rounds20-rates500-2000" (the mode's whole figure: none). */
function shapesSuffix(shapes: ShapesFigure | null | undefined): string {
  if (!shapes) return '';
  const o = shapes.options;
  return `${o.onlyShapes ? `-${o.onlyShapes.join('-')}` : ''}${roundsOf(o) > 1 ? `-rounds${o.rounds}` : ''}${o.longRounds ? `-long${o.longSeconds}` : ''}${process.env.BENCH_SHAPES_RATES ? `-rates${o.rates.join('-')}` : ''}`;
}

/** A count of rounds from the environment (at most 1,000): absent or empty, `otherwise`. */
function roundsFromEnv(name: string, otherwise: number): number {
  return wholeNumberFromEnv(name, 1_000, ' of rounds') ?? otherwise;
}

/** Figure 7b (issue 41): on a seed of its own, large enough for one shape's sweep (each shape takes a fresh copy). */
async function measureShapes(context: BenchContext, config: ModeConfig, report: BenchReport): Promise<void> {
  if (!config.shapes) throw new Error(`figure 7b (foreground shapes) is not measured in ${config.mode} mode: use --quick or --full`);
  const only = process.env.BENCH_SHAPES?.split(',').map((key) => key.trim()).filter(Boolean);
  const law = process.env.BENCH_ADAPTIVE_LAW;
  if (law !== undefined && law !== 'load' && law !== 'harm') throw new Error(`BENCH_ADAPTIVE_LAW must be load or harm, got ${JSON.stringify(law)}`);
  const rounds = roundsFromEnv('BENCH_SHAPES_ROUNDS', 1);
  const longSeconds = wholeNumberFromEnv('BENCH_SHAPES_LONG', 600, ' seconds of the long window') ?? undefined;
  const rates = process.env.BENCH_SHAPES_RATES?.split(',').map((rate) => rate.trim()).filter(Boolean);
  for (const [i, rate] of (rates ?? []).entries()) {
    if (!/^[1-9][0-9]*$/.test(rate)) throw new Error(`BENCH_SHAPES_RATES must list fixed rates in rows/s, whole numbers above 0, separated by commas (got ${JSON.stringify(rate)} in ${JSON.stringify(process.env.BENCH_SHAPES_RATES)})`);
    if (rates!.indexOf(rate) !== i) throw new Error(`BENCH_SHAPES_RATES lists ${rate} twice (${JSON.stringify(process.env.BENCH_SHAPES_RATES)}): each rate is one contender`);
  }
  const options = withRounds(
    {
      ...config.shapes,
      ...(rates && rates.length > 0 ? { rates: rates.map(Number).sort((a, b) => a - b) } : {}),
      ...(only && only.length > 0 ? { onlyShapes: only } : {}),
      ...(law ? { adaptiveLaw: law } : {}),
    },
    rounds,
    longSeconds,
  );
  const candidates = Math.max(options.candidates, shapeRowsNeeded(options) + (shapeRowsNeeded(options) % 2));
  context.progress(
    `foreground shapes: ${candidates.toLocaleString('en-US')} candidates; fixed rates ${options.rates.join(', ')} rows/s, unthrottled, adaptive${rounds > 1 ? `; ${rounds} rounds of ${options.longRounds ? `long cleanups (long window ${options.longFromSeconds}-${options.longFromSeconds + options.longSeconds} s)` : `short cleanups (${options.shortRows.toLocaleString('en-US')} rows)`}, pooled` : ''}`,
  );
  const seed = await context.databases.seed(candidates);
  report.shapes = await runShapes(context, seed, options, loadavg);
}

/** Figure 10 (issue 44): on a seed of its own (a table partitioned by day). */
async function measurePartitions(context: BenchContext, config: ModeConfig, report: BenchReport): Promise<void> {
  const p = PARTITIONS_FIGURE[config.mode];
  context.progress(`partitions: ${p.partitions} day partitions x ${p.rowsPerPartition.toLocaleString('en-US')} expired rows, retired vs the row path${p.foreground ? `, then retired beside pgbench at ${p.ratePerSecond}/s` : ''}`);
  report.partitions = await runPartitions(context, p);
}

/**
 * Figure 5, `rounds` times: one round is 10 s at R in quick mode, and one 429 (a policy-wide block
 * of the Retry-After, 1 s) moves its ratio by a tenth, so a verdict on the rate needs several
 * rounds. The report's figure is the median round by achieved rate; every round is kept.
 */
async function measureRemote(context: BenchContext, config: ModeConfig, report: BenchReport, rounds: number): Promise<void> {
  const remote = config.remote;
  const backlog = remote.ratePerSecond * remote.backlogSeconds;
  const figures = [];
  for (let round = 1; round <= rounds; round++) {
    context.progress(`remote-delete: R=${remote.ratePerSecond}, backlog ${backlog}${rounds > 1 ? `, round ${round} of ${rounds}` : ''}`);
    const figure = await runRemoteDelete(context, { ...remote, backlog });
    context.progress(`  achieved ÷ R ${figure.achievedRatio.toFixed(3)}, 429s ${figure.rateLimited} at ${JSON.stringify(figure.rateLimitedAtMs)} ms, this process's loop delay p99 ${figure.apiLoopDelayMs.p99.toFixed(1)} ms max ${figure.apiLoopDelayMs.max.toFixed(1)} ms; in flight: ledger ${figure.slots.ledgerMean.toFixed(1)}, API ${figure.slots.apiMean.toFixed(1)} (at the cap ${(100 * figure.slots.atCapShare).toFixed(0)} % of samples), API call ${figure.slots.apiCallMs.toFixed(1)} ms; bucket full ${(100 * figure.bucketFullShare).toFixed(0)} % of samples (${(100 * figure.bucketFullWithDueShare).toFixed(0)} % of those with due operations unclaimed)`);
    figures.push(figure);
  }
  const byRate = [...figures].sort((a, b) => a.achievedRatio - b.achievedRatio);
  report.remote = byRate[Math.floor((byRate.length - 1) / 2)]!;
  if (rounds > 1) report.remoteRounds = figures;
}

async function measureAll(context: BenchContext, config: ModeConfig, report: BenchReport, profile: boolean): Promise<void> {
  for (const [index, candidates] of config.sizes.entries()) {
    // Every figure copies the bench database from this size's seed afresh: the seed never changes.
    const { size, seed } = await measureSize(context, config, candidates, index === 0);
    report.sizes.push(size);
    report.schedulerMemory.push({ candidates, peakRssMb: size.stages.schedulerPeakRssMb, restRssMb: size.stages.schedulerRestRssMb });
    if (index === 0) await measureFirstSizeExtras(context, config, seed, size, report, profile);
    if (index === 0) await measureForeground(context, config, seed, report);
  }
  const latency = config.latency;
  context.progress(`latency: ${latency.rows} rows expiring over ${latency.spreadSeconds} s, schedule "${latency.schedule}"`);
  report.latency = await runLatency(context, latency);
  await measureRemote(context, config, report, 1);
  if (config.remoteBacklog) await measureRemoteBacklog(context, config, report);
  await measureEventsArchive(context, config, report);
  await measureS3(context, config, report);
  if (config.shapes) await measureShapes(context, config, report);
  await measurePartitions(context, config, report);
}

async function main(): Promise<number> {
  const { config, profile, only, pin } = parseMode();
  const started = Date.now();
  const env = loadEnv();
  const workDir = mkdtempSync(path.join(tmpdir(), 'reaper-bench-'));
  const context: BenchContext = {
    databases: new BenchDatabases(env.databaseUrl),
    broker: new BenchBroker(env.amqpUrl),
    amqpUrl: env.amqpUrl,
    workDir,
    boundMs: config.boundMs,
    checks: [],
    requireFinished: config.mode === 'smoke',
    progress: (text) => process.stderr.write(`[bench ${((Date.now() - started) / 1000).toFixed(0).padStart(4)} s] ${text}\n`),
  };
  let pinning: Pinning | null = null;
  const cleanUp = async (): Promise<void> => {
    pinning?.restore();
    killLeftoverServices();
    await context.broker.deleteAll().catch((error: Error) => context.progress(`broker cleanup failed: ${error.message}`));
    await context.databases.dropAll().catch((error: Error) => context.progress(`database cleanup failed: ${error.message}`));
    rmSync(workDir, { recursive: true, force: true });
  };
  const interrupted = (): void => void cleanUp().finally(() => process.exit(130));
  process.once('SIGINT', interrupted);
  process.once('SIGTERM', interrupted);

  const report: BenchReport = {
    date: new Date().toISOString().slice(0, 10),
    mode: config.mode,
    startedAt: new Date(started).toISOString(),
    seconds: 0,
    machine: { cores: cpus().length, node: process.version, ...(await serverVersions(env.databaseUrl)), loadAverageAtStart: loadavg() },
    settings: {
      batchSize: config.batchSize,
      workers: 2,
      prefetch: `${PREFETCH_DEFAULTS.rowDelete} (row-delete), ${PREFETCH_DEFAULTS.remoteDelete} (remote-delete)`,
      dbPoolSize: 4,
      pgbossVersion: (JSON.parse(readFileSync(require.resolve('pg-boss/package.json'), 'utf8')) as { version: string }).version,
      pgbossLoops: PGBOSS_BATCH.loopsPerWorker,
      pgbossFetch: PGBOSS_BATCH.fetchSize,
      pgbossRowLoops: PGBOSS_ROW.loopsPerWorker,
      pgbossRowFetch: PGBOSS_ROW.fetchSize,
      repeats: config.repeats,
      boundSeconds: config.boundMs / 1000,
    },
    sizes: [],
    schedulerMemory: [],
    sweep: [],
    latency: null,
    remote: null,
    remoteBacklog: null,
    s3: null,
    foreground: null,
    shapes: null,
    partitions: null,
    profiles: [],
    checks: context.checks,
    countsOk: false,
  };
  context.progress(`${config.mode} mode; databases ${context.databases.name}(_seed); broker prefix ${context.broker.prefix}`);
  try {
    if (pin) {
      pinning = await pinDatabaseApart(env.databaseUrl);
      report.machine.pinned = pinning.describe;
      context.progress(`pinned: ${pinning.describe}`);
    }
    if (only === 'cost') {
      // BENCH_COST_MEMORY_AT=none skips the scheduler-memory part.
      const memoryAt = process.env.BENCH_COST_MEMORY_AT?.split(',').map(Number).filter((n) => Number.isInteger(n) && n > 0);
      // BENCH_COST_SIZES=n[,n] and BENCH_COST_ROUNDS=k: other sizes and rounds than the mode's (a diagnostic).
      const sizes = process.env.BENCH_COST_SIZES?.split(',').map(Number).filter((n) => Number.isInteger(n) && n > 0 && n % 2 === 0);
      const rounds = Number(process.env.BENCH_COST_ROUNDS);
      const cost = await runCostFigure(context, {
        mode: config.mode,
        sizes: sizes && sizes.length > 0 ? sizes : config.sizes,
        batchSize: config.batchSize,
        repeats: Number.isInteger(rounds) && rounds > 0 ? rounds : config.repeats,
        pgboss: PGBOSS_BATCH,
        ...(memoryAt ? { memoryAt } : {}),
      });
      mkdirSync(RESULTS_DIR, { recursive: true });
      const base = unusedBase(path.join(RESULTS_DIR, `${cost.date}-cost-${config.mode}${process.env.BENCH_COST_LABEL ? `-${process.env.BENCH_COST_LABEL}` : ''}`));
      writeCostReport(base, cost);
      process.stdout.write(`${renderCostMarkdown(cost)}\nwrote ${path.relative(process.cwd(), base)}.md\n`);
      return context.checks.every((entry) => entry.ok) ? 0 : 1;
    } else if (only === 'foreground') await measureForeground(context, config, await context.databases.seed(config.sizes[0]!), report);
    else if (only === 'remote') {
      await context.databases.seed(2);
      await measureRemote(context, config, report, roundsFromEnv('BENCH_REMOTE_ROUNDS', 5));
    } else if (only === 'remote-backlog') {
      // Every figure copies the bench database from a seed: a tiny one is enough for this figure.
      await context.databases.seed(2);
      await measureRemoteBacklog(context, config, report);
    } else if (only === 'events-archive') await measureEventsArchive(context, config, report);
    else if (only === 'shapes') await measureShapes(context, config, report);
    else if (only === 'partitions') await measurePartitions(context, config, report);
    else if (only === 's3') {
      await context.databases.seed(2);
      await measureS3(context, config, report);
    } else await measureAll(context, config, report, profile);
  } finally {
    await cleanUp();
  }

  report.seconds = (Date.now() - started) / 1000;
  report.countsOk = context.checks.every((entry) => entry.ok);
  mkdirSync(RESULTS_DIR, { recursive: true });
  const base = unusedBase(path.join(RESULTS_DIR, only === 's3' || only === 'partitions' ? `${report.date}-${only}-${config.mode}` : only === 'shapes' ? `${report.date}-shapes-${config.mode}${process.env.BENCH_ADAPTIVE_LAW ? `-${process.env.BENCH_ADAPTIVE_LAW}` : ''}${shapesSuffix(report.shapes)}${pin ? '-pinned' : ''}` : `${report.date}-${config.mode}${only ? `-${only}` : ''}${only === 'foreground' ? foregroundSuffix() : ''}${pin ? '-pinned' : ''}`));
  writeFileSync(`${base}.json`, `${JSON.stringify(report, null, 2)}\n`);
  writeFileSync(`${base}.md`, renderMarkdown(report));
  const shapes = report.shapes ? `\n\n${renderShapesTable(report.shapes).join('\n')}` : '';
  process.stdout.write(`\n${renderText(report)}${shapes}\n\nwrote ${path.relative(process.cwd(), base)}.json and .md (${report.seconds.toFixed(0)} s)\n`);
  return report.countsOk ? 0 : 1;
}

main().then(
  (code) => process.exit(code),
  (error: unknown) => {
    killLeftoverServices();
    process.stderr.write(`bench failed: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`);
    process.exit(1);
  },
);

/**
 * `base`, or `base-2`, `base-3` ... when a results file of that name is there: the names say the
 * date, mode and options, not the time, and a second run of the same options on one day overwrote
 * the first (figure 7b, 2026-12-07: two runs of the quiet shape replaced a committed one).
 */
function unusedBase(base: string): string {
  const taken = (candidate: string) => existsSync(`${candidate}.json`) || existsSync(`${candidate}.md`);
  let candidate = base;
  for (let n = 2; taken(candidate); n++) candidate = `${base}-${n}`;
  return candidate;
}
