import { writeFileSync } from 'node:fs';
import { runPgBoss, type PgBossOptions } from '../contenders/pgboss';
import { runRawDelete } from '../contenders/raw';
import type { BenchContext, Measured } from '../lib/context';
import type { CpuSplit } from '../lib/cpu';
import type { Seed } from '../lib/database';
import { relationBlocksMarkdown, relationBlocksRead, statementsMarkdown, statementsRead, statementsReset, statementsWanted, type RelationBlocks, type StatementCost } from '../lib/statements';
import { median } from '../lib/stats';
import { runReaperEndToEnd, runSchedulerAlone, runStageSplit, SERVICE_NODE_ARGS } from './row-delete';

/**
 * Issue 18 item 2 (`npm run bench -- --only cost`): what each deleted row costs PostgreSQL. For
 * each size: reaper end to end, reaper's workers alone (draining a full queue), the raw 2-client
 * batched DELETE and pg-boss batch jobs, in turns, `repeats` rounds; the figure is PostgreSQL
 * backend CPU seconds per 100k deleted rows (the median round), and the ratios to raw; beside it
 * every CPU second of each window by where it ran (Node, PostgreSQL, RabbitMQ), whose sum bounds
 * rows/s when everything shares one machine. Then the
 * scheduler's peak RSS for a run of each of `memoryAt` candidates (scheduler alone: scan, publish,
 * confirm; nobody consumes).
 *
 * A/B in one session: BENCH_COST_BEFORE_BIN names another build's bin/reaper; its reaper figures
 * are measured in the same rounds, right before this build's, on the same seed.
 */

export interface CostVariant {
  label: string;
  bin: string | undefined;
}

export interface CostRound {
  reaperEndToEnd: number;
  workersAlone: number;
}

/**
 * Every CPU second of a measured window per 100k deleted rows, by where it ran: the contender's
 * Node processes (the bench process itself for the raw DELETE and pg-boss, which run in it),
 * PostgreSQL backends, and the RabbitMQ server (reaper only). On one shared 2-core machine the
 * sum, not PostgreSQL's part alone, is what bounds rows per second.
 */
export interface CpuPer100k {
  node: number;
  postgres: number;
  rabbitmq: number;
}

export const cpuPer100k = (cpu: CpuSplit, rows: number): CpuPer100k => {
  const per = (seconds: number): number => (rows > 0 ? (seconds / rows) * 100_000 : Number.NaN);
  return { node: per(Object.values(cpu.processSeconds).reduce((sum, seconds) => sum + seconds, 0)), postgres: per(cpu.postgresBackendSeconds), rabbitmq: per(cpu.rabbitmqSeconds) };
};

export interface CostSize {
  candidates: number;
  /** PostgreSQL backend CPU s per 100k deleted rows, per round. */
  variants: Array<{ label: string; endToEnd: number[]; workersAlone: number[]; endToEndRowsPerSecond: number[]; workersAloneRowsPerSecond: number[]; endToEndByApplication: Array<Record<string, number>>; schedulerAlone: number[]; endToEndAllCpu: CpuPer100k[]; endToEndSeconds: number[]; endToEndStartup: number[]; endToEndTail: number[]; workersAloneAllCpu: CpuPer100k[]; schedulerAloneAllCpu: CpuPer100k[] }>;
  raw2: number[];
  pgbossBatch: number[];
  raw2RowsPerSecond: number[];
  pgbossBatchRowsPerSecond: number[];
  /** Every CPU second per 100k rows, per round. */
  raw2AllCpu: CpuPer100k[];
  pgbossBatchAllCpu: CpuPer100k[];
  /** BENCH_STATEMENTS=1: pg_stat_statements of the last round, per contender, with the rows it deleted. */
  statements?: Array<{ contender: string; deletedRows: number; statements: StatementCost[]; relations: RelationBlocks[] }>;
}

export interface CostReport {
  date: string;
  mode: string;
  loadAverageAtStart: number[];
  batchSize: number;
  sizes: CostSize[];
  schedulerMemory: Array<{ label: string; candidates: number; peakRssMb: number; restRssMb: number }>;
}

/** PostgreSQL backend CPU seconds per 100k rows of one measured window. */
export const pgPer100k = (cpu: CpuSplit, rows: number): number => cpuPer100k(cpu, rows).postgres;

export async function measureCostSize(
  context: BenchContext,
  seed: Seed,
  options: { batchSize: number; repeats: number; variants: readonly CostVariant[]; pgboss: Omit<PgBossOptions, 'batchSize'> },
): Promise<CostSize> {
  const size: CostSize = {
    candidates: seed.candidates,
    variants: options.variants.map((variant) => ({ label: variant.label, endToEnd: [], workersAlone: [], endToEndRowsPerSecond: [], workersAloneRowsPerSecond: [], endToEndByApplication: [], schedulerAlone: [], endToEndAllCpu: [], endToEndSeconds: [], endToEndStartup: [], endToEndTail: [], workersAloneAllCpu: [], schedulerAloneAllCpu: [] })),
    raw2: [],
    pgbossBatch: [],
    raw2RowsPerSecond: [],
    pgbossBatchRowsPerSecond: [],
    raw2AllCpu: [],
    pgbossBatchAllCpu: [],
  };
  const at = (variant: CostVariant): BenchContext => ({ ...context, reaperBin: variant.bin });
  // Per-statement figures of the last round only (each contender's database is a fresh copy, so
  // a reset before it and a read after it see that contender alone).
  const measureStatements = async <T>(round: number, contender: string, work: () => Promise<T>, deleted: (result: T) => number): Promise<T> => {
    const wanted = statementsWanted() && round === options.repeats;
    if (wanted) await statementsReset(context.databases.adminUrl);
    const result = await work();
    if (wanted) {
      const statements = await statementsRead(context.databases.adminUrl, context.databases.name);
      (size.statements ??= []).push({ contender, deletedRows: deleted(result), statements, relations: await relationBlocksRead(context.databases.url) });
    }
    return result;
  };
  for (let round = 1; round <= options.repeats; round++) {
    context.progress(`  cost round ${round} of ${options.repeats}`);
    for (const [index, variant] of options.variants.entries()) {
      const run = await measureStatements(round, `reaper end to end (${variant.label})`, () => runReaperEndToEnd(at(variant), seed, { batchSize: options.batchSize }), (r) => r.endToEnd.rows);
      size.variants[index]!.endToEnd.push(pgPer100k(run.cpu, run.endToEnd.rows));
      size.variants[index]!.endToEndRowsPerSecond.push(run.endToEnd.rowsPerSecond);
      size.variants[index]!.endToEndAllCpu.push(cpuPer100k(run.cpu, run.endToEnd.rows));
      size.variants[index]!.endToEndSeconds.push(run.endToEnd.seconds);
      if (run.startupSeconds !== null) size.variants[index]!.endToEndStartup.push(run.startupSeconds);
      if (run.tailSeconds !== null) size.variants[index]!.endToEndTail.push(run.tailSeconds);
      const byApplication = Object.fromEntries(Object.entries(run.cpu.postgresByApplication).map(([name, seconds]) => [name, (seconds / run.endToEnd.rows) * 100_000]));
      size.variants[index]!.endToEndByApplication.push(byApplication);
      const split = Object.entries(byApplication).map(([name, value]) => `${name} ${value.toFixed(3)}`).join(', ');
      context.progress(
        `    ${variant.label} end to end: ${pgPer100k(run.cpu, run.endToEnd.rows).toFixed(3)} pg s/100k (${split}), ${Math.round(run.endToEnd.rowsPerSecond)} rows/s; ` +
          `${run.endToEnd.seconds.toFixed(2)} s, of them ${run.startupSeconds?.toFixed(2) ?? '-'} s to the first batch and ${run.tailSeconds?.toFixed(2) ?? '-'} s after the last one began`,
      );
    }
    const raw: Measured = await measureStatements(round, 'raw DELETE, 2 clients', () => runRawDelete(context, seed, { clients: 2, batchSize: options.batchSize }), (r) => r.rows);
    size.raw2.push(pgPer100k(raw.cpu, raw.rows));
    size.raw2RowsPerSecond.push(raw.rowsPerSecond);
    size.raw2AllCpu.push(cpuPer100k(raw.cpu, raw.rows));
    context.progress(`    raw 2 clients: ${pgPer100k(raw.cpu, raw.rows).toFixed(3)} pg s/100k, ${Math.round(raw.rowsPerSecond)} rows/s`);
    const boss = await runPgBoss(context, seed, { ...options.pgboss, batchSize: options.batchSize });
    size.pgbossBatch.push(pgPer100k(boss.cpu, boss.rows));
    size.pgbossBatchRowsPerSecond.push(boss.rowsPerSecond);
    size.pgbossBatchAllCpu.push(cpuPer100k(boss.cpu, boss.rows));
    context.progress(`    pg-boss batches: ${pgPer100k(boss.cpu, boss.rows).toFixed(3)} pg s/100k`);
    for (const [index, variant] of options.variants.entries()) {
      const stages = await measureStatements(round, `reaper scheduler alone, then workers alone (${variant.label})`, () => runStageSplit(at(variant), seed, { batchSize: options.batchSize }), (r) => r.workers.rows);
      size.variants[index]!.workersAlone.push(pgPer100k(stages.workers.cpu, stages.workers.rows));
      size.variants[index]!.schedulerAlone.push(pgPer100k(stages.scheduler.cpu, stages.scheduler.rows));
      size.variants[index]!.workersAloneRowsPerSecond.push(stages.workers.rowsPerSecond);
      size.variants[index]!.workersAloneAllCpu.push(cpuPer100k(stages.workers.cpu, stages.workers.rows));
      size.variants[index]!.schedulerAloneAllCpu.push(cpuPer100k(stages.scheduler.cpu, stages.scheduler.rows));
      context.progress(`    ${variant.label} workers alone: ${pgPer100k(stages.workers.cpu, stages.workers.rows).toFixed(3)} pg s/100k; scheduler alone ${pgPer100k(stages.scheduler.cpu, stages.scheduler.rows).toFixed(3)}`);
    }
  }
  return size;
}

export async function measureSchedulerMemory(
  context: BenchContext,
  seed: Seed,
  options: { batchSize: number; candidates: number; variants: readonly CostVariant[] },
): Promise<CostReport['schedulerMemory']> {
  const out: CostReport['schedulerMemory'] = [];
  // Each build without Node flags (V8 sizes the heap for the machine) and with the figures' heap budget.
  const flagSets = [[], SERVICE_NODE_ARGS].filter((flags, index, all) => index === 0 || flags.join(' ') !== all[0]!.join(' '));
  for (const variant of options.variants) {
    for (const nodeArgs of flagSets) {
      const memory = await runSchedulerAlone({ ...context, reaperBin: variant.bin }, seed, { batchSize: options.batchSize, candidates: options.candidates, nodeArgs });
      const label = `${variant.label}, ${nodeArgs.length > 0 ? nodeArgs.join(' ') : 'no Node flags'}`;
      out.push({ label, candidates: options.candidates, peakRssMb: memory.peakRssMb, restRssMb: memory.restRssMb });
      context.progress(`    ${label}: scheduler at ${options.candidates}: peak ${memory.peakRssMb.toFixed(1)} MB (rest ${memory.restRssMb.toFixed(1)} MB)`);
    }
  }
  return out;
}

const f = (value: number, digits = 2): string => (Number.isFinite(value) ? value.toFixed(digits) : 'n/a');

export function renderCostMarkdown(report: CostReport): string {
  const lines = [
    `# PostgreSQL cost per deleted row (${report.date}, ${report.mode} sizes, batch ${report.batchSize})`,
    '',
    `Load average at start: ${report.loadAverageAtStart.map((value) => value.toFixed(2)).join(' ')} (2 cores shared with other agents: absolute figures are noisy, ratios within a round less so).`,
    'PostgreSQL backend CPU seconds per 100k deleted rows, median of the rounds (every round in brackets).',
    '',
  ];
  for (const size of report.sizes) {
    const raw = median(size.raw2);
    lines.push(`## ${size.candidates.toLocaleString('en-US')} candidates`, '');
    lines.push('| contender | pg CPU s / 100k rows | ÷ raw 2 clients | rounds |', '|---|---|---|---|');
    for (const variant of size.variants) {
      lines.push(`| reaper end to end (${variant.label}) | ${f(median(variant.endToEnd))} | ${f(median(variant.endToEnd) / raw)} | ${variant.endToEnd.map((v) => f(v)).join(', ')} |`);
      lines.push(`| reaper workers alone (${variant.label}) | ${f(median(variant.workersAlone))} | ${f(median(variant.workersAlone) / raw)} | ${variant.workersAlone.map((v) => f(v)).join(', ')} |`);
      lines.push(`| reaper scheduler alone: scan + publish (${variant.label}) | ${f(median(variant.schedulerAlone))} | ${f(median(variant.schedulerAlone) / raw)} | ${variant.schedulerAlone.map((v) => f(v)).join(', ')} |`);
    }
    lines.push(`| raw DELETE, 2 clients | ${f(raw)} | 1.00 | ${size.raw2.map((v) => f(v)).join(', ')} |`);
    lines.push(`| pg-boss, batch jobs | ${f(median(size.pgbossBatch))} | ${f(median(size.pgbossBatch) / raw)} | ${size.pgbossBatch.map((v) => f(v)).join(', ')} |`);
    lines.push('');
    for (const variant of size.variants) {
      const names = [...new Set(variant.endToEndByApplication.flatMap((entry) => Object.keys(entry)))].sort();
      const split = names.map((name) => `${name} ${f(median(variant.endToEndByApplication.map((entry) => entry[name] ?? 0)))}`).join(', ');
      lines.push(`- ${variant.label}: end to end by backend (pg s/100k, median): ${split}`);
      lines.push(`- ${variant.label}: end to end ÷ pg-boss batches (pg CPU per row) ${f(median(variant.endToEnd) / median(size.pgbossBatch))}; end-to-end rows/s ${variant.endToEndRowsPerSecond.map((v) => Math.round(v)).join(', ')} (raw 2 clients ${size.raw2RowsPerSecond.map((v) => Math.round(v)).join(', ')})`);
      // Throughput, same rounds (issue 18's figure 1 and 2 targets): medians, then every round.
      const rate = (values: readonly number[]): string => `${Math.round(median(values)).toLocaleString('en-US')} (${values.map((v) => Math.round(v)).join(', ')})`;
      lines.push(
        `- ${variant.label}: rows/s, median (rounds): end to end ${rate(variant.endToEndRowsPerSecond)}, workers alone ${rate(variant.workersAloneRowsPerSecond)}, raw 2 clients ${rate(size.raw2RowsPerSecond)}, pg-boss batches ${rate(size.pgbossBatchRowsPerSecond)}; ` +
          `workers alone ÷ raw ${f(median(variant.workersAloneRowsPerSecond) / median(size.raw2RowsPerSecond))}, end to end ÷ pg-boss ${f(median(variant.endToEndRowsPerSecond) / median(size.pgbossBatchRowsPerSecond))}`,
      );
      // Where an end-to-end run's seconds go besides the drain: a fixed part weighs more in a small run.
      if (variant.endToEndStartup.length > 0 && variant.endToEndTail.length > 0) {
        const seconds = (values: readonly number[]): string => values.map((v) => v.toFixed(2)).join(', ');
        lines.push(
          `- ${variant.label}: end to end, seconds per round: in all ${seconds(variant.endToEndSeconds)}; of them trigger to the first batch begun ${seconds(variant.endToEndStartup)}, ` +
            `the last batch begun to completed ${seconds(variant.endToEndTail)} (its statement and the scheduler's completion pass, every 250 ms)`,
        );
      }
    }
    lines.push('');
    lines.push(...allCpuMarkdown(size));
    for (const entry of size.statements ?? []) lines.push(...statementsMarkdown(entry.contender, entry.statements, entry.deletedRows), ...relationBlocksMarkdown(entry.relations, entry.deletedRows));
  }
  if (report.schedulerMemory.length > 0) {
    lines.push('## Scheduler peak RSS (scheduler alone: scan, publish, confirm)', '', '| build | candidates | peak RSS MB | at rest MB |', '|---|---|---|---|');
    for (const entry of report.schedulerMemory) lines.push(`| ${entry.label} | ${entry.candidates.toLocaleString('en-US')} | ${f(entry.peakRssMb, 1)} | ${f(entry.restRssMb, 1)} |`);
    const labels = [...new Set(report.schedulerMemory.map((entry) => entry.label))];
    lines.push('');
    for (const label of labels) {
      const mine = report.schedulerMemory.filter((entry) => entry.label === label).sort((a, b) => a.candidates - b.candidates);
      if (mine.length >= 2) lines.push(`- ${label}: ${mine.at(-1)!.candidates.toLocaleString('en-US')} ÷ ${mine[0]!.candidates.toLocaleString('en-US')} peak RSS = ${f(mine.at(-1)!.peakRssMb / mine[0]!.peakRssMb)}`);
    }
    lines.push('');
  }
  return `${lines.join('\n')}\n`;
}

/** The whole machine's CPU per row, by where it ran (medians of the rounds). */
function allCpuMarkdown(size: CostSize): string[] {
  const rows: Array<[string, CpuPer100k[]]> = [
    ...size.variants.flatMap((variant): Array<[string, CpuPer100k[]]> => [
      [`reaper end to end (${variant.label})`, variant.endToEndAllCpu],
      [`reaper workers alone (${variant.label})`, variant.workersAloneAllCpu],
      [`reaper scheduler alone: scan + publish (${variant.label})`, variant.schedulerAloneAllCpu],
    ]),
    ['raw DELETE, 2 clients (the bench process as its client)', size.raw2AllCpu],
    ['pg-boss, batch jobs (in the bench process)', size.pgbossBatchAllCpu],
  ];
  const lines = ['All CPU seconds per 100k deleted rows, by where they ran (medians of the rounds): on this one 2-core machine their sum bounds rows/s.', '', '| contender | all | node | postgres | rabbitmq |', '|---|---|---|---|---|'];
  for (const [label, rounds] of rows) {
    const part = (pick: (cpu: CpuPer100k) => number): string => f(median(rounds.map(pick)));
    lines.push(`| ${label} | ${part((cpu) => cpu.node + cpu.postgres + cpu.rabbitmq)} | ${part((cpu) => cpu.node)} | ${part((cpu) => cpu.postgres)} | ${part((cpu) => cpu.rabbitmq)} |`);
  }
  return [...lines, ''];
}

export function writeCostReport(base: string, report: CostReport): void {
  writeFileSync(`${base}.json`, `${JSON.stringify(report, null, 2)}\n`);
  writeFileSync(`${base}.md`, renderCostMarkdown(report));
}

/**
 * The whole cost figure: each size of the mode (figure 1's), then the scheduler's memory at
 * `memoryAt` candidates (default: the first size and ten times it), seeded once at the largest.
 */
export async function runCostFigure(
  context: BenchContext,
  options: { mode: string; sizes: readonly number[]; batchSize: number; repeats: number; pgboss: Omit<PgBossOptions, 'batchSize'>; memoryAt?: readonly number[] },
): Promise<CostReport> {
  const before = process.env.BENCH_COST_BEFORE_BIN;
  const variants: CostVariant[] = [...(before ? [{ label: 'before', bin: before }] : []), { label: before ? 'after' : 'this build', bin: context.reaperBin }];
  const { loadavg } = await import('node:os');
  const report: CostReport = { date: new Date().toISOString().slice(0, 10), mode: options.mode, loadAverageAtStart: loadavg(), batchSize: options.batchSize, sizes: [], schedulerMemory: [] };
  for (const candidates of options.sizes) {
    context.progress(`cost: seeding ${candidates.toLocaleString('en-US')} candidates`);
    const seed = await context.databases.seed(candidates);
    report.sizes.push(await measureCostSize(context, seed, { batchSize: options.batchSize, repeats: options.repeats, variants, pgboss: options.pgboss }));
  }
  const memoryAt = [...(options.memoryAt ?? [options.sizes[0]!, options.sizes[0]! * 10])].sort((a, b) => a - b);
  if (memoryAt.length > 0) {
    const largest = memoryAt.at(-1)!;
    context.progress(`cost: seeding ${largest.toLocaleString('en-US')} candidates for the scheduler's memory`);
    const seed = await context.databases.seed(largest);
    for (const candidates of memoryAt) report.schedulerMemory.push(...(await measureSchedulerMemory(context, seed, { batchSize: options.batchSize, candidates, variants })));
  }
  return report;
}
