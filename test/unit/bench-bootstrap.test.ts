/**
 * Unit tests for the bootstrap intervals of figure 7b's p99 ratios (bench/lib/bootstrap.ts, issue
 * 41): an interval must hold the truth where the truth is known (two samples of one distribution:
 * ratio 1), must stand clear of the line where the difference is plain (a foreground twice as slow),
 * must widen when slow transactions come in runs (a stall), and must be reproducible from its seed.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { blockLengthFor, bootstrapQuantiles, quantileRank, ratioInterval, verdictOf, type BootstrapOptions } from '../../bench/lib/bootstrap';
import { percentile } from '../../bench/figures/foreground';
import { prng } from '../support/prng';

const OPTIONS: BootstrapOptions = { resamples: 1000, quantile: 0.99, seed: 1 };

/** n latencies (ms) of a log-normal with median 1 ms and log spread 1.07 (figure 7b's pgbench alone), times `scale`. */
function latencies(n: number, seed: number, scale = 1): number[] {
  const random = prng(seed);
  return Array.from({ length: n }, () => {
    const normal = Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random());
    return scale * Math.exp(1.07 * normal);
  });
}

function p99(values: readonly number[]): number {
  return percentile([...values].sort((a, b) => a - b), 0.99);
}

test('one block as long as the sample resamples a rotation of it: every resampled p99 is the sample p99', () => {
  const values = latencies(537, 3);
  const resampled = bootstrapQuantiles(values, values.length, OPTIONS);
  assert.equal(resampled.length, OPTIONS.resamples);
  assert.ok(resampled.every((value) => value === p99(values)));
  assert.equal(quantileRank(100, 0.99), 98);
  assert.equal(quantileRank(60, 0.99), 59, 'p99 of 60 transactions is the slowest');
});

test('two samples of the same distribution: the 90% interval holds 1, in about 90% of pairs', () => {
  const pairs = 60;
  let holding = 0;
  for (let pair = 0; pair < pairs; pair++) {
    // 500 resamples here (1,000 in the bench) keep the 60 pairs to a few seconds.
    const during = bootstrapQuantiles(latencies(1000, 1000 + pair), 1, { ...OPTIONS, resamples: 500, seed: 2 * pair });
    const alone = bootstrapQuantiles(latencies(3000, 5000 + pair), 1, { ...OPTIONS, resamples: 500, seed: 2 * pair + 1 });
    const interval = ratioInterval(during, alone, 0.9)!;
    if (interval.low <= 1 && 1 <= interval.high) holding++;
  }
  // 90% of 60 is 54; a binomial's 99.9% band reaches down to 46.
  assert.ok(holding >= 46, `${holding} of ${pairs} intervals held the true ratio 1`);
  assert.ok(holding <= 59, `${holding} of ${pairs}: intervals that always hold 1 are too wide to tell anything`);
  const first = ratioInterval(bootstrapQuantiles(latencies(1500, 1000), 1, { ...OPTIONS, seed: 0 }), bootstrapQuantiles(latencies(4000, 5000), 1, { ...OPTIONS, seed: 1 }), 0.9)!;
  assert.ok(first.low <= 1 && 1 <= first.high, `first pair: ${first.low.toFixed(2)}–${first.high.toFixed(2)}`);
  assert.equal(verdictOf(first, 1.25) === 'over', false);
});

test('a foreground twice as slow: the interval lies above 1.25, over the line', () => {
  const during = bootstrapQuantiles(latencies(1500, 11, 2), blockLengthFor(1500, 5000, 100), { ...OPTIONS, seed: 7 });
  const alone = bootstrapQuantiles(latencies(4000, 12), blockLengthFor(4000, 18000, 100), { ...OPTIONS, seed: 8 });
  const interval = ratioInterval(during, alone, 0.9)!;
  assert.ok(interval.low > 1.25, `${interval.low.toFixed(2)}–${interval.high.toFixed(2)}`);
  assert.equal(verdictOf(interval, 1.25), 'over');
  assert.equal(verdictOf({ level: 0.9, low: 0.8, high: 1.2 }, 1.25), 'under');
  assert.equal(verdictOf({ level: 0.9, low: 1.1, high: 1.4 }, 1.25), 'cannot tell');
  assert.equal(verdictOf(null, 1.25), 'cannot tell');
});

test('slow transactions in one run (a stall) widen the interval when resampled in blocks', () => {
  // 2,000 transactions, the 25 slowest all in one run: a stall, not 25 independent slow ones.
  const values = latencies(2000, 21).sort((a, b) => a - b);
  const slow = values.splice(values.length - 25, 25);
  const random = prng(22);
  for (let i = values.length - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [values[i], values[j]] = [values[j]!, values[i]!];
  }
  values.splice(1000, 0, ...slow);
  const alone = bootstrapQuantiles(latencies(8000, 23), 1, { ...OPTIONS, seed: 9 });
  const width = (block: number): number => {
    const interval = ratioInterval(bootstrapQuantiles(values, block, { ...OPTIONS, seed: 10 }), alone, 0.9)!;
    return interval.high / interval.low;
  };
  assert.ok(width(40) > 1.5 * width(1), `blocks of 40: ${width(40).toFixed(2)}, one by one: ${width(1).toFixed(2)}`);
  assert.equal(blockLengthFor(2000, 4000, 100), 50);
  assert.equal(blockLengthFor(120, 4000, 100), 3);
  assert.equal(blockLengthFor(5, 4000, 100), 1);
});

test('the same samples and seed give the same interval; an empty sample gives none', () => {
  const values = latencies(3000, 31);
  assert.deepEqual(bootstrapQuantiles(values, 5, OPTIONS), bootstrapQuantiles(values, 5, OPTIONS));
  assert.notDeepEqual(bootstrapQuantiles(values, 5, OPTIONS), bootstrapQuantiles(values, 5, { ...OPTIONS, seed: 2 }));
  assert.equal(bootstrapQuantiles([], 1, OPTIONS).length, 0);
  assert.equal(ratioInterval(new Float64Array(0), bootstrapQuantiles(values, 1, OPTIONS), 0.9), null);
});

test('the noise between windows widens the interval by what the alone windows read against each other', () => {
  const during = bootstrapQuantiles(latencies(1500, 41, 2), 1, { ...OPTIONS, seed: 11 });
  const alone = bootstrapQuantiles(latencies(6000, 42), 1, { ...OPTIONS, seed: 12 });
  const sampling = ratioInterval(during, alone, 0.9)!;
  assert.equal(verdictOf(sampling, 1.25), 'over', `sampling only: ${sampling.low.toFixed(2)}–${sampling.high.toFixed(2)}`);
  // Alone windows that read 1 against each other add nothing.
  assert.deepEqual(ratioInterval(during, alone, 0.9, { ratios: [1, 1, 1], seed: 13 }), sampling);
  // Alone windows that read 0.6–2.2 against each other: a ratio of 2 may be one of them.
  const withNoise = ratioInterval(during, alone, 0.9, { ratios: [0.6, 0.8, 1, 1.1, 1.3, 1.8, 2.2], seed: 13 })!;
  assert.ok(withNoise.low < 1.25 && withNoise.high > sampling.high, `with the noise: ${withNoise.low.toFixed(2)}–${withNoise.high.toFixed(2)}`);
  assert.equal(verdictOf(withNoise, 1.25), 'cannot tell');
});
