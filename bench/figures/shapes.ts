import { writeFileSync } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import type { AdaptiveLaw } from '../../shared/admission/adaptive-harm';
import { admissionOverrideSet } from '../../shared/db/queries/admission';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { reaperEnvironment, type BenchContext } from '../lib/context';
import { cutoffAfterCandidates, OBSERVER_APPLICATION, type Seed } from '../lib/database';
import { seatHoldsPolicy, writePolicies, type RowDeletePolicyInput } from '../lib/policies';
import { startServices, stopServices, type ReaperService } from '../lib/services';
import { CpuMeter } from '../lib/cpu';
import { blockLengthFor, bootstrapQuantiles, ratioInterval, verdictOf, type RatioInterval, type Verdict } from '../lib/bootstrap';
import { median } from '../lib/stats';
import { sleep } from '../lib/wait';
import { checkCounts, latencyOf, Pgbench, settleWrites, TAIL_MS, WARM_UP_MS, writeScripts, type ForegroundLatency } from './foreground';

/**
 * Figure 7b (issue 41): figure 7 grown into a table. Four foreground shapes, each driven by pgbench
 * at a fixed rate (-R, per-transaction log, no coordinated omission) as figure 7 drives its own:
 *  (a) figure 7's mix (40% renewals, 10% confirmations, 50% point reads) at 300 statements/s;
 *  (b) read-heavy: point reads only, 2,000/s;
 *  (c) write-heavy: 100 transactions/s, each a 20-row INSERT of ~260-byte rows into another table,
 *      a renewal of a seat hold and a counter UPDATE (about 8 KB of WAL per commit);
 *  (d) quiet: figure 7's mix at 30 statements/s.
 * For each shape, one fresh copy of the seed, one scheduler and two workers (as figure 7: the
 * bench's admin URL, batch 500) and one pgbench for the whole sweep; then, per contender, in turn:
 * the foreground alone for a few seconds, then one reaper run of that contender's policy: a fixed
 * admission rate (500 ... 16,000 rows/s, `adaptive: false`, no concurrency cap), unthrottled, and
 * the default adaptive admission (no rate set; a policy new to the database, so its start is the
 * start of a new policy). Each run is measured in two windows from its trigger:
 *  - short: until its first `shortRows` rows are deleted, at most `shortSeconds` (a short cleanup:
 *    the start of a run; at rates where 15k rows take longer, its first seconds);
 *  - long: from min(`longFromSeconds`, the short window's end) for `longSeconds` (or to the run's
 *    end): the rate and the harm once past the start.
 * After the long window the run is finished off (an override lifts a fixed rate, the bench deletes
 * the run's remaining rows itself), the table vacuumed and the writes flushed, so the next
 * contender starts as this one did. The foreground's p99 in each window is compared with its p99
 * over every alone window of the shape (pooled: ~8x the transactions of one window), and with the
 * alone window just before (in the JSON).
 *
 * Rounds (ShapesOptions.rounds, BENCH_SHAPES_ROUNDS): the control and the sweep again, each round
 * with policies of its own (the adaptive run starts as a new policy every time), each contender's
 * windows and every alone window pooled over the rounds. One short window beside 30 statements/s
 * holds about 30 transactions when the cleanup is fast, so its "p99" is its slowest transaction;
 * 30 rounds give about 900. Over rounds the contenders take turns in a rotated order, only the short
 * window is reported (every run takes the short window's rows), and the noise between windows is
 * read between slots (each slot's alone windows pooled: the scale of the windows it is folded into).
 *
 * Each ratio to the pooled alone p99 carries a 90% bootstrap interval (bench/lib/bootstrap.ts,
 * BOOTSTRAP below): a window of a few seconds holds 100–10,000 transactions, its p99 rests on 1–100
 * of them, and on a shared 2-core machine the alone windows' own p99 spread 2.5x with no cleanup
 * (2026-12-06). A rate is over the knee's line only when its whole interval is above it, under only
 * when its whole interval is at or below it; otherwise the figure cannot tell. The noise slower than
 * a window, which no interval inside one window sees, is reported beside it: the alone windows'
 * spread, and each alone window's interval against the others (they should hold 1).
 */

/**
 * The bootstrap of every p99 ratio: 1,000 resamples (the 5th and 95th percentiles rest on 50 each),
 * a 90% interval, blocks of 100 ms of consecutive transactions (one stall delays all of them under
 * -R), a fixed seed so a result file's intervals are reproduced from the same log.
 */
export const BOOTSTRAP = { resamples: 1000, level: 0.9, blockMs: 100, seed: 41 } as const;

export type ShapeScripts = 'mixed' | 'read' | 'write';

/**
 * What one stretch of a run cost the machine, summed over the rounds: CPU seconds by part (each
 * reaper service; the PostgreSQL backends by application_name, pgbench's and reaper's apart; the
 * RabbitMQ server) and the WAL written (pg_current_wal_lsn: exact at once, where pg_stat_wal lags
 * up to a second). Read for the run's first second and for the rest of its short window: the
 * foreground's p99 doubles in a run's first second at any rate, 1 row/s included (issue 41), and
 * this says which part of the machine the start keeps busy.
 */
export interface StretchCost {
  seconds: number;
  cpuSeconds: Record<string, number>;
  walBytes: number;
}

/** The cost of a run's first second and of the rest of its short window (null: too short to read). */
export interface StartCost {
  first: StretchCost;
  rest: StretchCost | null;
}

export interface ShapeSpec {
  key: string;
  label: string;
  ratePerSecond: number;
  clients: number;
  scripts: ShapeScripts;
}

export const SHAPES: readonly ShapeSpec[] = [
  { key: 'mixed-300', label: 'pgbench mix 300/s', ratePerSecond: 300, clients: 4, scripts: 'mixed' },
  { key: 'read-2000', label: 'point reads 2,000/s', ratePerSecond: 2000, clients: 4, scripts: 'read' },
  { key: 'write-100', label: 'writes 100 tx/s (20-row inserts + updates)', ratePerSecond: 100, clients: 4, scripts: 'write' },
  { key: 'quiet-30', label: 'pgbench mix 30/s (quiet)', ratePerSecond: 30, clients: 4, scripts: 'mixed' },
];

export interface ShapesOptions {
  /** The adaptive contender's law (issue 41; BENCH_ADAPTIVE_LAW): absent, the default's. */
  adaptiveLaw?: AdaptiveLaw;
  /** Candidates of the seed the figure takes (each shape a fresh copy). */
  candidates: number;
  batchSize: number;
  /** Fixed admission rates of the sweep (rows/s); unthrottled and adaptive run beside them. */
  rates: readonly number[];
  aloneSeconds: number;
  shortRows: number;
  shortSeconds: number;
  longFromSeconds: number;
  longSeconds: number;
  /** Rows of an unthrottled run, and the most any fixed-rate run takes. */
  maxRunRows: number;
  /** Rows of the adaptive run. */
  adaptiveRows: number;
  /** The knee: the highest rate whose p99 ÷ alone is at most this. */
  kneeRatio: number;
  /** Only these shapes (by key; BENCH_SHAPES), all when absent. */
  onlyShapes?: readonly string[];
  /**
   * Rounds of the whole sweep, the control included (BENCH_SHAPES_ROUNDS; 1 when absent). Each
   * contender's windows, and the alone windows, are pooled over the rounds: beside 30 statements/s
   * a short cleanup at 15k rows/s or more overlaps about 30 transactions, so one window's "p99" is
   * its slowest transaction, and only many rounds give its p99 something to rest on.
   */
  rounds?: number;
  /**
   * Over rounds, long cleanups (BENCH_SHAPES_LONG, seconds of the long window): each run keeps the
   * mode's run sizes and the long window, and both windows are reported, pooled over the rounds. The
   * adaptive run keeps adaptiveRows (quick: 100k), so at a rate that deletes them within the window
   * the window ends with the run.
   * Issue 41 asks for short and long cleanups: a law that starts gentle may still climb past the
   * knee once past the start, which only a long window over many rounds can tell from the noise.
   */
  longRounds?: boolean;
}

export type ContenderKind = 'fixed' | 'unthrottled' | 'adaptive';

export interface ShapeWindow {
  /** The rounds pooled in this window (ShapesOptions.rounds), and the transactions they hold. */
  rounds: number;
  transactions: number;
  fromSeconds: number;
  toSeconds: number;
  rows: number;
  rowsPerSecond: number;
  foreground: ForegroundLatency;
  /** p99 ÷ the shape's pooled alone p99. */
  p99Ratio: number;
  /** p99 ÷ the p99 of the alone window just before this contender. */
  p99RatioJustBefore: number;
  /** The bootstrap interval of p99Ratio (BOOTSTRAP), sampling inside the windows only; null when a sample was empty. */
  p99RatioInterval: RatioInterval | null;
  /**
   * The same with the noise between windows folded in (each resampled ratio ÷ one of the ratios the
   * alone windows read against each other, ShapeNoise): the interval the verdicts use.
   */
  p99RatioNoiseInterval: RatioInterval | null;
  /** p99Ratio against the knee's line, with p99RatioNoiseInterval: over, under, or cannot tell. */
  p99Verdict: Verdict;
  /** The same with p99RatioInterval (sampling only). */
  p99VerdictSamplingOnly: Verdict;
}

export interface ShapeContender {
  kind: ContenderKind;
  /** The fixed rate (rows/s); null for unthrottled and adaptive. */
  rowsPerSecond: number | null;
  policy: string;
  runRows: number;
  aloneJustBefore: ForegroundLatency;
  short: ShapeWindow;
  long: ShapeWindow;
  /** Seconds from the trigger to the first deleted row. */
  firstRowSeconds: number | null;
  /** The run finished by itself within the long window (no finishing off needed). */
  finishedInWindow: boolean;
  /** Rows the bench deleted itself after the long window. */
  finishedOffRows: number;
  /** [ms since the trigger, rows deleted so far (receipts)], sampled every 100 ms until the long window's end. */
  deletedSeries: Array<[number, number]>;
  /** Adaptive: the shared rate (cleanup_admission.adaptive_rate) sampled every 100 ms in each window. */
  /**
   * The stored rate every 100 ms of the first round: [ms from the trigger, rows/s, the last step's
   * adaptive_pressure (the load law's pressure, the harm law's harm; null before a step)].
   */
  adaptiveRate: { shortMedian: number | null; longMedian: number | null; series: Array<[number, number, number | null]> } | null;
  /**
   * The foreground's p99 ÷ alone in each whole second from the trigger (second 1 is [0, 1 s)), pooled
   * over the rounds: where in a run the harm lies. A run's start (the scan, the publish, the workers'
   * first takes) costs the same at any rate; only what follows scales with it.
   */
  p99RatioBySecond: number[];
  /** The machine's CPU and WAL in the run's first second against the rest of the short window, summed over the rounds. */
  startCost: StartCost | null;
}

/** The knee and the adaptive contender read from the point ratios (the first result files' columns). */
export interface PointSummary {
  /** Highest rate (fixed, or unthrottled's achieved rate) whose window p99 ÷ alone ≤ kneeRatio; null when none. */
  knee: number | null;
  kneeIsUnthrottled: boolean;
  /** A lower fixed rate read over the line although a higher one did not (noise in the ratio). */
  nonMonotone: boolean;
  adaptiveRowsPerSecond: number;
  adaptiveOverKnee: number | null;
  adaptiveOverUnthrottled: number;
  adaptiveP99Ratio: number;
}

/** The knee and the targets read with one kind of interval. */
export interface IntervalVerdicts {
  /**
   * The knee with the noise: the highest rate (fixed, or unthrottled's achieved rate) whose interval
   * is wholly at or under the line, and the lowest whose interval is wholly above it; null when
   * there is none. The knee lies between them where harm grows with the rate.
   */
  kneeRange: { surelyUnder: number | null; surelyUnderIsUnthrottled: boolean; surelyOver: number | null; surelyOverIsUnthrottled: boolean };
  adaptiveP99Interval: RatioInterval | null;
  /** The adaptive p99 target (≤ kneeRatio) with its interval. */
  adaptiveP99Verdict: TargetVerdict;
  /**
   * The rate target (≥ 0.7 × the knee, ≥ 0.8 × unthrottled where the knee is unthrottled) against
   * the knee range: met when it holds against the highest rate the knee can be (the step below the
   * lowest surely over), missed when it fails against the lowest (the highest surely under); 'no
   * knee' when the lowest rate is surely over.
   */
  adaptiveRateVerdict: TargetVerdict | 'no knee';
}

/**
 * The knee range and the verdicts with the intervals that hold the noise between windows (the
 * fields), and with the sampling-only intervals (`samplingOnly`: too narrow on a machine whose p99
 * moves from one window to the next; kept to show what they would have claimed).
 */
export interface ShapeSummary extends PointSummary, IntervalVerdicts {
  samplingOnly: IntervalVerdicts;
}

export type TargetVerdict = 'met' | 'missed' | 'cannot tell';

/** The noise floor of one shape: what the p99 ratio reads with no cleanup at all. */
export interface ShapeNoise {
  /** The alone windows' p99: the highest ÷ the lowest. */
  aloneMaxOverMin: number;
  /** Each alone window's p99 ÷ their median, in order. */
  aloneOverMedian: number[];
  /**
   * Each alone window's p99 ÷ the pooled p99 of the other alone windows, with its interval (over
   * rounds: each slot's alone windows pooled against the other slots', noiseGroups): the truth is
   * about 1, so the share of intervals holding 1 says whether the intervals can be trusted (about
   * 90% if the noise were only sampling within a window).
   */
  aloneWindowIntervals: Array<{ ratio: number; interval: RatioInterval | null }>;
  aloneIntervalsHoldingOne: number;
  /** CPU the bootstrap took for this shape (ms), and how many samples it resampled. */
  bootstrapCpuMs: number;
  bootstraps: number;
}

export interface ShapeResult {
  shape: ShapeSpec;
  alone: ForegroundLatency;
  /**
   * The control: no cleanup at all, the same alone window and the same short and long windows
   * after it. Its ratios are the noise of this measurement at this moment of the machine: a
   * contender's ratio means something only where it stands clear of these.
   */
  control: { short: ShapeWindow; long: ShapeWindow; p99RatioBySecond: number[]; startCost: StartCost | null };
  /** The p99 of each alone window, in order (their spread is the ratio's noise). */
  aloneWindowP99Ms: number[];
  noise: ShapeNoise;
  contenders: ShapeContender[];
  short: ShapeSummary;
  long: ShapeSummary;
  seconds: number;
}

export interface ShapesFigure {
  options: ShapesOptions;
  bootstrap: typeof BOOTSTRAP;
  candidates: number;
  shapes: ShapeResult[];
  loadAverage: { before: number[]; after: number[] };
}

/** Rows a run of this contender takes: enough for both windows at its rate (a quarter more), within the limits. */
function runRows(options: ShapesOptions, kind: ContenderKind, rate: number | null): number {
  if (kind === 'unthrottled') return options.maxRunRows;
  if (kind === 'adaptive') return options.adaptiveRows;
  const needed = Math.ceil((rate! * (options.longFromSeconds + options.longSeconds) * 1.25) / options.batchSize) * options.batchSize;
  return Math.min(options.maxRunRows, Math.max(options.shortRows, needed));
}

/** The adaptive contender runs last: its run is not waited for once its windows are measured (runContender). */
function contenders(options: ShapesOptions): Array<{ kind: ContenderKind; rate: number | null }> {
  return [...options.rates.map((rate) => ({ kind: 'fixed' as const, rate })), { kind: 'unthrottled', rate: null }, { kind: 'adaptive', rate: null }];
}

/** Candidates one shape consumes (each shape starts from a fresh copy of the seed). */
export function shapeRowsNeeded(options: ShapesOptions): number {
  return roundsOf(options) * contenders(options).reduce((sum, c) => sum + runRows(options, c.kind, c.rate), 0);
}

/** A contender's name: its kind, and a fixed one's rate ("fixed-500", "unthrottled", "adaptive"). */
function contenderKey(kind: ContenderKind, rate: number | null): string {
  return kind === 'fixed' ? `fixed-${rate}` : kind;
}

/** Each round's runs have policies of their own: the adaptive run's start is that of a new policy every round. */
function policyName(shape: ShapeSpec, kind: ContenderKind, rate: number | null, round: number): string {
  return `bench-shape-${shape.key}-${contenderKey(kind, rate)}${round > 0 ? `-r${round + 1}` : ''}`;
}

/** Rounds of the sweep (ShapesOptions.rounds; 1 when absent). */
export function roundsOf(options: Pick<ShapesOptions, 'rounds'>): number {
  return options.rounds ?? 1;
}

/**
 * The options of `rounds` rounds: over more than one, every run takes the short window's rows (one
 * short window beside 30 statements/s holds about 30 transactions, so only rounds give its p99
 * something to rest on) and the long window is a finished run's tail, reported nowhere; with
 * `longSeconds` (long cleanups, BENCH_SHAPES_LONG), the mode's run sizes and a long window of that
 * many seconds, both windows reported.
 */
export function withRounds(options: ShapesOptions, rounds: number, longSeconds?: number): ShapesOptions {
  if (longSeconds !== undefined) return { ...options, longSeconds, rounds, longRounds: true };
  return rounds > 1 ? { ...options, maxRunRows: options.shortRows, adaptiveRows: options.shortRows, longSeconds: 1, rounds } : { ...options, rounds };
}

/** The windows a figure reports: over rounds of short cleanups only the short one. */
export function reportedWindows(options: Pick<ShapesOptions, 'rounds' | 'longRounds'>): ReadonlyArray<'short' | 'long'> {
  return roundsOf(options) > 1 && !options.longRounds ? ['short'] : ['short', 'long'];
}

function policyFor(options: ShapesOptions, name: string, kind: ContenderKind, rate: number | null): RowDeletePolicyInput {
  const admission =
    kind === 'fixed' ? { rowsPerSecond: rate!, adaptive: false } : kind === 'unthrottled' ? { adaptive: false } : options.adaptiveLaw ? { law: options.adaptiveLaw } : undefined;
  return seatHoldsPolicy(name, options.batchSize, undefined, admission ? { admission } : {});
}

/** The write-heavy shape's tables, in the bench database (a fresh copy per shape). */
async function createWriteTables(pool: pg.Pool): Promise<void> {
  await pool.query(`CREATE TABLE IF NOT EXISTS bench_orders (
    order_id bigserial PRIMARY KEY, order_ref bigint NOT NULL, seat text NOT NULL, payload text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`);
  await pool.query('CREATE INDEX IF NOT EXISTS bench_orders_by_ref ON bench_orders (order_ref)');
  await pool.query('CREATE TABLE IF NOT EXISTS bench_counters (id int PRIMARY KEY, n bigint NOT NULL, updated_at timestamptz NOT NULL)');
  await pool.query('INSERT INTO bench_counters SELECT g, 0, now() FROM generate_series(0, 99) g ON CONFLICT DO NOTHING');
}

function shapeScripts(context: BenchContext, seed: Seed, shape: ShapeSpec): string[] {
  if (shape.scripts === 'mixed') return writeScripts(context.workDir, seed);
  if (shape.scripts === 'read') return writeScripts(context.workDir, seed, { renew: 0, confirm: 0, read: 1 });
  // One transaction: 20 rows of ~260 bytes into bench_orders (two indexes), a renewal of an
  // unexpired hold (never a candidate: see foreground.ts) and a counter.
  const file = path.join(context.workDir, 'foreground-write.sql');
  writeFileSync(
    file,
    `\\set i 4 * random(0, ${seed.totalRows / 4 - 1}) + 2
\\set o random(1, 1000000000)
BEGIN;
INSERT INTO bench_orders (order_ref, seat, payload) SELECT :o, 'seat-' || :i, repeat(md5((:o + g)::text), 8) FROM generate_series(1, 20) g;
UPDATE seat_reservations SET expires_at = expires_at + interval '1 second', updated_at = now() WHERE reservation_id = md5('bench-hold-' || :i)::uuid AND status = 'held';
UPDATE bench_counters SET n = n + 20, updated_at = now() WHERE id = :o % 100;
COMMIT;
`,
  );
  return [`${file}@1`];
}

/** One reaper run's progress, read every 100 ms: rows deleted (receipts), its state, the adaptive rate and the last step's pressure (or harm). */
interface Progress {
  at: number;
  deleted: number;
  state: string | null;
  adaptiveRate: number | null;
  adaptivePressure: number | null;
}

async function readProgress(pool: pg.Pool, runId: string, policy: string): Promise<Progress> {
  const row = (
    await pool.query<{ deleted: number; state: string | null; rate: number | null; pressure: number | null }>(
      `SELECT (SELECT coalesce(sum(deleted), 0)::int FROM cleanup_batches WHERE run_id = $1) AS deleted,
              (SELECT state FROM cleanup_runs WHERE run_id = $1) AS state,
              a.adaptive_rate AS rate, a.adaptive_pressure AS pressure
         FROM (SELECT 1) AS one LEFT JOIN cleanup_admission AS a ON a.policy = $2`,
      [runId, policy],
    )
  ).rows[0]!;
  return { at: Date.now(), deleted: row.deleted, state: row.state, adaptiveRate: row.rate, adaptivePressure: row.pressure };
}

/** Whether a candidate at or before `cutoff` is left (one a worker's batch held when the bench deleted the rest). */
async function candidatesLeft(pool: pg.Pool, cutoff: string): Promise<boolean> {
  return (await pool.query(`SELECT 1 FROM seat_reservations WHERE expires_at <= $1::timestamptz AND status = 'held' LIMIT 1`, [cutoff])).rows.length > 0;
}

/** Rows deleted by `ms` (the last sample at or before it). */
function deletedAt(series: ReadonlyArray<{ at: number; deleted: number }>, ms: number): number {
  let deleted = 0;
  for (const p of series) if (p.at <= ms) deleted = p.deleted;
  return deleted;
}

/**
 * When the window's last row was deleted: the first sample in (fromMs, toMs] that shows the count
 * the window ends with (toMs when none does, or the count never moved). Samples are 100 ms apart,
 * so a rate read over a few hundred milliseconds is within a quarter or so.
 */
export function deletingUntil(series: ReadonlyArray<{ at: number; deleted: number }>, fromMs: number, toMs: number): number {
  const final = deletedAt(series, toMs);
  if (final === deletedAt(series, fromMs)) return toMs;
  for (const p of series) if (p.at > fromMs && p.at <= toMs && p.deleted >= final) return p.at;
  return toMs;
}

/**
 * The groups of alone windows whose p99s are compared with each other for the noise between
 * windows: each window alone in a single round; over rounds, the windows of one slot together.
 */
export function noiseGroups<W>(windows: ReadonlyArray<{ slot: string; window: W }>, rounds: number): W[][] {
  if (rounds <= 1) return windows.map((w) => [w.window]);
  const bySlot = new Map<string, W[]>();
  for (const w of windows) bySlot.set(w.slot, [...(bySlot.get(w.slot) ?? []), w.window]);
  return [...bySlot.values()];
}

/** One stretch's meter: CPU by part and WAL from now until finish. */
async function stretchMeter(pool: pg.Pool, services: readonly ReaperService[]): Promise<() => Promise<StretchCost>> {
  const meter = new CpuMeter(pool, { services, backends: '%', includeRabbitmq: true });
  const lsn = async (): Promise<string> => (await pool.query<{ lsn: string }>('SELECT pg_current_wal_lsn()::text AS lsn')).rows[0]!.lsn;
  const fromLsn = await lsn();
  await meter.start();
  return async () => {
    const split = await meter.finish();
    const walBytes = Number((await pool.query<{ bytes: string }>('SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint AS bytes', [fromLsn])).rows[0]!.bytes);
    const cpuSeconds: Record<string, number> = { ...split.processSeconds, rabbitmq: split.rabbitmqSeconds };
    for (const [application, seconds] of Object.entries(split.postgresByApplication)) cpuSeconds[`postgres ${application || '(unnamed)'}`] = seconds;
    return { seconds: split.wallSeconds, cpuSeconds, walBytes };
  };
}

/**
 * Meters a run's first second, then the rest of its short window: `startCost()` right before the
 * trigger, and the returned `endOfShort()` when the short window ends (the first second's meter is
 * read at 1 s whatever the window does in between).
 */
async function startCostMeter(pool: pg.Pool, services: readonly ReaperService[]): Promise<{ endOfShort: () => Promise<StartCost> }> {
  const firstStretch = await stretchMeter(pool, services);
  const startedAt = Date.now();
  const firstDone = (async () => {
    await sleep(Math.max(0, startedAt + 1000 - Date.now()));
    const first = await firstStretch();
    return { first, rest: await stretchMeter(pool, services) };
  })();
  return {
    endOfShort: async () => {
      const { first, rest } = await firstDone;
      const after = await rest();
      return { first, rest: after.seconds >= 0.5 ? after : null };
    },
  };
}

/** Start costs summed over the rounds (a stretch's seconds and CPU and WAL add up; a missing rest leaves the others'). */
function sumStartCosts(costs: ReadonlyArray<StartCost | null>): StartCost | null {
  const present = costs.filter((c): c is StartCost => c !== null);
  if (present.length === 0) return null;
  const add = (stretches: StretchCost[]): StretchCost | null => {
    if (stretches.length === 0) return null;
    const cpuSeconds: Record<string, number> = {};
    for (const stretch of stretches) for (const [part, seconds] of Object.entries(stretch.cpuSeconds)) cpuSeconds[part] = (cpuSeconds[part] ?? 0) + seconds;
    return { seconds: stretches.reduce((sum, x) => sum + x.seconds, 0), cpuSeconds, walBytes: stretches.reduce((sum, x) => sum + x.walBytes, 0) };
  };
  return { first: add(present.map((c) => c.first))!, rest: add(present.flatMap((c) => (c.rest ? [c.rest] : []))) };
}

async function runContender(
  context: BenchContext,
  pool: pg.Pool,
  options: ShapesOptions,
  services: readonly ReaperService[],
  policy: string,
  rows: number,
  waitForRun: boolean,
): Promise<{
  aloneFromMs: number;
  aloneToMs: number;
  startMs: number;
  shortEndMs: number;
  longFromMs: number;
  longEndMs: number;
  series: Progress[];
  finishedInWindow: boolean;
  finishedOffRows: number;
  runId: string;
  startCost: StartCost;
}> {
  const aloneFromMs = Date.now();
  await sleep(options.aloneSeconds * 1000);
  const aloneToMs = Date.now();
  const cutoff = await cutoffAfterCandidates(pool, rows);
  const cost = await startCostMeter(pool, services);
  const startMs = Date.now();
  const run = (await runsInsertIfAbsent(pool, { policy, trigger: 'manual', scheduledFor: null, cutoff }))!;
  const series: Progress[] = [];
  const sample = async (): Promise<Progress> => {
    const p = await readProgress(pool, run.runId, policy);
    if (p.state === 'failed') throw new Error(`shapes: run ${run.runId} of ${policy} failed`);
    series.push(p);
    return p;
  };
  let p = await sample();
  while (p.deleted < options.shortRows && p.state !== 'completed' && p.at - startMs < options.shortSeconds * 1000) {
    await sleep(100);
    p = await sample();
  }
  const shortEndMs = Math.max(p.at, startMs + 1000);
  const startCost = await cost.endOfShort();
  const longFromMs = Math.min(startMs + options.longFromSeconds * 1000, shortEndMs);
  while (p.state !== 'completed' && p.at < longFromMs + options.longSeconds * 1000) {
    await sleep(100);
    p = await sample();
  }
  const longEndMs = Math.max(p.at, longFromMs + 1000);
  const finishedInWindow = p.state === 'completed';
  let finishedOffRows = 0;
  if (!finishedInWindow) {
    // Finish the run off: no fixed rate any more (an adaptive rate stays), and its rows gone.
    // Rows a worker's batch holds are skipped (SKIP LOCKED): that batch deletes them; one
    // statement over all of them deadlocked with the workers' batches.
    await admissionOverrideSet(pool, { policy, rate: 10_000_000, setBy: 'bench' });
    // The adaptive run is not waited for (waitForRun false; it runs last): an adaptive rate stays
    // low after its rows are gone, and each batch already published still takes its tokens (at
    // the floor, a batch of 500 a second). Its rows are gone; its receipts are read once the
    // services have stopped.
    const deadline = Date.now() + context.boundMs;
    for (;;) {
      if (Date.now() > deadline) throw new Error(`shapes: run of ${policy} not completed ${context.boundMs / 1000} s after its rows were deleted`);
      const gone = await pool.query(
        `DELETE FROM seat_reservations WHERE reservation_id IN (
           SELECT reservation_id FROM seat_reservations WHERE expires_at <= $1::timestamptz AND status = 'held' LIMIT 5000 FOR UPDATE SKIP LOCKED)`,
        [cutoff],
      );
      finishedOffRows += gone.rowCount ?? 0;
      p = await readProgress(pool, run.runId, policy);
      if (waitForRun ? p.state === 'completed' : !gone.rowCount && !(await candidatesLeft(pool, cutoff))) break;
      if (!gone.rowCount) await sleep(100);
    }
  }
  return { aloneFromMs, aloneToMs, startMs, shortEndMs, longFromMs, longEndMs, series, finishedInWindow, finishedOffRows, runId: run.runId, startCost };
}

/** The control's windows: the foreground alone, then as long as a contender's windows with nothing triggered. */
async function runControl(
  pool: pg.Pool,
  services: readonly ReaperService[],
  options: ShapesOptions,
): Promise<{ aloneFromMs: number; aloneToMs: number; startMs: number; shortEndMs: number; longFromMs: number; longEndMs: number; startCost: StartCost }> {
  const aloneFromMs = Date.now();
  await sleep(options.aloneSeconds * 1000);
  const aloneToMs = Date.now();
  const cost = await startCostMeter(pool, services);
  const startMs = Date.now();
  const shortEndMs = startMs + options.shortSeconds * 1000;
  const longFromMs = startMs + options.longFromSeconds * 1000;
  const longEndMs = longFromMs + options.longSeconds * 1000;
  await sleep(shortEndMs - startMs);
  const startCost = await cost.endOfShort();
  await sleep(Math.max(0, longEndMs - Date.now()));
  return { aloneFromMs, aloneToMs, startMs, shortEndMs, longFromMs, longEndMs, startCost };
}

/**
 * Resampled p99s of the windows of one shape, each sample with a seed of its own (a numerator and
 * its denominator must not draw the same random sequence), and the CPU they took.
 */
class ShapeBootstrap {
  private nextSeed: number = BOOTSTRAP.seed;
  cpuMs = 0;
  count = 0;

  /** Transactions in the order they ended (the log's order: pgbench runs one thread), observed over `windowMs`. */
  p99s(transactions: ReadonlyArray<{ ms: number }>, windowMs: number): Float64Array {
    const started = process.cpuUsage();
    const values = transactions.map((t) => t.ms);
    const out = bootstrapQuantiles(values, blockLengthFor(values.length, windowMs, BOOTSTRAP.blockMs), { resamples: BOOTSTRAP.resamples, quantile: 0.99, seed: this.seed() });
    const used = process.cpuUsage(started);
    this.cpuMs += (used.user + used.system) / 1000;
    this.count++;
    return out;
  }

  /** A seed no other draw of this shape uses. */
  seed(): number {
    return this.nextSeed++;
  }
}

/** The knee of one window (short or long) and the adaptive contender against it. */
export function summarise(contenders: readonly ShapeContender[], which: 'short' | 'long', kneeRatio: number): ShapeSummary {
  const fixed = contenders.filter((c) => c.kind === 'fixed').sort((a, b) => a.rowsPerSecond! - b.rowsPerSecond!);
  const unthrottled = contenders.find((c) => c.kind === 'unthrottled')!;
  const adaptive = contenders.find((c) => c.kind === 'adaptive')!;
  const ladder = [
    ...fixed.map((c) => ({ rate: c.rowsPerSecond!, window: c[which], unthrottled: false })),
    { rate: unthrottled[which].rowsPerSecond, window: unthrottled[which], unthrottled: true },
  ].map((step) => ({ ...step, ratio: step.window.p99Ratio }));
  const passing = ladder.filter((step) => step.ratio <= kneeRatio);
  const top = passing.at(-1) ?? null;
  const firstFail = ladder.findIndex((step) => step.ratio > kneeRatio);
  const adaptiveRowsPerSecond = adaptive[which].rowsPerSecond;
  // The rate target of a knee at `step` (issue 41): 0.8 × unthrottled's rate, else 0.7 × the rate.
  const rateTargetMet = (step: { rate: number; unthrottled: boolean }): boolean => adaptiveRowsPerSecond >= (step.unthrottled ? 0.8 : 0.7) * step.rate;
  const withIntervals = (intervalOf: (w: ShapeWindow) => RatioInterval | null): IntervalVerdicts => {
    const verdicts = ladder.map((step) => verdictOf(intervalOf(step.window), kneeRatio));
    const surelyUnderIndex = verdicts.lastIndexOf('under');
    const surelyOverIndex = verdicts.indexOf('over');
    const surelyUnder = surelyUnderIndex >= 0 ? ladder[surelyUnderIndex]! : null;
    const surelyOver = surelyOverIndex >= 0 ? ladder[surelyOverIndex]! : null;
    // The highest the knee can be: the step below the lowest surely over (every step when none is).
    const kneeAtMost = surelyOverIndex < 0 ? ladder.at(-1)! : surelyOverIndex > 0 ? ladder[surelyOverIndex - 1]! : null;
    const metAtMost = kneeAtMost !== null && rateTargetMet(kneeAtMost);
    const missedAtLeast = surelyUnder !== null && !rateTargetMet(surelyUnder);
    const adaptiveP99 = verdictOf(intervalOf(adaptive[which]), kneeRatio);
    return {
      kneeRange: {
        surelyUnder: surelyUnder?.rate ?? null,
        surelyUnderIsUnthrottled: surelyUnder?.unthrottled ?? false,
        surelyOver: surelyOver?.rate ?? null,
        surelyOverIsUnthrottled: surelyOver?.unthrottled ?? false,
      },
      adaptiveP99Interval: intervalOf(adaptive[which]),
      adaptiveP99Verdict: adaptiveP99 === 'under' ? 'met' : adaptiveP99 === 'over' ? 'missed' : 'cannot tell',
      // Both at once: a lower rate surely over and a higher one surely under (harm not growing with the rate): undecided.
      adaptiveRateVerdict: kneeAtMost === null ? 'no knee' : metAtMost === missedAtLeast ? 'cannot tell' : metAtMost ? 'met' : 'missed',
    };
  };
  return {
    knee: top?.rate ?? null,
    kneeIsUnthrottled: top?.unthrottled ?? false,
    nonMonotone: firstFail >= 0 && top !== null && ladder.indexOf(top) > firstFail,
    adaptiveRowsPerSecond,
    adaptiveOverKnee: top ? adaptiveRowsPerSecond / top.rate : null,
    adaptiveOverUnthrottled: unthrottled[which].rowsPerSecond > 0 ? adaptiveRowsPerSecond / unthrottled[which].rowsPerSecond : 0,
    adaptiveP99Ratio: adaptive[which].p99Ratio,
    ...withIntervals((w) => w.p99RatioNoiseInterval),
    samplingOnly: withIntervals((w) => w.p99RatioInterval),
  };
}

async function runShape(context: BenchContext, seed: Seed, options: ShapesOptions, shape: ShapeSpec): Promise<ShapeResult> {
  const started = Date.now();
  await context.databases.fresh();
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  let services: ReaperService[] = [];
  let pgbench: Pgbench | null = null;
  try {
    await createWriteTables(pool);
    await settleWrites(context);
    const rounds = roundsOf(options);
    const plan = Array.from({ length: rounds }, (_, round) =>
      contenders(options).map((c) => ({ ...c, round, policy: policyName(shape, c.kind, c.rate, round), rows: runRows(options, c.kind, c.rate) })),
    ).flat();
    await context.broker.preparePhase(plan.map((c) => c.policy));
    const policiesPath = writePolicies(context.workDir, `shapes-${shape.key}`, plan.map((c) => policyFor(options, c.policy, c.kind, c.rate)));
    services = await startServices(reaperEnvironment(context, policiesPath), [
      { kind: 'scheduler', id: 'bench-scheduler' },
      { kind: 'worker', id: 'bench-worker-1' },
      { kind: 'worker', id: 'bench-worker-2' },
    ]);
    const perContenderSeconds = options.aloneSeconds + options.longFromSeconds + options.longSeconds + context.boundMs / 1000 + 10;
    pgbench = new Pgbench(path.join(context.workDir, `pgbench-shape-${shape.key}`), context.databases.url, shapeScripts(context, seed, shape), shape, (plan.length + rounds) * perContenderSeconds + 60);
    await sleep(WARM_UP_MS);
    pgbench.assertRunning();
    // Every window of the shape in the order measured: each round's control, then its contenders.
    const controls: Array<Awaited<ReturnType<typeof runControl>>> = [];
    const measured: Array<(typeof plan)[number] & Awaited<ReturnType<typeof runContender>>> = [];
    // Each alone window with its slot: the control's, or the contender's it came before.
    const aloneOrder: Array<{ aloneFromMs: number; aloneToMs: number; slot: string }> = [];
    for (let round = 0; round < rounds; round++) {
      const control = await runControl(pool, services, options);
      controls.push(control);
      aloneOrder.push({ ...control, slot: 'control' });
      const of = rounds > 1 ? `, round ${round + 1} of ${rounds}` : '';
      context.progress(`    ${shape.label}: control (no cleanup) measured${of}`);
      // Rounds after the first take the contenders in a rotated order, so that none always follows
      // the same one (a run leaves the next one its dead rows' VACUUM and a checkpoint's page images).
      const inRound = plan.filter((one) => one.round === round);
      const turn = round % inRound.length;
      for (const [index, c] of [...inRound.slice(turn), ...inRound.slice(0, turn)].entries()) {
        // The figure's very last run, if adaptive, is not waited for (runContender); any other must
        // end before the next run's alone window.
        const last = round === rounds - 1 && index === inRound.length - 1;
        const m = await runContender(context, pool, options, services, c.policy, c.rows, c.kind !== 'adaptive' || !last);
        measured.push({ ...c, ...m });
        aloneOrder.push({ ...m, slot: contenderKey(c.kind, c.rate) });
        for (const service of services) service.assertRunning();
        pgbench.assertRunning();
        // The next contender starts as this one did: dead rows vacuumed, writes flushed, the checkpoint's page images written.
        await pool.query('VACUUM seat_reservations');
        await settleWrites(context);
        await sleep(WARM_UP_MS);
        const rate = (w: { rows: number; seconds: number }): string => `${Math.round(w.rows / w.seconds)} rows/s`;
        const short = { rows: deletedAt(m.series, m.shortEndMs), seconds: (m.shortEndMs - m.startMs) / 1000 };
        const long = { rows: deletedAt(m.series, m.longEndMs) - deletedAt(m.series, m.longFromMs), seconds: (m.longEndMs - m.longFromMs) / 1000 };
        context.progress(`    ${shape.label}: ${c.policy}: short ${rate(short)} over ${short.seconds.toFixed(1)} s, long ${rate(long)} over ${long.seconds.toFixed(1)} s${m.finishedOffRows ? ` (${m.finishedOffRows} rows finished off)` : ''}`);
      }
    }
    await sleep(TAIL_MS);
    await pgbench.stop();
    const p = pgbench;
    const aloneWindows = aloneOrder.map((m) => ({ transactions: p.transactions(m.aloneFromMs, m.aloneToMs), ms: m.aloneToMs - m.aloneFromMs }));
    const aloneAll = aloneWindows.flatMap((w) => w.transactions);
    const alone = latencyOf(aloneAll);
    const bootstrap = new ShapeBootstrap();
    const aloneResampled = bootstrap.p99s(aloneAll, aloneWindows.reduce((sum, w) => sum + w.ms, 0));
    const aloneWindowP99Ms = aloneWindows.map((w) => latencyOf(w.transactions).p99Ms);
    // Each alone group against the others pooled: no cleanup on either side, so an interval that
    // misses 1 is noise the interval did not see, and the ratios are that noise (windowNoise below).
    // A group is what a contender's ratio pools: one alone window in a single round; over rounds,
    // every alone window of one slot (the control's, or those before one contender), so the noise
    // is read at the scale of the pooled windows it is folded into, not at that of a 2 s window,
    // whose p99 beside 30 statements/s is its slowest transaction.
    const groups = noiseGroups(aloneOrder.map((m, i) => ({ slot: m.slot, window: aloneWindows[i]! })), rounds);
    const aloneWindowIntervals = groups.map((group, i) => {
      const others = groups.filter((_, j) => j !== i).flat();
      const mine = group.flatMap((w) => w.transactions);
      const othersAll = others.flatMap((o) => o.transactions);
      const interval = ratioInterval(bootstrap.p99s(mine, group.reduce((sum, w) => sum + w.ms, 0)), bootstrap.p99s(othersAll, others.reduce((sum, o) => sum + o.ms, 0)), BOOTSTRAP.level);
      return { ratio: latencyOf(mine).p99Ms / latencyOf(othersAll).p99Ms, interval };
    });
    const windowNoise = aloneWindowIntervals.map((w) => w.ratio);
    /** One window of a contender (or the control), pooled over its rounds: each round's [fromMs, toMs) of its own run. */
    const window = (segments: ReadonlyArray<{ series: readonly Progress[]; startMs: number; fromMs: number; toMs: number }>, justBefore: ForegroundLatency): ShapeWindow => {
      const rows = segments.reduce((sum, s) => sum + deletedAt(s.series, s.toMs) - deletedAt(s.series, s.fromMs), 0);
      const ms = segments.reduce((sum, s) => sum + s.toMs - s.fromMs, 0);
      // The rate while it deleted: a window lasts at least 1 s, and a 15k-row run may end well inside it.
      const deletingMs = segments.reduce((sum, s) => sum + deletingUntil(s.series, s.fromMs, s.toMs) - s.fromMs, 0);
      const transactions = segments.flatMap((s) => p.transactions(s.fromMs, s.toMs));
      const foreground = latencyOf(transactions);
      const resampled = bootstrap.p99s(transactions, ms);
      const p99RatioInterval = ratioInterval(resampled, aloneResampled, BOOTSTRAP.level);
      const p99RatioNoiseInterval = ratioInterval(resampled, aloneResampled, BOOTSTRAP.level, { ratios: windowNoise, seed: bootstrap.seed() });
      const meanSeconds = (at: (s: (typeof segments)[number]) => number): number => segments.reduce((sum, s) => sum + (at(s) - s.startMs) / 1000, 0) / segments.length;
      return {
        rounds: segments.length,
        transactions: transactions.length,
        fromSeconds: meanSeconds((s) => s.fromMs),
        toSeconds: meanSeconds((s) => s.toMs),
        rows,
        rowsPerSecond: rows / (Math.max(deletingMs, 1) / 1000),
        foreground,
        p99Ratio: foreground.p99Ms / alone.p99Ms,
        p99RatioJustBefore: foreground.p99Ms / justBefore.p99Ms,
        p99RatioInterval,
        p99RatioNoiseInterval,
        p99Verdict: verdictOf(p99RatioNoiseInterval, options.kneeRatio),
        p99VerdictSamplingOnly: verdictOf(p99RatioInterval, options.kneeRatio),
      };
    };
    /** The p99 ÷ alone of each whole second from the trigger, each second pooled over the runs (up to the last run's window end). */
    const p99RatioBySecond = (runs: ReadonlyArray<{ startMs: number; longEndMs: number }>): number[] => {
      const seconds = Math.floor(Math.min(...runs.map((one) => one.longEndMs - one.startMs)) / 1000);
      return Array.from({ length: seconds }, (_, k) => {
        const transactions = runs.flatMap((one) => p.transactions(one.startMs + k * 1000, one.startMs + (k + 1) * 1000));
        return Number((latencyOf(transactions).p99Ms / alone.p99Ms).toFixed(2));
      });
    };
    const aloneBefore = (runs: ReadonlyArray<{ aloneFromMs: number; aloneToMs: number }>): ForegroundLatency => latencyOf(runs.flatMap((m) => p.transactions(m.aloneFromMs, m.aloneToMs)));
    const results: ShapeContender[] = contenders(options).map((c) => {
      const runs = measured.filter((m) => m.kind === c.kind && m.rate === c.rate);
      const m = runs[0]!;
      const aloneJustBefore = aloneBefore(runs);
      const firsts = runs.flatMap((one) => {
        const first = one.series.find((s) => s.deleted > 0);
        return first ? [(first.at - one.startMs) / 1000] : [];
      });
      const rates = (at: (one: (typeof runs)[number]) => [number, number]): number | null => {
        const values = runs.flatMap((one) => {
          const [fromMs, toMs] = at(one);
          return one.series.filter((s) => s.at >= fromMs && s.at <= toMs && s.adaptiveRate !== null).map((s) => s.adaptiveRate!);
        });
        return values.length > 0 ? median(values) : null;
      };
      return {
        kind: m.kind,
        rowsPerSecond: m.rate,
        policy: m.policy,
        runRows: m.rows,
        aloneJustBefore,
        short: window(runs.map((one) => ({ ...one, fromMs: one.startMs, toMs: one.shortEndMs })), aloneJustBefore),
        long: window(runs.map((one) => ({ ...one, fromMs: one.longFromMs, toMs: one.longEndMs })), aloneJustBefore),
        firstRowSeconds: firsts.length > 0 ? median(firsts) : null,
        finishedInWindow: runs.every((one) => one.finishedInWindow),
        finishedOffRows: runs.reduce((sum, one) => sum + one.finishedOffRows, 0),
        // The first round's series: the others' are alike.
        deletedSeries: m.series.map((s) => [s.at - m.startMs, s.deleted] as [number, number]),
        adaptiveRate:
          m.kind === 'adaptive'
            ? {
                shortMedian: rates((one) => [one.startMs, one.shortEndMs]),
                longMedian: rates((one) => [one.longFromMs, one.longEndMs]),
                series: m.series
                  .filter((s) => s.adaptiveRate !== null)
                  .map((s) => [s.at - m.startMs, Math.round(s.adaptiveRate!), s.adaptivePressure === null ? null : Number(s.adaptivePressure.toFixed(3))] as [number, number, number | null]),
              }
            : null,
        p99RatioBySecond: p99RatioBySecond(runs),
        startCost: sumStartCosts(runs.map((one) => one.startCost)),
      };
    });
    const controlAlone = aloneBefore(controls);
    const controlRuns = controls.map((control) => ({ series: [] as Progress[], startMs: control.startMs, control }));
    const controlWindows = {
      short: window(controlRuns.map((c) => ({ ...c, fromMs: c.control.startMs, toMs: c.control.shortEndMs })), controlAlone),
      long: window(controlRuns.map((c) => ({ ...c, fromMs: c.control.longFromMs, toMs: c.control.longEndMs })), controlAlone),
      p99RatioBySecond: p99RatioBySecond(controls),
      startCost: sumStartCosts(controls.map((control) => control.startCost)),
    };
    const aloneMedian = median(aloneWindowP99Ms);
    const noise: ShapeNoise = {
      aloneMaxOverMin: Math.max(...aloneWindowP99Ms) / Math.min(...aloneWindowP99Ms),
      aloneOverMedian: aloneWindowP99Ms.map((ms) => ms / aloneMedian),
      aloneWindowIntervals,
      aloneIntervalsHoldingOne: aloneWindowIntervals.filter((w) => w.interval !== null && w.interval.low <= 1 && 1 <= w.interval.high).length,
      bootstrapCpuMs: bootstrap.cpuMs,
      bootstraps: bootstrap.count,
    };
    await stopServices(services);
    const consumed = plan.reduce((sum, c) => sum + c.rows, 0);
    // Receipts once every worker has stopped: the adaptive run's last batches included.
    const receipts = (
      await pool.query<{ deleted: number }>('SELECT coalesce(sum(deleted), 0)::int AS deleted FROM cleanup_batches WHERE run_id = ANY($1::uuid[])', [measured.map((m) => m.runId)])
    ).rows[0]!.deleted;
    const deleted = receipts + measured.reduce((sum, m) => sum + m.finishedOffRows, 0);
    await checkCounts(context, `shapes: ${shape.label}`, seed, pool, consumed, deleted);
    return {
      shape,
      alone,
      aloneWindowP99Ms,
      noise,
      control: controlWindows,
      contenders: results,
      short: summarise(results, 'short', options.kneeRatio),
      long: summarise(results, 'long', options.kneeRatio),
      seconds: (Date.now() - started) / 1000,
    };
  } finally {
    await pgbench?.stop();
    await stopServices(services);
    await pool.end();
  }
}

export async function runShapes(context: BenchContext, seed: Seed, options: ShapesOptions, loadAverage: () => number[]): Promise<ShapesFigure> {
  const needed = shapeRowsNeeded(options);
  if (needed > seed.candidates) throw new Error(`shapes: one shape takes ${needed} candidates, the seed has ${seed.candidates}`);
  const unknown = options.onlyShapes?.filter((key) => !SHAPES.some((shape) => shape.key === key)) ?? [];
  if (unknown.length > 0) throw new Error(`BENCH_SHAPES: no shape ${unknown.map((key) => JSON.stringify(key)).join(', ')}; the shapes are ${SHAPES.map((shape) => shape.key).join(', ')}`);
  const before = loadAverage();
  const shapes: ShapeResult[] = [];
  for (const shape of SHAPES) {
    if (options.onlyShapes && !options.onlyShapes.includes(shape.key)) continue;
    context.progress(`  shape ${shape.label}`);
    const result = await runShape(context, seed, options, shape);
    shapes.push(result);
    const s = (summary: ShapeSummary): string =>
      `knee ${summary.knee === null ? 'none' : Math.round(summary.knee)} [${summary.kneeRange.surelyUnder === null ? '-' : Math.round(summary.kneeRange.surelyUnder)}, ${summary.kneeRange.surelyOver === null ? '-' : Math.round(summary.kneeRange.surelyOver)}], adaptive ${Math.round(summary.adaptiveRowsPerSecond)} rows/s p99 ÷ alone ${summary.adaptiveP99Ratio.toFixed(2)}${summary.adaptiveP99Interval ? ` (${summary.adaptiveP99Interval.low.toFixed(2)}–${summary.adaptiveP99Interval.high.toFixed(2)}: ${summary.adaptiveP99Verdict})` : ''}`;
    context.progress(`    ${shape.label}: alone p99 ${result.alone.p99Ms.toFixed(1)} ms; short: ${s(result.short)}; long: ${s(result.long)} (${result.seconds.toFixed(0)} s)`);
    context.progress(`    ${shape.label}: alone windows' p99 max ÷ min ${result.noise.aloneMaxOverMin.toFixed(2)}, ${result.noise.aloneIntervalsHoldingOne} of ${result.noise.aloneWindowIntervals.length} alone-window intervals hold 1; bootstrap ${result.noise.bootstrapCpuMs.toFixed(0)} ms CPU`);
  }
  return { options, bootstrap: BOOTSTRAP, candidates: seed.candidates, shapes, loadAverage: { before, after: loadAverage() } };
}
