import type { BenchBroker } from './broker';
import type { CpuSplit } from './cpu';
import type { BenchDatabases, RowCounts, Seed } from './database';
import type { ReaperEnvironment } from './services';

/** What every figure needs: the bench's database and broker, where to write, and the count checks it adds to. */
export interface BenchContext {
  databases: BenchDatabases;
  broker: BenchBroker;
  amqpUrl: string;
  /** Policies files and profiles go here. */
  workDir: string;
  /** Longest any one measured contender may run; past it the figure is reported as bounded. */
  boundMs: number;
  checks: CountCheck[];
  progress(text: string): void;
  /** Smoke mode: a contender stopped by the time bound is a failure (its counts could not be checked). */
  requireFinished: boolean;
  /** Another build's bin/reaper to measure instead of this one (default: this build, or BENCH_REAPER_BIN). */
  reaperBin?: string;
}

export function reaperEnvironment(context: BenchContext, policiesPath: string): ReaperEnvironment {
  return { databaseUrl: context.databases.url, amqpUrl: context.amqpUrl, prefix: context.broker.prefix, policiesPath, bin: context.reaperBin };
}

export interface Throughput {
  rows: number;
  seconds: number;
  rowsPerSecond: number;
  /** True when the time bound stopped it: rows/s is over the rows done by then. */
  bounded: boolean;
}

/** A throughput with the CPU it took (see cpu.ts). */
export interface Measured extends Throughput {
  cpu: CpuSplit;
}

export function throughput(rows: number, seconds: number, bounded = false): Throughput {
  return { rows, seconds, rowsPerSecond: seconds > 0 ? rows / seconds : 0, bounded };
}

/** One count the benchmark verified. Counts are asserted (smoke exits non-zero); speed never is. */
export interface CountCheck {
  figure: string;
  what: string;
  expected: number;
  actual: number;
  ok: boolean;
}

export function check(context: BenchContext, figure: string, what: string, expected: number, actual: number): void {
  const ok = expected === actual;
  context.checks.push({ figure, what, expected, actual, ok });
  if (!ok) context.progress(`COUNT CHECK FAILED: ${figure}: ${what}: expected ${expected}, got ${actual}`);
}

/**
 * Counts can only be checked on a run that finished. Returns whether it did; an unfinished run is
 * a failed check where the mode requires every run to finish (smoke), a note otherwise.
 */
export function checkFinished(context: BenchContext, figure: string, finished: boolean): boolean {
  if (finished) return true;
  if (context.requireFinished) check(context, figure, 'finished within the time bound', 1, 0);
  else context.progress(`${figure}: stopped at the time bound; its counts were not checked`);
  return false;
}

/**
 * After a contender deleted the first `deleted` candidates: exactly those are gone, and every row
 * that was not a candidate (held until 2999, or expired but confirmed) is still there.
 */
export function checkSeatRows(context: BenchContext, figure: string, seed: Seed, deleted: number, counts: RowCounts): void {
  check(context, figure, 'expired held rows left', seed.candidates - deleted, counts.expiredHeldLeft);
  check(context, figure, 'future held rows kept', seed.futureHeld, counts.futureHeldLeft);
  check(context, figure, 'expired confirmed rows kept', seed.expiredConfirmed, counts.expiredConfirmedLeft);
}
