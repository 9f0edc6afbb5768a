import { prng } from '../../test/support/prng';

/**
 * Bootstrap confidence intervals of a ratio of two high quantiles (figure 7b, issue 41: the
 * foreground's p99 during a cleanup ÷ its p99 alone). A window of a few seconds holds 100–10,000
 * transactions, so its p99 rests on 1–100 of them: the ratio's noise decides whether it is over
 * 1.25, and the interval says how far it can be trusted.
 *
 * Resampling keeps the order the transactions ended in and draws blocks of consecutive ones
 * (circular block bootstrap): under pgbench -R one stall delays every transaction scheduled while
 * it lasts, so slow transactions come in runs, and drawing them one by one would read a window with
 * one stall as if its slow transactions were independent (too narrow an interval). Both samples are
 * resampled independently; the interval is the percentile interval of the resampled ratios.
 *
 * What a resample inside one window cannot see: noise slower than a window (the machine's other
 * load changing between an alone window and the next). On figure 7b's 2-core machine it dominates
 * (2026-12-06: each alone window's interval against the other alone windows held 1 in about half
 * the windows, not 90%), so ratioInterval can fold in the ratios the alone windows read against
 * each other (`windowNoise`).
 */

/** The index of the q-quantile in n sorted values (the nearest-rank rule every bench percentile uses). */
export function quantileRank(n: number, q: number): number {
  return Math.min(n - 1, Math.max(0, Math.ceil(q * n) - 1));
}

export interface BootstrapOptions {
  /** Resamples drawn (each sample's quantile this many times). */
  resamples: number;
  /** The quantile compared (0.99 for p99). */
  quantile: number;
  /** The seed of the PRNG: the same samples and seed give the same interval. */
  seed: number;
}

export interface RatioInterval {
  /** The interval's coverage (0.9: the 5th to the 95th percentile of the resampled ratios). */
  level: number;
  low: number;
  high: number;
}

/**
 * `resamples` values of the quantile of a block resample of `values` (in the order they were
 * observed). Each resample has as many values as `values`, drawn as runs of `blockLength`
 * consecutive ones from uniform starts (wrapping around the end); the last run is cut to fit.
 * Empty `values`: an empty array.
 *
 * Cost: O(resamples × n), no sort per resample: the values are sorted once, each resample counts
 * how often each sorted position is drawn, and its quantile is found by walking those counts down
 * from the top (the high quantile is near it).
 */
export function bootstrapQuantiles(values: readonly number[], blockLength: number, options: BootstrapOptions): Float64Array {
  const n = values.length;
  const out = new Float64Array(n === 0 ? 0 : options.resamples);
  if (n === 0) return out;
  const order = values.map((_, i) => i).sort((a, b) => values[a]! - values[b]! || a - b);
  const sorted = Float64Array.from(order, (i) => values[i]!);
  // rankOf[i]: the position in `sorted` of the i-th value observed.
  const rankOf = new Int32Array(n);
  order.forEach((observed, rank) => (rankOf[observed] = rank));
  const block = Math.max(1, Math.min(n, Math.floor(blockLength)));
  // The resample's quantile is its (n - rank)-th largest value.
  const fromTop = n - quantileRank(n, options.quantile);
  const counts = new Int32Array(n);
  const random = prng(options.seed);
  for (let b = 0; b < options.resamples; b++) {
    counts.fill(0);
    for (let drawn = 0; drawn < n; ) {
      const start = Math.floor(random() * n);
      const take = Math.min(block, n - drawn);
      for (let k = 0; k < take; k++) counts[rankOf[(start + k) % n]!]!++;
      drawn += take;
    }
    let seen = 0;
    let j = n - 1;
    for (; j > 0; j--) {
      seen += counts[j]!;
      if (seen >= fromTop) break;
    }
    out[b] = sorted[j]!;
  }
  return out;
}

/**
 * The percentile interval of numerator ÷ denominator from two independent sets of resampled
 * quantiles (the b-th of each paired; their lengths must match). Null when either is empty or a
 * resampled denominator is 0 (no ratio to bound).
 *
 * `windowNoise` (optional): ratios that the same measurement read where the truth is 1 (each alone
 * window's p99 ÷ the other alone windows'); each resampled ratio is divided by one of them drawn at
 * random (`seed`), so the interval also holds the noise between one window and the next, which a
 * resample inside one window cannot see.
 */
export function ratioInterval(numerator: Float64Array, denominator: Float64Array, level: number, windowNoise?: { ratios: readonly number[]; seed: number }): RatioInterval | null {
  if (numerator.length === 0 || denominator.length === 0) return null;
  if (numerator.length !== denominator.length) throw new Error(`ratioInterval: ${numerator.length} resamples against ${denominator.length}`);
  const noise = windowNoise?.ratios.filter((r) => Number.isFinite(r) && r > 0) ?? [];
  const random = prng(windowNoise?.seed ?? 0);
  const ratios = new Float64Array(numerator.length);
  for (let b = 0; b < ratios.length; b++) {
    if (!(denominator[b]! > 0)) return null;
    ratios[b] = numerator[b]! / denominator[b]! / (noise.length > 0 ? noise[Math.floor(random() * noise.length)]! : 1);
  }
  ratios.sort();
  const tail = (1 - level) / 2;
  const last = ratios.length - 1;
  return { level, low: ratios[Math.floor(tail * last)]!, high: ratios[Math.ceil((1 - tail) * last)]! };
}

/** Transactions per block for a sample of `n` observed over `windowMs`: as many as end in `blockMs` (at least 1). */
export function blockLengthFor(n: number, windowMs: number, blockMs: number): number {
  return windowMs > 0 ? Math.max(1, Math.round((n * blockMs) / windowMs)) : 1;
}

export type Verdict = 'under' | 'over' | 'cannot tell';

/** Over the line only when the whole interval is above it, under only when the whole interval is at or below it. */
export function verdictOf(interval: RatioInterval | null, line: number): Verdict {
  if (interval === null) return 'cannot tell';
  if (interval.low > line) return 'over';
  if (interval.high <= line) return 'under';
  return 'cannot tell';
}
