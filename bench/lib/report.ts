import type { PgBossResult } from '../contenders/pgboss';
import { eventsArchiveRows, type EventsArchiveFigure } from '../figures/events-archive';
import type { ForegroundFigure, ForegroundPhase } from '../figures/foreground';
import type { LatencyFigure } from '../figures/latency';
import { partitionsRows, type PartitionsFigure } from '../figures/partitions';
import type { RemoteBacklogFigure, RemoteFigure } from '../figures/remote-delete';
import type { ReaperRun, StageSplit } from '../figures/row-delete';
import type { S3Figure } from '../figures/s3-delete';
import { reportedWindows, roundsOf, type IntervalVerdicts, type ShapeResult, type ShapeSummary, type ShapesFigure, type ShapeWindow, type StartCost, type StretchCost, type TargetVerdict } from '../figures/shapes';
import type { RatioInterval } from './bootstrap';
import type { CountCheck, Measured, Throughput } from './context';
import type { CpuSplit } from './cpu';
import type { Mode } from './modes';
import type { ProfileSummary } from './profile';

/** Everything one benchmark run measured; written as JSON and rendered as the table. */
export interface BenchReport {
  date: string;
  mode: Mode;
  startedAt: string;
  seconds: number;
  machine: { cores: number; node: string; postgres: string; rabbitmq: string; loadAverageAtStart: number[]; /** --pin: which processes ran on which CPU. */ pinned?: string };
  settings: Record<string, unknown>;
  sizes: SizeResult[];
  schedulerMemory: Array<{ candidates: number; peakRssMb: number; restRssMb: number }>;
  sweep: Array<{ batchSize: number; endToEnd: Throughput; claimedToCompleted: Throughput }>;
  latency: LatencyFigure | null;
  remote: RemoteFigure | null;
  /** `--only remote`: every round of figure 5 (`remote` is the median one by achieved rate). */
  remoteRounds?: RemoteFigure[];
  remoteBacklog?: RemoteBacklogFigure | null;
  /** Figure 9 (issue 21): object storage through DeleteObjects. */
  s3?: S3Figure | null;
  /** Figure 7 (issue 12): foreground impact of each cleanup. */
  foreground?: ForegroundFigure | null;
  /** Figure 7b (issue 41): foreground shapes, a sweep of fixed rates, unthrottled and adaptive reaper. */
  shapes?: ShapesFigure | null;
  /** Figure 8 (issue 19): expiry events and archive on ÷ off, relay throughput, outbox age. */
  eventsArchive?: EventsArchiveFigure | null;
  /** Figure 10 (issue 44): retiring partitions vs the row path on the same expired rows. */
  partitions?: PartitionsFigure | null;
  profiles: ProfileSummary[];
  checks: CountCheck[];
  countsOk: boolean;
}

export interface SizeResult {
  candidates: number;
  seedSeconds: number;
  reaper: ReaperRun;
  raw2: Measured;
  raw4: Measured | null;
  /** Diagnostic: reaper's own DELETE + receipt statement on 2 clients, no scan or broker. */
  reaperStatement: Measured;
  pgbossBatch: PgBossResult;
  pgbossRow: PgBossResult | null;
  /** Issue 9: reaper end to end with `audit: { enabled: true, retainDays: 30 }`, same data, same rounds. */
  reaperAudited?: ReaperRun;
  stages: StageSplit;
  /** rows/s of every round of figure 1 (the figures above are the fastest round). */
  rounds: Record<string, number[]>;
}

interface Row {
  figure: string;
  measure: string;
  value: string;
  ratio: string;
  target: string;
  met: string;
}

const number = (value: number, digits = 0): string => value.toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: digits });
const rate = (t: Throughput): string => `${number(t.rowsPerSecond)} rows/s${t.bounded ? ' (bounded)' : ''}`;
const ratio = (value: number): string => (Number.isFinite(value) ? value.toFixed(2) : '-');
const verdict = (ok: boolean): string => (ok ? 'yes' : 'NO');
/** CPU seconds (all processes of a contender, its PostgreSQL backends, RabbitMQ for reaper) per 100,000 rows. */
const cpuPer100k = (cpu: CpuSplit, rows: number): number => (rows > 0 ? (cpu.totalSeconds / rows) * 100_000 : 0);
/** "1.23 CPU s/100k rows (node 45%, pg 40%, mq 15%)" */
const cpuText = (cpu: CpuSplit, rows: number): string =>
  `${cpuPer100k(cpu, rows).toFixed(2)} CPU s/100k rows: node ${(cpu.shares.node * 100).toFixed(0)}%, pg ${(cpu.shares.postgres * 100).toFixed(0)}%, mq ${(cpu.shares.rabbitmq * 100).toFixed(0)}%`;
const count = (n: number): string => (n >= 1_000_000 ? `${n / 1_000_000}M` : n >= 1000 ? `${n / 1000}k` : String(n));

function rows(report: BenchReport): Row[] {
  const out: Row[] = [];
  const add = (figure: string, measure: string, value: string, r = '', target = '', met = ''): void => {
    out.push({ figure, measure, value, ratio: r, target, met });
  };
  for (const size of report.sizes) {
    const n = count(size.candidates);
    const e2e = size.reaper.endToEnd.rowsPerSecond;
    const raw = size.raw2.rowsPerSecond;
    add(`1 (${n})`, 'reaper end to end: trigger to completed', rate(size.reaper.endToEnd));
    add(`1 (${n})`, `  / raw DELETE, 2 clients (${rate(size.raw2)})`, '', ratio(e2e / raw), '>= 0.80', verdict(e2e / raw >= 0.8));
    if (size.raw4) add(`1 (${n})`, `  / raw DELETE, 4 clients (${rate(size.raw4)})`, '', ratio(e2e / size.raw4.rowsPerSecond));
    add(`1 (${n})`, `  / reaper's DELETE+receipt statement alone, 2 clients (${rate(size.reaperStatement)})`, '', ratio(e2e / size.reaperStatement.rowsPerSecond), '(diagnostic)');
    const boss = size.pgbossBatch.rowsPerSecond;
    add(`1 (${n})`, `  / pg-boss, ${report.settings.batchSize}-row batch jobs (${rate(size.pgbossBatch)})`, '', ratio(e2e / boss), '>= 1.0', verdict(e2e / boss >= 1));
    if (size.pgbossRow) {
      const perRow = size.pgbossRow.rowsPerSecond;
      add(`1 (${n})`, `  / pg-boss, one job per row (${rate(size.pgbossRow)} on ${count(size.pgbossRow.rows)} rows)`, '', ratio(e2e / perRow), '>= 50', verdict(e2e / perRow >= 50));
    }
    if (size.reaperAudited) {
      const audited = size.reaperAudited.endToEnd.rowsPerSecond;
      add(`1 (${n})`, 'reaper end to end, audit on (retainDays 30) / audit off', rate(size.reaperAudited.endToEnd), ratio(audited / e2e), '>= 0.70', verdict(audited / e2e >= 0.7));
    }
    const claimed = size.reaper.claimedToCompleted.rowsPerSecond;
    add(`1 (${n})`, `reaper claimed to completed (claim poll wait ${number(size.reaper.claimWaitSeconds, 2)} s left out)`, rate(size.reaper.claimedToCompleted), ratio(claimed / raw), '(vs raw)');
    const cpu = size.reaper.cpu;
    const reaperCpu = cpuPer100k(cpu, size.reaper.endToEnd.rows);
    const rawCpu = cpuPer100k(size.raw2.cpu, size.raw2.rows);
    const bossCpu = cpuPer100k(size.pgbossBatch.cpu, size.pgbossBatch.rows);
    add(
      `1 (${n})`,
      `CPU s per 100k rows: reaper (node ${(cpu.shares.node * 100).toFixed(0)}%, pg ${(cpu.shares.postgres * 100).toFixed(0)}%, mq ${(cpu.shares.rabbitmq * 100).toFixed(0)}%) / raw 2 clients / pg-boss batches`,
      `${reaperCpu.toFixed(2)} / ${rawCpu.toFixed(2)} / ${bossCpu.toFixed(2)}`,
      ratio(reaperCpu / rawCpu),
      '(reaper / raw)',
    );
    const stages = size.stages;
    add(`2 (${n})`, `scheduler alone: scan + publish + confirm (${cpuText(stages.scheduler.cpu, stages.scheduler.rows)})`, rate(stages.scheduler), ratio(stages.scheduler.rowsPerSecond / raw), '(vs raw)');
    add(`2 (${n})`, `workers alone: drain a full queue (${cpuText(stages.workers.cpu, stages.workers.rows)})`, rate(stages.workers), ratio(stages.workers.rowsPerSecond / raw), '>= 0.90', verdict(stages.workers.rowsPerSecond / raw >= 0.9));
  }
  const memory = [...report.schedulerMemory].sort((a, b) => a.candidates - b.candidates);
  for (const entry of memory) {
    add('3', `scheduler peak RSS, ${count(entry.candidates)} candidates (${number(entry.restRssMb, 1)} MB at rest)`, `${number(entry.peakRssMb, 1)} MB`, '', '< 150 MB', verdict(entry.peakRssMb < 150));
  }
  const small = memory.find((entry) => entry.candidates === 200_000);
  const large = memory.find((entry) => entry.candidates === 2_000_000);
  if (small && large) {
    const growth = large.peakRssMb / small.peakRssMb;
    add('3', 'scheduler peak RSS, 2M / 200k', '', ratio(growth), '<= 1.2', verdict(growth <= 1.2));
  } else {
    add('3', 'scheduler peak RSS, 2M / 200k', 'full mode only');
  }
  const workerPeaks = report.sizes.flatMap((size) => [...size.reaper.memory.slice(1), ...size.stages.workerPeakRssMb.map((peakRssMb) => ({ label: 'worker', peakRssMb }))]);
  if (workerPeaks.length > 0) {
    const worst = Math.max(...workerPeaks.map((entry) => entry.peakRssMb));
    add('3', 'worker peak RSS, largest of all runs', `${number(worst, 1)} MB`, '', '< 150 MB', verdict(worst < 150));
  }
  if (report.latency) {
    const l = report.latency;
    add('4', `expiry to deletion p50, tick ${l.tickSeconds} s ("${l.schedule}"), ${l.rows} rows`, `${number(l.p50Ms)} ms${l.bounded ? ' (bounded)' : ''}`);
    add('4', 'expiry to deletion p99', `${number(l.p99Ms)} ms`, '', `(tick ${l.tickSeconds * 1000} ms)`);
  }
  if (report.remote) {
    const r = report.remote;
    const head = `R=${r.ratePerSecond}, burst ${r.burst}, cap ${r.concurrency}, ${r.workers} workers, backlog ${r.backlog}`;
    add('5', `remote achieved rate (${head})`, `${number(r.achievedPerSecond, 1)} calls/s${r.bounded ? ' (bounded)' : ''}`, ratio(r.achievedRatio), '>= 0.95', verdict(r.achievedRatio >= 0.95));
    add('5', 'remote most calls in one second / (R + burst)', String(r.maxCallsInOneSecond), ratio(r.maxWindowRatio), '<= 1.0', verdict(r.maxWindowRatio <= 1));
    add('5', `remote peak concurrency / cap (API answers after ${r.slowMs} ms)`, String(r.peakConcurrency), ratio(r.concurrencyRatio), '<= 1.0', verdict(r.concurrencyRatio <= 1));
    add('5', 'remote duplicate executions', String(r.duplicates), '', '0', verdict(r.duplicates === 0));
    add('5', 'remote 429 answers', `${r.rateLimited}${r.rateLimited > 0 ? ` (at ${r.rateLimitedAtMs.map((ms) => `${number(ms)} ms`).join(', ')} after the first call)` : ''}`);
    add('5', 'bench process (the stand-in API) event-loop delay p99 / max', `${r.apiLoopDelayMs.p99.toFixed(1)} / ${r.apiLoopDelayMs.max.toFixed(1)} ms`);
    add('5', `remote calls in flight, mean: by the ledger (claim to outcome written) / at the API; ledger at the cap`, `${r.slots.ledgerMean.toFixed(1)} / ${r.slots.apiMean.toFixed(1)}; ${(100 * r.slots.atCapShare).toFixed(0)} % of ${r.slots.samples} samples (API call ${r.slots.apiCallMs.toFixed(1)} ms)`);
    if (report.remoteRounds && report.remoteRounds.length > 1) {
      const rounds = report.remoteRounds;
      const met = rounds.filter((round) => round.achievedRatio >= 0.95).length;
      add('5', `remote achieved ÷ R, each of ${rounds.length} rounds (the rows above: the median round)`, rounds.map((round) => `${ratio(round.achievedRatio)} (${round.rateLimited} × 429)`).join(', '), `${met} of ${rounds.length}`, '>= 0.95', verdict(met === rounds.length));
    }
    const operations = Object.entries(r.operations).sort((a, b) => b[1] - a[1]).map(([result, n]) => `${result} ${n}`).join(', ');
    add('5', `remote ledger outcomes (steady ${number(r.steadyPerSecond)} calls/s from 10% to 90% done)`, operations);
  }
  if (report.remoteBacklog) {
    const b = report.remoteBacklog;
    const head = `${count(b.assets)} assets, R=${b.ratePerSecond}, burst ${b.burst}, cap ${b.concurrency}, ${b.workers} workers, a run every ${b.runEverySeconds} s (${b.runs} runs)`;
    const p = b.published;
    add('5b', `backlog: messages published in all / one scan's batches (${head})`, `${p.total} (scheduler ${p.scheduler}, delay tiers ${p.delayTiers}, ledger sweeper ${p.sweeper}) / ${b.firstScanBatches}${b.bounded ? ' (bounded)' : ''}`, ratio(b.publishedRatio), '<= 3', verdict(b.publishedRatio <= 3));
    add('5b', 'backlog: achieved rate, first call to last', `${number(b.achievedPerSecond, 1)} calls/s`, ratio(b.achievedRatio), '>= 0.95', verdict(b.achievedRatio >= 0.95));
    add('5b', 'backlog: most messages in work + delay queues / first scan\'s batches', `${b.maxQueueDepth} / ${b.firstScanBatches}`, '', '<= 1', verdict(b.maxQueueDepth <= b.firstScanBatches));
    add('5b', 'backlog: duplicate executions; 429 answers; most calls in one second', `${b.duplicates}; ${b.rateLimited}; ${b.maxCallsInOneSecond}`, '', '0', verdict(b.duplicates === 0));
    add('5b', 'backlog: admission lock wait p50 / p99 (bucket bounds)', `${number(b.lockWait.p50Ms, 1)} ms / ${number(b.lockWait.p99Ms, 1)} ms over ${count(b.lockWait.grants)} grants`);
  }
  if (report.foreground) foregroundRows(report.foreground, add);
  if (report.shapes) shapesRows(report.shapes, add);
  if (report.eventsArchive) for (const row of eventsArchiveRows(report.eventsArchive)) add(...row);
  if (report.s3) s3Rows(report.s3, add);
  if (report.partitions) for (const row of partitionsRows(report.partitions)) add(...row);
  // The ratio compares claimed-to-completed: the claim poll's random wait (up to 1 s) is noise here.
  const base = report.sweep.find((entry) => entry.batchSize === 100);
  for (const entry of report.sweep) {
    add(
      '6',
      `end to end, batch ${entry.batchSize} (claimed to completed ${rate(entry.claimedToCompleted)})`,
      rate(entry.endToEnd),
      base ? ratio(entry.claimedToCompleted.rowsPerSecond / base.claimedToCompleted.rowsPerSecond) : '',
      '(claimed, vs 100)',
    );
  }
  const failed = report.checks.filter((entry) => !entry.ok);
  add('counts', `${report.checks.length} count checks`, failed.length === 0 ? 'all correct' : `${failed.length} WRONG`, '', 'all correct', verdict(failed.length === 0));
  return out;
}

/** Issue 41's targets: adaptive rate ≥ 0.7 × the knee (≥ 0.8 × unthrottled where the knee is unthrottled). */
function shapeRateTarget(summary: ShapeSummary): { ratio: number | null; least: number } {
  return summary.kneeIsUnthrottled ? { ratio: summary.adaptiveOverUnthrottled, least: 0.8 } : { ratio: summary.adaptiveOverKnee, least: 0.7 };
}

const kneeText = (summary: ShapeSummary): string =>
  summary.knee === null ? 'none' : `${summary.kneeIsUnthrottled ? 'unthrottled ' : ''}${number(summary.knee)}${summary.nonMonotone ? '*' : ''}`;

/** A 90% interval as "low–high"; '-' when there is none. */
const intervalText = (interval: RatioInterval | null): string => (interval === null ? '-' : `${ratio(interval.low)}–${ratio(interval.high)}`);

/** The knee with the noise: [highest rate surely under, lowest surely over] ('-' where there is none). */
const kneeRangeText = (summary: IntervalVerdicts): string => {
  const r = summary.kneeRange;
  const rate = (value: number | null, unthrottled: boolean): string => (value === null ? '-' : `${unthrottled ? 'unthrottled ' : ''}${number(value)}`);
  return `[${rate(r.surelyUnder, r.surelyUnderIsUnthrottled)}, ${rate(r.surelyOver, r.surelyOverIsUnthrottled)}]`;
};

/** The met column of a target read with its interval: yes, NO, or cannot tell. */
const targetVerdict = (v: TargetVerdict | 'no knee'): string => (v === 'met' ? 'yes' : v === 'missed' ? 'NO' : v);

/** A window's ratio with both intervals (sampling only; with the noise between windows) and where the second stands against the line: under, over, or ? (cannot tell). */
const windowWithInterval = (w: ShapeWindow): string =>
  `${ratio(w.p99Ratio)} (${intervalText(w.p99RatioInterval)}; ${intervalText(w.p99RatioNoiseInterval)}) ${w.p99Verdict === 'cannot tell' ? '?' : w.p99Verdict}`;

/** Both intervals of a ratio: with the noise between windows (the verdicts'), then sampling only. */
const bothIntervals = (withNoise: RatioInterval | null, samplingOnly: RatioInterval | null): string => `${intervalText(withNoise)} (sampling only ${intervalText(samplingOnly)})`;

/** The windows figure 7b reports: over rounds of short cleanups only the short one (every run takes the short window's rows, so the long window is a finished run's tail); of long cleanups (BENCH_SHAPES_LONG) both. */
function shapeWindows(f: ShapesFigure): ReadonlyArray<'short' | 'long'> {
  return reportedWindows(f.options);
}

/** Figure 7b: per shape, the knee and the adaptive contender against its targets (the per-rate table is renderShapesTable). */
function shapesRows(f: ShapesFigure, add: (figure: string, measure: string, value: string, r?: string, target?: string, met?: string) => void): void {
  for (const result of f.shapes) {
    const head = `${result.shape.label}, alone p99 ${number(result.alone.p99Ms, 2)} ms (control ${ratio(result.control.short.p99Ratio)} / ${ratio(result.control.long.p99Ratio)})`;
    const n = result.noise;
    add(
      '7b',
      `${result.shape.label}, noise floor: alone windows' p99 max ÷ min (each ÷ median); ratio: the control's 90% intervals short / long; alone windows whose sampling-only interval against the others holds 1`,
      `${ratio(n.aloneMaxOverMin)} (${n.aloneOverMedian.map(ratio).join(' ')})`,
      `${bothIntervals(result.control.short.p99RatioNoiseInterval, result.control.short.p99RatioInterval)} / ${bothIntervals(result.control.long.p99RatioNoiseInterval, result.control.long.p99RatioInterval)}`,
      '',
      `${n.aloneIntervalsHoldingOne} of ${n.aloneWindowIntervals.length}`,
    );
    for (const which of shapeWindows(f)) {
      const summary = result[which];
      const target = shapeRateTarget(summary);
      add('7b', `${head}, ${which}: knee (rows/s, p99 ÷ alone ≤ ${f.options.kneeRatio}); range [surely under, surely over] (sampling only)`, `${kneeText(summary)} ${kneeRangeText(summary)} (${kneeRangeText(summary.samplingOnly)})`);
      // The met columns read the intervals: the rate target against the knee range, the p99 target against the adaptive ratio's interval.
      add('7b', `  adaptive ${number(summary.adaptiveRowsPerSecond)} rows/s ÷ ${summary.kneeIsUnthrottled ? 'unthrottled' : 'knee'}`, '', target.ratio === null ? '-' : ratio(target.ratio), `>= ${target.least} (over the knee range)`, targetVerdict(summary.adaptiveRateVerdict));
      const p99Ms = `${number(result.contenders.find((c) => c.kind === 'adaptive')![which].foreground.p99Ms, 2)} ms`;
      add('7b', '  adaptive p99 ÷ alone (90% interval)', p99Ms, `${ratio(summary.adaptiveP99Ratio)}: ${bothIntervals(summary.adaptiveP99Interval, summary.samplingOnly.adaptiveP99Interval)}`, `<= ${f.options.kneeRatio}`, targetVerdict(summary.adaptiveP99Verdict));
    }
  }
}

/**
 * Figure 7b as one table: per shape and window, the foreground's p99 ÷ alone at each fixed rate,
 * unthrottled (and its rows/s), the knee, and the adaptive contender's rate and p99 (the columns of
 * the first result files, so they still compare), then the knee range and the adaptive p99's
 * interval and verdict; below it, every ratio's interval and the noise floor of each shape.
 */
export function renderShapesTable(f: ShapesFigure): string[] {
  const rates = f.options.rates;
  const head = [
    'shape (alone p99)', 'window', ...rates.map((r) => count(r)), 'unthrottled', 'control (no cleanup)', 'knee rows/s', 'adaptive rows/s', 'adaptive ÷ knee', 'adaptive p99 ÷ alone (transactions in its window)',
    'knee range [surely under, surely over] (sampling only)', 'adaptive p99 ÷ alone, 90% interval (sampling only)', `adaptive p99 ≤ ${f.options.kneeRatio} met`, 'adaptive rate met',
  ];
  const lines = [`| ${head.join(' | ')} |`, `|${head.map(() => '---').join('|')}|`];
  const cell = (result: ShapeResult, which: 'short' | 'long', rate: number): string => {
    const c = result.contenders.find((x) => x.kind === 'fixed' && x.rowsPerSecond === rate);
    if (!c) return '-';
    const w = c[which];
    // A fixed rate the run did not reach in the window (a short window's start, or the machine) says so.
    return `${ratio(w.p99Ratio)}${w.rowsPerSecond < 0.8 * rate ? ` (${count(Math.round(w.rowsPerSecond / 100) * 100)})` : ''}`;
  };
  for (const result of f.shapes) {
    const unthrottled = result.contenders.find((c) => c.kind === 'unthrottled')!;
    for (const which of shapeWindows(f)) {
      const summary = result[which];
      const target = shapeRateTarget(summary);
      const w = result.contenders[0]![which];
      lines.push(
        `| ${which === 'short' ? `${result.shape.label} (${number(result.alone.p99Ms, 2)} ms)` : ''} | ${which} ${number(w.fromSeconds, 1)}–${number(w.toSeconds, 1)} s${w.rounds > 1 ? ` × ${w.rounds} rounds` : ''} | ${rates.map((rate) => cell(result, which, rate)).join(' | ')} | ${ratio(unthrottled[which].p99Ratio)} (${count(Math.round(unthrottled[which].rowsPerSecond / 1000) * 1000)}) | ${ratio(result.control[which].p99Ratio)} | ${kneeText(summary)} | ${number(summary.adaptiveRowsPerSecond)} | ${target.ratio === null ? '-' : `${ratio(target.ratio)}${summary.kneeIsUnthrottled ? ' (÷ unthrottled)' : ''}`} | ${ratio(summary.adaptiveP99Ratio)} (${count(result.contenders.find((c) => c.kind === 'adaptive')![which].transactions)} tx) | ${kneeRangeText(summary)} (${kneeRangeText(summary.samplingOnly)}) | ${bothIntervals(summary.adaptiveP99Interval, summary.samplingOnly.adaptiveP99Interval)} | ${targetVerdict(summary.adaptiveP99Verdict)} | ${targetVerdict(summary.adaptiveRateVerdict)} |`,
      );
    }
  }
  const intervalHead = ['shape', 'window', ...rates.map((r) => count(r)), 'unthrottled', 'control (no cleanup)', 'adaptive'];
  const intervals = [`| ${intervalHead.join(' | ')} |`, `|${intervalHead.map(() => '---').join('|')}|`];
  const noiseHead = ["shape", "alone windows' p99 (ms)", 'max ÷ min', 'each ÷ median', roundsOf(f.options) > 1 ? "alone windows of each slot (control, then each contender's, pooled over the rounds): p99 ÷ the others (90% interval)" : 'alone windows: p99 ÷ the others (90% interval)', 'intervals holding 1', 'bootstrap CPU'];
  const noise = [`| ${noiseHead.join(' | ')} |`, `|${noiseHead.map(() => '---').join('|')}|`];
  const bySecond = ['| shape | contender | p99 ÷ alone in each second from the trigger (pooled over the rounds) |', '|---|---|---|'];
  const startCosts = ['| shape | contender | WAL (MB/s) and CPU (share of one core) by part: the first second → the rest of the short window |', '|---|---|---|'];
  for (const result of f.shapes) {
    // The control, then each contender, by name. Result files written before these were kept have
    // neither (undefined): no row for them.
    const rows = [
      { who: 'control (no cleanup)', bySecond: result.control.p99RatioBySecond, cost: result.control.startCost },
      ...result.contenders.map((c) => ({ who: c.kind === 'fixed' ? `${count(c.rowsPerSecond ?? 0)} rows/s` : c.kind, bySecond: c.p99RatioBySecond, cost: c.startCost })),
    ];
    for (const [i, row] of rows.entries()) {
      const shape = i === 0 ? result.shape.label : '';
      if (row.bySecond?.length) bySecond.push(`| ${shape} | ${row.who} | ${row.bySecond.map(ratio).join(' ')} |`);
      if (row.cost) startCosts.push(`| ${shape} | ${row.who} | ${startCostText(row.cost)} |`);
    }
  }
  for (const result of f.shapes) {
    const unthrottled = result.contenders.find((c) => c.kind === 'unthrottled')!;
    const adaptive = result.contenders.find((c) => c.kind === 'adaptive')!;
    for (const which of shapeWindows(f)) {
      const fixed = rates.map((rate) => result.contenders.find((c) => c.kind === 'fixed' && c.rowsPerSecond === rate));
      const cells = [...fixed.map((c) => (c ? windowWithInterval(c[which]) : '-')), windowWithInterval(unthrottled[which]), windowWithInterval(result.control[which]), windowWithInterval(adaptive[which])];
      intervals.push(`| ${which === 'short' ? result.shape.label : ''} | ${which} | ${cells.join(' | ')} |`);
    }
    const n = result.noise;
    noise.push(
      `| ${result.shape.label} | ${result.aloneWindowP99Ms.map((ms) => number(ms, 2)).join(' ')} | ${ratio(n.aloneMaxOverMin)} | ${n.aloneOverMedian.map(ratio).join(' ')} | ${n.aloneWindowIntervals.map((w) => `${ratio(w.ratio)} (${intervalText(w.interval)})`).join(', ')} | ${n.aloneIntervalsHoldingOne} of ${n.aloneWindowIntervals.length} | ${number(n.bootstrapCpuMs)} ms for ${n.bootstraps} samples |`,
    );
  }
  lines.push(
    '',
    `Cells: the foreground's p99 in the window ÷ its p99 over all the shape's alone windows (${f.options.aloneSeconds} s before each run); in brackets, rows/s the run reached when under 0.8 × its rate (unthrottled: always). Control: the same windows with no cleanup (the ratio's noise). The short window runs from the trigger until ${count(f.options.shortRows)} rows are deleted, at most ${f.options.shortSeconds} s (at least 1 s); the long one from min(${f.options.longFromSeconds} s, the short window's end) for ${f.options.longSeconds} s or to the run's end; the window column shows the first contender's. Knee: the highest rate whose ratio ≤ ${f.options.kneeRatio} (* a lower rate read over it). Knee range: the highest rate whose ${f.bootstrap.level * 100}% interval lies wholly at or under ${f.options.kneeRatio}, and the lowest whose interval lies wholly above it (- where none does); where harm grows with the rate the knee lies between them. Met columns: yes / NO only when the interval (p99) or the knee range (rate: the target against the highest and the lowest the knee can be) decides it, else cannot tell. Load average ${f.loadAverage.before.map((l) => l.toFixed(2)).join(' ')} before, ${f.loadAverage.after.map((l) => l.toFixed(2)).join(' ')} after.`,
  );
  const b = f.bootstrap;
  lines.push(
    '',
    `Each p99 ÷ alone with two ${b.level * 100}% bootstrap intervals (${count(b.resamples)} resamples of each window and of the pooled alone windows, independently, in blocks of ${b.blockMs} ms of consecutive transactions; seed ${b.seed}): sampling only, then with the noise between windows (each resampled ratio divided by one of the ratios the alone windows read against the others, drawn at random), and where the second stands against ${f.options.kneeRatio}: over (the whole interval above), under (the whole interval at or below), ? (cannot tell). The knee range and the met columns read the second; in brackets, what the sampling-only intervals would say.`,
    '',
    ...intervals,
    '',
    "Noise floor: the p99 of each alone window (the control's first, then each contender's in order) and each alone window's p99 ÷ the pooled p99 of the other alone windows, with its interval: no cleanup on either side, so the truth is about 1, and an interval that misses it is noise slower than a window (the machine between one window and the next), which no interval inside one window sees.",
    '',
    ...noise,
    ...(bySecond.length > 2 ? ['', "Where in a run the harm lies: the foreground's p99 in each whole second from the trigger ÷ its p99 alone, each second pooled over the rounds (a run's start, the scan, the publish and the workers' first takes, costs alike at any rate).", '', ...bySecond] : []),
    ...(startCosts.length > 2
      ? ['', "What a run's start keeps busy: the WAL written and the CPU of each part of the machine (reaper's services, the PostgreSQL backends by application_name, the RabbitMQ server; parts under 1% of a core in both stretches left out) in the run's first second → the rest of its short window, summed over the rounds.", '', ...startCosts]
      : []),
  );
  return lines;
}

/** Figure 7b: a start cost's WAL rate and each part's CPU share, first second → rest. */
function startCostText(cost: StartCost): string {
  const perSecond = (x: number, stretch: StretchCost | null): number | null => (stretch && stretch.seconds > 0 ? x / stretch.seconds : null);
  const share = (stretch: StretchCost | null, part: string): number | null => perSecond(stretch?.cpuSeconds[part] ?? 0, stretch);
  const text = (x: number | null, digits: number): string => (x === null ? '-' : x.toFixed(digits));
  const wal = `WAL ${text(perSecond(cost.first.walBytes / 1e6, cost.first), 2)} → ${text(cost.rest ? perSecond(cost.rest.walBytes / 1e6, cost.rest) : null, 2)}`;
  const parts = [...new Set([...Object.keys(cost.first.cpuSeconds), ...Object.keys(cost.rest?.cpuSeconds ?? {})])]
    .filter((part) => Math.max(share(cost.first, part) ?? 0, share(cost.rest, part) ?? 0) >= 0.01)
    .sort();
  return [wal, ...parts.map((part) => `${part} ${text(share(cost.first, part), 2)} → ${text(share(cost.rest, part), 2)}`)].join('; ');
}

/** Figure 7: the share of samples that saw each wait event, alone → during the cleanup. */
function waitShares(alone: { waitSamples: Record<string, number>; samples: number }, during: { waitSamples: Record<string, number>; samples: number }): string {
  const share = (n: number | undefined, of: number): string => `${(of > 0 ? ((n ?? 0) * 100) / of : 0).toFixed(1)}%`;
  const events = [...new Set([...Object.keys(alone.waitSamples), ...Object.keys(during.waitSamples)])].sort();
  return events.map((event) => `${event} ${share(alone.waitSamples[event], alone.samples)} → ${share(during.waitSamples[event], during.samples)}`).join('; ') || 'none';
}

/** Figure 7: each client's share of the database's CPU, alone → during the cleanup (clients under 0.1% left out). */
function cpuByClient(cpu: NonNullable<ForegroundPhase['databaseCpu']>): string {
  const clients = [...new Set([...Object.keys(cpu.alone), ...Object.keys(cpu.cleanup)])].filter((client) => Math.max(cpu.alone[client] ?? 0, cpu.cleanup[client] ?? 0) >= 0.001).sort();
  return clients.map((client) => `${client} ${((cpu.alone[client] ?? 0) * 100).toFixed(1)}% → ${((cpu.cleanup[client] ?? 0) * 100).toFixed(1)}%`).join('; ');
}

/** Figure 7: per cleanup, foreground p50/p99 / baseline, longest lock wait, WAL per row, rows/s. */
function foregroundRows(f: ForegroundFigure, add: (figure: string, measure: string, value: string, r?: string, target?: string, met?: string) => void): void {
  const single = f.phases.find((phase) => phase.name === 'single DELETE');
  const withForeground = f.phases.some((phase) => phase.foreground !== null);
  add(
    '7',
    withForeground
      ? `foreground: pgbench ${f.ratePerSecond} statements/s on ${f.clients} connections (40% renewals, 10% confirmations, 50% point reads); each cleanup deletes the same ${count(f.candidates)} rows`
      : `each cleanup deletes the same ${count(f.candidates)} rows; counts only (no foreground in this mode)`,
    '',
  );
  const describe = (phase: ForegroundPhase): string => {
    switch (phase.name) {
      case 'reaper unthrottled':
        return `reaper, batch ${f.reaperBatchSize}, unthrottled`;
      case 'reaper throttled':
        return `reaper, batch ${f.reaperBatchSize}, admission ${number(f.throttle.rowsPerSecond)} rows/s, concurrency ${f.throttle.concurrency}`;
      case 'reaper adaptive':
        return `reaper, batch ${f.reaperBatchSize}, adaptive admission, no rate set (the default)`;
      case 'single DELETE':
        return "one DELETE ... WHERE expires_at <= cutoff AND status = 'held' (a pg_cron job)";
      case 'batched DELETE loop':
        return `batched DELETE loop, ${f.loopBatchSize} per statement, 1 connection`;
      case 'no cleanup':
        return 'no cleanup (control: the foreground alone again; its ratios are the noise of two windows)';
    }
  };
  const at = (phase: ForegroundPhase): string => (phase.ratePerSecond === f.ratePerSecond ? '' : ` [foreground ${phase.ratePerSecond}/s]`);
  for (const phase of f.phases) {
    if (phase.name === 'no cleanup') {
      if (phase.foreground && phase.baseline) {
        add('7', `${describe(phase)}${at(phase)}: p50 / alone just before (${number(phase.foreground.p50Ms, 2)} / ${number(phase.baseline.p50Ms, 2)} ms; ${phase.foreground.transactions} / ${phase.baseline.transactions} tx)`, '', ratio(phase.foreground.p50Ms / phase.baseline.p50Ms));
        const m = phase.baselineMatched;
        if (m) add('7', `  p99 / alone as long just before, no cleanup (${number(phase.foreground.p99Ms, 2)} / ${number(m.p99Ms, 2)} ms; ${number(m.seconds)} s each)`, '', ratio(phase.foreground.p99Ms / m.p99Ms), '(noise)');
        add('7', `  p99 / alone just before, no cleanup (${number(phase.foreground.p99Ms, 2)} / ${number(phase.baseline.p99Ms, 2)} ms${m ? `; ${number(phase.cleanup.seconds)} s against the last ${number(f.baselineSeconds)} s: what unequal windows read` : ''})`, '', ratio(phase.foreground.p99Ms / phase.baseline.p99Ms), '(noise)');
        // Beside the contenders' own: a window's first second follows the WAL meter's CHECKPOINT in every phase.
        if (phase.foregroundP99BySecond?.length) add('7', '  foreground p99 in each second of the window, no cleanup (ms)', phase.foregroundP99BySecond.map((ms) => number(ms, 1)).join(' '));
        if (m?.p99BySecond.length) add('7', '  foreground p99 in each second alone just before (ms)', m.p99BySecond.map((ms) => number(ms, 1)).join(' '));
        if (phase.databaseCpu) add('7', '  database CPU by client, share of one core: alone just before → the window', cpuByClient(phase.databaseCpu));
        if (phase.aloneWaits) add('7', `  the foreground's waits, share of samples: alone just before (${phase.aloneWaits.samples}) → the window (${phase.samples})`, waitShares(phase.aloneWaits, phase));
      }
      continue;
    }
    add('7', `${describe(phase)}${at(phase)}: cleanup rate (${count(phase.cleanup.rows)} rows in ${number(phase.cleanup.seconds, 1)} s)`, rate({ ...phase.cleanup, bounded: false }));
    if (phase.foreground && phase.baseline) {
      const p50 = phase.foreground.p50Ms / phase.baseline.p50Ms;
      const p99 = phase.foreground.p99Ms / phase.baseline.p99Ms;
      // Issue 12's target for the fixed rate; issue 18's for adaptive at the busy foreground rate.
      const throttled = phase.name === 'reaper throttled' || (phase.name === 'reaper adaptive' && phase.ratePerSecond === f.ratePerSecond);
      add('7', `  foreground p50 / alone just before (${number(phase.foreground.p50Ms, 2)} / ${number(phase.baseline.p50Ms, 2)} ms; ${phase.foreground.transactions} / ${phase.baseline.transactions} tx)`, '', ratio(p50));
      const m = phase.baselineMatched;
      if (m) {
        // The target compares windows of one length (ForegroundPhase.baselineMatched); the short window's ratio stays beside it.
        const matched = phase.foreground.p99Ms / m.p99Ms;
        add('7', `  foreground p99 / alone as long just before (${number(phase.foreground.p99Ms, 2)} / ${number(m.p99Ms, 2)} ms; ${number(m.seconds, 1)} s alone, ${m.transactions} tx)`, '', ratio(matched), throttled ? '<= 1.25' : '(reported)', throttled ? verdict(matched <= 1.25) : '');
        add('7', `  foreground p99 / alone just before, its last ${number(f.baselineSeconds)} s (${number(phase.foreground.p99Ms, 2)} / ${number(phase.baseline.p99Ms, 2)} ms)`, '', ratio(p99), '(reported)');
      } else add('7', `  foreground p99 / alone just before (${number(phase.foreground.p99Ms, 2)} / ${number(phase.baseline.p99Ms, 2)} ms)`, '', ratio(p99), throttled ? '<= 1.25' : '(reported)', throttled ? verdict(p99 <= 1.25) : '');
      if (phase.databaseCpu) add('7', '  database CPU by client, share of one core: alone just before → during the cleanup', cpuByClient(phase.databaseCpu));
      const waits = Object.entries(phase.waitSamples).map(([type, n]) => `${type} ${n}`).join(', ') || 'none';
      add('7', `  longest lock wait of the foreground: pg_locks sampled / longest renewal (samples with a wait, of ${phase.samples}: ${waits})`, `${number(phase.lockWaitMaxMs)} ms / ${number(phase.foreground.renewalMaxMs, 1)} ms`);
      if (phase.aloneWaits) {
        const alone = phase.aloneWaits;
        add('7', `  the foreground's waits, share of samples: alone just before (${alone.samples}) → during the cleanup (${phase.samples})`, waitShares(alone, phase));
      }
    }
    if (phase.adaptive) {
      const a = phase.adaptive;
      if (phase.foregroundP99BySecond?.length) add('7', '  foreground p99 in each second of the cleanup (ms)', phase.foregroundP99BySecond.map((ms) => number(ms, 1)).join(' '));
      if (phase.baselineMatched?.p99BySecond.length) add('7', '  foreground p99 in each second alone just before (ms)', phase.baselineMatched.p99BySecond.map((ms) => number(ms, 1)).join(' '));
      add('7', `  adaptive: shared rate median / lowest, and the pressure it reacted to, median / highest (back-off at >= 2; ${a.samples} samples)`, `${count(Math.round(a.rateMedian))} / ${count(Math.round(a.rateLowest))} rows/s; ${number(a.pressureMedian, 2)} / ${number(a.pressureHighest, 2)}`);
    }
    const reaper = phase.name.startsWith('reaper');
    const walRatio = single && single.walBytesPerRow > 0 ? phase.walBytesPerRow / single.walBytesPerRow : NaN;
    add(
      '7',
      `  WAL bytes per deleted row, full-page images included (${number(phase.walBytesPerRowWithoutFpi)} B without; ratio / the single DELETE's)`,
      `${number(phase.walBytesPerRow)} B`,
      ratio(walRatio),
      reaper ? '<= 1.3' : '',
      reaper && Number.isFinite(walRatio) ? verdict(walRatio <= 1.3) : '',
    );
  }
  // Issue 18 asked adaptive with no rate set to be fast (>= 0.5 x unthrottled) beside 30 statements/s;
  // issue 41 item 4 (gentle when any other client is there: the start look's seenStartRowsPerSecond)
  // gave that up, since half of unthrottled was 4-16 x past that shape's knee (docs/performance.md).
  // Reported, no longer a target.
  const quiet = (name: ForegroundPhase['name']) => f.phases.find((phase) => phase.name === name && phase.ratePerSecond === f.quietRatePerSecond && f.quietRatePerSecond !== f.ratePerSecond);
  const adaptiveQuiet = quiet('reaper adaptive');
  const unthrottledQuiet = quiet('reaper unthrottled');
  if (adaptiveQuiet && unthrottledQuiet && unthrottledQuiet.cleanup.rowsPerSecond > 0) {
    const r = adaptiveQuiet.cleanup.rowsPerSecond / unthrottledQuiet.cleanup.rowsPerSecond;
    add('7', `reaper adaptive / reaper unthrottled, cleanup rate with the foreground at ${f.quietRatePerSecond}/s`, '', ratio(r), '(reported; was >= 0.5, issue 18)');
  }
}

/** Figure 9 (issue 21): object storage through DeleteObjects, measured at the S3 stand-in's proxy. */
function s3Rows(s: S3Figure, add: (figure: string, measure: string, value: string, ratioText?: string, target?: string, met?: string) => void): void {
  const head = `${s.keysPerSecond} keys/s, ${s.requestsPerSecond} requests/s, ${s.concurrency} at once, ${s.maxKeysPerRequest} keys a request, ${s.workers} workers, backlog ${count(s.backlog)}`;
  add('9', `object storage: keys/s achieved / keysPerSecond (${head})`, `${number(s.achievedKeysPerSecond, 1)} keys/s${s.bounded ? ' (bounded)' : ''}`, ratio(s.achievedRatio), '>= 0.95', verdict(s.achievedRatio >= 0.95));
  add('9', 'object storage: most keys in any second / keysPerSecond', String(s.maxKeysInOneSecond), ratio(s.maxWindowRatio), '<= 1.0', verdict(s.maxWindowRatio <= 1));
  add('9', 'object storage: DeleteObjects requests per 1,000 keys', `${s.requests} requests`, ratio(s.requestsPer1000Keys), '<= 1.1', verdict(s.requestsPer1000Keys <= 1.1));
  add('9', 'object storage: keys sent in more than one request; throttled answers', `${s.duplicates}; ${s.throttled}`, '', '0', verdict(s.duplicates === 0));
}

const HEADERS: Row = { figure: 'fig', measure: 'measure', value: 'value', ratio: 'ratio', target: 'target', met: 'met' };
const COLUMNS = ['figure', 'measure', 'value', 'ratio', 'target', 'met'] as const;

export function renderText(report: BenchReport): string {
  const all = [HEADERS, ...rows(report)];
  const widths = COLUMNS.map((column) => Math.max(...all.map((row) => row[column].length)));
  const line = (row: Row): string => COLUMNS.map((column, i) => row[column].padEnd(widths[i]!)).join('  ').trimEnd();
  return [line(HEADERS), widths.map((w) => '-'.repeat(w)).join('  '), ...all.slice(1).map(line)].join('\n');
}

export function renderMarkdown(report: BenchReport): string {
  const escape = (text: string): string => text.replace(/\|/g, '\\|');
  const table = [
    `| ${COLUMNS.map((column) => HEADERS[column]).join(' | ')} |`,
    `|${COLUMNS.map(() => '---').join('|')}|`,
    ...rows(report).map((row) => `| ${COLUMNS.map((column) => escape(row[column].trim())).join(' | ')} |`),
  ].join('\n');
  const m = report.machine;
  const lines = [
    `# reaper benchmark, ${report.mode} mode, ${report.date}`,
    '',
    `${m.cores} cores, load average at start ${m.loadAverageAtStart.map((l) => l.toFixed(2)).join(' ')}; Node ${m.node}; ${m.postgres}; RabbitMQ ${m.rabbitmq}. ` +
      `Took ${number(report.seconds)} s. Every ratio compares figures measured in this same run: absolute rows/s drift by ±20% or more on a shared machine, ratios much less.`,
    '',
    ...(report.mode === 'smoke' ? ['Smoke mode checks counts; at this size start-up costs dominate and its speeds say nothing.', ''] : []),
    ...(m.pinned ? [`Pinned (--pin): ${m.pinned}.`, ''] : []),
    table,
    '',
    '## How each figure was measured',
    '',
    `- Figure 1's contenders ran in turns, ${String(report.settings.repeats)} round(s); each shows its fastest round (all rounds are in the JSON): other load on a shared machine only slows a run down, and taking turns exposes every contender to the same moments.`,
    '- Data: per size, N expired held rows plus N rows that must survive (N/2 held until 2999, N/2 expired but confirmed), generated with generate_series (ids md5(i)::uuid, expiries with microseconds) once, then file-copied (CREATE DATABASE ... TEMPLATE) for every contender: identical bytes each time.',
    `- reaper: real processes (\`bin/reaper scheduler\` and 2 \`bin/reaper worker\`, prefetch ${String(report.settings.prefetch)}, ${String(report.settings.dbPoolSize)} connections each, LOG_LEVEL=warn), a run inserted as \`reaper trigger\` does; times from the run row (created_at, started_at, published_at, finished_at) on the database clock, so "completed" includes the scheduler noticing it (a completion pass every 250 ms). "claimed to completed" leaves out the wait for the scheduler's once-a-second poll for new runs.`,
    `- raw DELETE: candidates read first (untimed) in scan order, then BEGIN / DELETE ... USING unnest(ids, expiries) WHERE still expired / COMMIT per batch, on 2 (and 4) connections; no scan, broker or receipt.`,
    `- pg-boss ${String(report.settings.pgbossVersion)}: the same keyset scan (reaper's own query) inserts jobs (${String(report.settings.batchSize)} rows each, 32 per insert) while 2 worker processes drain them with fetch()/complete() in a tight loop (${String(report.settings.pgbossLoops)} loops x ${String(report.settings.pgbossFetch)} jobs per fetch each; work() itself would sleep 0.5 s+ between fetches), one transaction per job. One job per row: the same with ${String(report.settings.pgbossRowLoops)} loops x ${String(report.settings.pgbossRowFetch)} jobs per fetch, one autocommitted single-row DELETE per job, on the first rows only (its rows/s is extrapolated to the full size).`,
    '- Stage split: the scheduler alone publishes into a queue nobody consumes (claim to published), then 2 workers start and drain it (from the first batch transaction begun to the last).',
    '- CPU: user + system seconds from /proc of every process of a contender (for raw and pg-boss, the bench process too), of the PostgreSQL backends its connections use, and for reaper of the RabbitMQ server (whole server: other users of the broker add to it). Per 100k rows it is steadier than rows/s on a shared machine; on 2 busy cores, rows/s follows 1 / CPU per row.',
    '- Memory: VmHWM (peak resident set) of each process read from /proc just before it is stopped.',
    '- Latency: rows expiring over the next seconds while the policy runs on the seconds cron shown; an AFTER DELETE statement trigger in the bench database stamps each deletion with clock_timestamp().',
    '- Audit cost (issue 9): in every round, right after reaper end to end, the same run again on the same data with `audit: { enabled: true, retainDays: 30 }` on the policy (one cleanup_audit row per deleted row, written by the deleting statement; the count is checked); the ratio compares the fastest round of each.',
    '- Foreground impact (figure 7, issue 12): pgbench (custom scripts, `-R` fixed rate, per-transaction `--log`; with -R each latency runs from the scheduled start, so a stall counts for every transaction it delays) runs 40% renewals of unexpired holds (UPDATE by key), 10% confirmations (UPDATE by key, only of an unexpired hold) and 50% point reads (SELECT by key) of random rows of the same seed, alone for the seconds just before each cleanup (baseline: whatever that cleanup needs, reaper\'s idle processes included, already started, so each ratio compares one moment of the shared machine with the next) and then during each cleanup of the same first n candidates (a cutoff at the n-th expiry, each on a fresh copy): reaper (scheduler + 2 workers, batch 500) unthrottled and at a fixed admission rate (both `adaptive: false`) and with its default adaptive admission and no rate set (issue 18; it and unthrottled reaper run once more with the foreground at the quiet rate, 30 statements/s), one `DELETE ... WHERE expires_at <= cutoff AND status = \'held\'` (what a pg_cron job runs; pg_cron itself is not installed: it needs shared_preload_libraries and a restart of a shared server), and a loop of `DELETE ... WHERE key IN (SELECT ... LIMIT 1000)` on one connection. Percentiles are over the transactions that ended while the cleanup ran. The contenders with a target at the busy rate (fixed and adaptive reaper) and the control are compared with the foreground alone for as long as they ran, just before (the alone window is as long as the cleanup can take: its rows at the fixed rate, or at the adaptive floor within the time bound; its last that-many seconds count), since 2026-12-03 evening: a p99 over 60 s against one over the 4 s before compared about 180 slowest transactions with about 12; the ratio against the last 4 s stays beside it. Beside each: every client\'s share of the database\'s CPU (backend CPU seconds per second, by application_name, alone → during) and the foreground\'s wait events, share of 50 ms samples alone → during. Lock wait: pg_locks.waitstart of the foreground\'s backends sampled every 50 ms (heavyweight locks), next to the longest renewal (an UPDATE by key: any row-lock wait is inside it). The sampler (its pg_locks and adaptive-state reads and the run-state poll, one round every 50 ms) runs from the foreground\'s warm-up to the end of each phase and counts only inside the cleanup\'s window, so the window just before has the bench\'s own statements on the database as the cleanup\'s has them (before 2026-12-03 they ran only during the cleanup). The benchmark\'s own watching connections (this sampler, CPU meters) are named `reaper bench ...`, so reaper\'s adaptive admission leaves them out of the application\'s load as it leaves out its own sessions (before, the 20 Hz sampler\'s statements read as load). WAL: a CHECKPOINT before each cleanup, then pg_walinspect over the cleanup\'s LSN range, counting the bench database\'s records on every relation but seat_reservations, and only heap DELETE records there (the foreground writes only UPDATEs); full-page images included (also shown without). Rows/s: rows deleted ÷ the cleanup\'s wall time (reaper: trigger to completed).',
    ...(report.shapes ? ['- Foreground shapes (figure 7b, issue 41): see bench/figures/shapes.ts and docs/performance.md "Foreground shapes". Every p99 ratio carries two 90% bootstrap intervals (bench/lib/bootstrap.ts: 1,000 resamples of the window\'s transactions and of the pooled alone windows\', independently, in blocks of 100 ms of consecutive transactions, a fixed seed): sampling only, and with the noise between windows folded in (each resampled ratio divided by one of the ratios the alone windows read against the other alone windows pooled, drawn at random), because on a shared 2-core machine a window\'s p99 moves more from one window to the next than sampling inside it explains. A rate is over the knee\'s line only when the second interval lies wholly above it, under only when wholly at or below it; otherwise the figure cannot tell, and the met columns say so.', '', '## Figure 7b: foreground shapes', '', ...renderShapesTable(report.shapes), ''] : []),
    ...(report.eventsArchive
      ? ['- Events and archive (figure 8, issue 19): on a seed of its own size, each round runs reaper end to end three times on fresh copies: the policy as is, with `events: { enabled: true }` and one `reaper relay` running beside it (publishing to a queue bound to `<prefix>.events`; its CPU competes with the deletion), and with `archive: { enabled: true, retainDays: 30 }`; each reports its fastest round. Relay throughput: the events run once more without a relay, then one relay started on the full outbox, events ÷ seconds until the outbox is empty. Outbox oldest age: the gauge\'s query sampled every 250 ms from the trigger until the relay drained the outbox.']
      : []),
    '- Object storage (figure 9, issue 21): the S3 stand-in (tools/s3-stand-in: s3rver behind a recording proxy) in the bench process; a scheduler and 2 workers delete a backlog of keys (objects not created first: deleting an absent key succeeds in S3) under the policy\'s admission. At the proxy: keys/s = keys of every request but the last ÷ first to last arrival (a request\'s head); most keys in any second = sliding 1 s window over arrivals; requests per 1,000 keys; keys sent in more than one request.',
    ...(report.partitions
      ? [
          `- Partitions (figure 10, issue 44): a table range-partitioned by day (${report.partitions.partitions} expired day partitions of ${report.partitions.rowsPerPartition.toLocaleString('en-US')} rows, all retirable, and a live partition of ${report.partitions.liveRows.toLocaleString('en-US')} rows expiring in 2999; no default partition, so DETACH ... CONCURRENTLY), seeded once and file-copied for each run. reaper's real scheduler and 2 workers run one triggered run of the same policy (guard status = open, batch ${report.partitions.batchSize}, unthrottled) on a fresh copy: without \`partitions\` (the row path) and with \`partitions: { retire: true }\`; times are the run row's created_at to finished_at. WAL: a CHECKPOINT, then pg_current_wal_flush_lsn before and after the run (the whole cluster: other users of the shared server write too) and, with pg_walinspect, the records on the bench database's relations only (catalogs included, commit records not), per row removed. The retirement then runs once more beside figure 7's pgbench foreground (its Pgbench and wait sampler; ${report.partitions.ratePerSecond}/s on ${report.partitions.clients} connections: 40% UPDATEs and 50% reads of live rows by key and expires_at through the parent, 10% reads by id alone, which probe every partition): p99 and longest transaction over the transactions that ended while the retirement ran, against the ${report.partitions.aloneSeconds} s alone just before; lock wait from pg_locks.waitstart every 50 ms; standby replay lag from pg_stat_replication every 50 ms when the server has a standby.`,
        ]
      : []),
    '- Remote: the stand-in media API (tools/media-api/server.ts) in the bench process, limiting to R with the same burst; 3 workers share the admission budget through PostgreSQL. Achieved rate = executed deletions per second from the first to the last one.',
    '',
  ];
  if (report.sizes[0]) {
    lines.push('## CPU during the end-to-end run', '');
    for (const size of report.sizes) {
      const cpu = size.reaper.cpu;
      const processes = Object.entries(cpu.processSeconds).map(([labelName, seconds]) => `${labelName} ${seconds.toFixed(2)} s`).join(', ');
      lines.push(
        `- ${count(size.candidates)}: ${cpu.wallSeconds.toFixed(1)} s wall; ${processes}; PostgreSQL backends ${cpu.postgresBackendSeconds.toFixed(2)} s; RabbitMQ server ${cpu.rabbitmqSeconds.toFixed(2)} s (includes other users of the broker).`,
      );
    }
    lines.push('');
  }
  for (const profile of report.profiles) {
    lines.push(`## Profile: ${profile.file.replace(/^.*\//, '')} (${number(profile.busyMs)} ms busy of ${number(profile.totalMs)} ms)`, '');
    lines.push(
      'Sampled on the wall clock, start-up included: on two saturated cores a write to a socket wakes the reader and the writer waits for the CPU inside the system call, so writev/writeBuffer stand for round trips to PostgreSQL and RabbitMQ more than for CPU spent writing.',
      '',
    );
    lines.push('| self time by library or file | ms | share of busy |', '|---|---|---|');
    for (const entry of profile.byCategory) lines.push(`| ${escape(entry.name)} | ${number(entry.ms)} | ${(entry.share * 100).toFixed(1)}% |`);
    lines.push('', '| product function, inclusive | ms | share of busy |', '|---|---|---|');
    for (const entry of profile.topProductInclusive) lines.push(`| ${escape(entry.name)} | ${number(entry.ms)} | ${(entry.share * 100).toFixed(1)}% |`);
    lines.push('');
  }
  const failed = report.checks.filter((entry) => !entry.ok);
  lines.push('## Count checks', '', failed.length === 0 ? `All ${report.checks.length} correct.` : failed.map((entry) => `- WRONG: ${entry.figure}: ${entry.what}: expected ${entry.expected}, got ${entry.actual}`).join('\n'), '');
  return lines.join('\n');
}
