/**
 * Unit tests for figure 7b's knee (bench/figures/shapes.ts, issue 41): the highest rate whose
 * foreground p99 ÷ alone is at most 1.25, unthrottled counted at the rate it reached, a lower rate
 * over the line marked, and the adaptive contender's rate and p99 against it; with the bootstrap
 * intervals, the knee range (highest rate surely under, lowest surely over) and the verdicts met /
 * missed / cannot tell.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { latencyOf } from '../../bench/figures/foreground';
import { deletingUntil, noiseGroups, reportedWindows, shapeRowsNeeded, summarise, withRounds, type ShapeContender, type ShapesOptions, type ShapeWindow } from '../../bench/figures/shapes';

const latency = { transactions: 100, p50Ms: 1, p99Ms: 2, maxMs: 3, renewalMaxMs: 3 };

/** A window whose ratio's interval is ratio × [1 - spread, 1 + spread]. */
function window(p99Ratio: number, rowsPerSecond: number, spread: number): ShapeWindow {
  const p99RatioInterval = { level: 0.9, low: p99Ratio * (1 - spread), high: p99Ratio * (1 + spread) };
  return { rounds: 1, transactions: 1200, fromSeconds: 0, toSeconds: 4, rows: rowsPerSecond * 4, rowsPerSecond, foreground: latency, p99Ratio, p99RatioJustBefore: p99Ratio, p99RatioInterval, p99RatioNoiseInterval: p99RatioInterval, p99Verdict: 'cannot tell', p99VerdictSamplingOnly: 'cannot tell' };
}

function contender(kind: ShapeContender['kind'], rate: number | null, p99Ratio: number, achieved: number, spread = 0.01): ShapeContender {
  const w = window(p99Ratio, achieved, spread);
  return { kind, rowsPerSecond: rate, policy: 'p', runRows: 1, aloneJustBefore: latency, short: w, long: w, firstRowSeconds: 0.1, finishedInWindow: false, finishedOffRows: 0, deletedSeries: [], adaptiveRate: null, p99RatioBySecond: [], startCost: null };
}

/** Fixed rates 500 … 16k at `ratios`, unthrottled at 40k; each interval ± `spreads[i]` (1% unless given; the last two: unthrottled, adaptive). */
function ladder(ratios: number[], unthrottled: number, adaptive: { ratio: number; rate: number }, spreads: number[] = []): ShapeContender[] {
  const rates = [500, 1000, 2000, 4000, 8000, 16000];
  return [
    ...rates.map((rate, i) => contender('fixed', rate, ratios[i]!, rate, spreads[i])),
    contender('unthrottled', null, unthrottled, 40000, spreads[6]),
    contender('adaptive', null, adaptive.ratio, adaptive.rate, spreads[7]),
  ];
}

test('the knee is the highest fixed rate at or under the line, a lower rate over it marked', () => {
  const summary = summarise(ladder([1.0, 1.1, 1.3, 1.2, 2.0, 3.0], 4.0, { ratio: 1.1, rate: 2000 }), 'short', 1.25);
  assert.equal(summary.knee, 4000);
  assert.equal(summary.kneeIsUnthrottled, false);
  assert.equal(summary.nonMonotone, true);
  assert.equal(summary.adaptiveOverKnee, 0.5);
  assert.equal(summary.adaptiveP99Ratio, 1.1);
  assert.equal(summary.adaptiveOverUnthrottled, 0.05);
});

test('unthrottled under the line is the knee, at the rate it reached', () => {
  const summary = summarise(ladder([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1.25, { ratio: 1.0, rate: 36000 }), 'long', 1.25);
  assert.equal(summary.knee, 40000);
  assert.equal(summary.kneeIsUnthrottled, true);
  assert.equal(summary.nonMonotone, false);
  assert.equal(summary.adaptiveOverKnee, 0.9);
});

test('no rate under the line: no knee', () => {
  const summary = summarise(ladder([1.3, 1.4, 2, 2, 2, 2], 3, { ratio: 1.0, rate: 500 }), 'short', 1.25);
  assert.equal(summary.knee, null);
  assert.equal(summary.adaptiveOverKnee, null);
  assert.equal(summary.nonMonotone, false);
});

test('with the intervals: the knee range, and cannot tell where an interval straddles the line', () => {
  // 500 and 1k surely under; 2k reads 1.3 but its interval (0.98–1.62) holds 1.25; 4k surely over (1.6–2.4).
  const summary = summarise(ladder([1.0, 1.1, 1.3, 2.0, 2.5, 3.0], 4.0, { ratio: 1.33, rate: 1000 }, [0.05, 0.05, 0.25, 0.2, 0.05, 0.05, 0.05, 0.3]), 'short', 1.25);
  assert.equal(summary.knee, 1000);
  assert.deepEqual(summary.kneeRange, { surelyUnder: 1000, surelyUnderIsUnthrottled: false, surelyOver: 4000, surelyOverIsUnthrottled: false });
  assert.equal(summary.adaptiveP99Verdict, 'cannot tell', 'a p99 ratio of 1.33 whose interval reaches 0.93 is not a miss');
  // The knee is 1k or 2k: 1,000 rows/s is 0.5 × 2k and 1 × 1k.
  assert.equal(summary.adaptiveRateVerdict, 'cannot tell');
});

test('with the intervals: met and missed when the intervals are clear of the line', () => {
  const over = summarise(ladder([1.0, 1.1, 1.3, 2.0, 2.5, 3.0], 4.0, { ratio: 1.6, rate: 1500 }, [0.05, 0.05, 0.01]), 'long', 1.25);
  assert.equal(over.adaptiveP99Verdict, 'missed');
  assert.equal(over.adaptiveP99Interval!.low > 1.25, true);
  assert.deepEqual(over.kneeRange, { surelyUnder: 1000, surelyUnderIsUnthrottled: false, surelyOver: 2000, surelyOverIsUnthrottled: false });
  assert.equal(over.adaptiveRateVerdict, 'met', 'the knee is at most 1k: 1,500 rows/s is over 0.7 × it');
  const under = summarise(ladder([1.0, 1.1, 1.2, 2.0, 2.5, 3.0], 4.0, { ratio: 1.0, rate: 500 }), 'long', 1.25);
  assert.equal(under.adaptiveP99Verdict, 'met');
  assert.equal(under.adaptiveRateVerdict, 'missed', 'the knee is at least 2k: 500 rows/s is under 0.7 × it');
});

test('with the intervals: the lowest rate surely over leaves no knee; nothing surely over lets unthrottled be the knee', () => {
  const none = summarise(ladder([1.6, 2, 2, 2, 2, 2], 3, { ratio: 1.0, rate: 500 }), 'short', 1.25);
  assert.equal(none.adaptiveRateVerdict, 'no knee');
  assert.equal(none.kneeRange.surelyOver, 500);
  const open = summarise(ladder([1.0, 1.0, 1.0, 1.0, 1.2, 1.2], 1.3, { ratio: 1.0, rate: 20000 }, [0.01, 0.01, 0.01, 0.01, 0.1, 0.1, 0.1]), 'short', 1.25);
  assert.deepEqual(open.kneeRange, { surelyUnder: 4000, surelyUnderIsUnthrottled: false, surelyOver: null, surelyOverIsUnthrottled: false });
  // The knee may be unthrottled at 40k: 20,000 is under 0.8 × 40k, and over 0.7 × 4k.
  assert.equal(open.adaptiveRateVerdict, 'cannot tell');
});

test('the fields read the intervals with the noise between windows, samplingOnly the narrower ones: a swap of the two would change every verdict here', () => {
  // Sampling-only ± 1 %: decisive everywhere. With the window noise ± 60 %: decisive nowhere.
  const contenders = ladder([1.0, 1.1, 1.2, 2.0, 3.0, 4.0], 6.0, { ratio: 3.0, rate: 20000 }).map((one) => {
    const noisy = (w: ShapeWindow): ShapeWindow => ({ ...w, p99RatioNoiseInterval: { level: 0.9, low: w.p99Ratio * 0.4, high: w.p99Ratio * 1.6 } });
    return { ...one, short: noisy(one.short), long: noisy(one.long) };
  });
  const summary = summarise(contenders, 'short', 1.25);
  assert.deepEqual(summary.samplingOnly.kneeRange, { surelyUnder: 2000, surelyUnderIsUnthrottled: false, surelyOver: 4000, surelyOverIsUnthrottled: false });
  assert.equal(summary.samplingOnly.adaptiveP99Verdict, 'missed');
  assert.equal(summary.kneeRange.surelyUnder, null, 'with the noise no rate is surely under');
  assert.equal(summary.adaptiveP99Verdict, 'cannot tell');
  assert.ok(summary.adaptiveP99Interval!.low < 1.25 && summary.adaptiveP99Interval!.high > 1.25, 'the fields carry the noise interval');
});

test('rounds: a window reads the rate while its rows were deleted, not over the 1 s it lasts at least', () => {
  // A 15k-row run deleting 9,500 by 418 ms and the rest by 620 ms, in a window of [0, 1000] ms.
  const series = [{ at: 6, deleted: 0 }, { at: 309, deleted: 0 }, { at: 418, deleted: 9_500 }, { at: 519, deleted: 14_000 }, { at: 620, deleted: 15_000 }, { at: 721, deleted: 15_000 }, { at: 1000, deleted: 15_000 }];
  assert.equal(deletingUntil(series, 0, 1000), 620, 'the first sample with the final count');
  // A window whose rows were still being deleted at its end, and one in which nothing was deleted.
  assert.equal(deletingUntil(series, 0, 519), 519);
  assert.equal(deletingUntil(series, 620, 1000), 1000);
});

test("rounds: the noise between windows compares each slot's alone windows pooled; one round, each window alone", () => {
  const windows = [
    { slot: 'control', window: 'c1' }, { slot: 'fixed-500', window: 'f1' }, { slot: 'adaptive', window: 'a1' },
    { slot: 'control', window: 'c2' }, { slot: 'adaptive', window: 'a2' }, { slot: 'fixed-500', window: 'f2' },
  ];
  assert.deepEqual(noiseGroups(windows, 2), [['c1', 'c2'], ['f1', 'f2'], ['a1', 'a2']]);
  assert.deepEqual(noiseGroups(windows.slice(0, 3), 1), [['c1'], ['f1'], ['a1']]);
});

test("rounds: every run takes the short window's rows, in each round; one round keeps the mode's run sizes", () => {
  const quick: ShapesOptions = { candidates: 570_000, batchSize: 500, rates: [500, 16_000], aloneSeconds: 2, shortRows: 15_000, shortSeconds: 4, longFromSeconds: 3, longSeconds: 5, maxRunRows: 150_000, adaptiveRows: 100_000, kneeRatio: 1.25 };
  // Four contenders (two fixed, unthrottled, adaptive), 15k rows each, three times.
  assert.equal(shapeRowsNeeded(withRounds(quick, 3)), 3 * 4 * 15_000);
  // One round: 500 rows/s takes its 15k floor, 16k its cap of 150k, unthrottled 150k, adaptive 100k.
  assert.equal(shapeRowsNeeded(withRounds(quick, 1)), 15_000 + 150_000 + 150_000 + 100_000);
  assert.deepEqual(reportedWindows(withRounds(quick, 3)), ['short'], 'short cleanups over rounds: the long window is a finished run\'s tail');
  assert.deepEqual(reportedWindows(withRounds(quick, 1)), ['short', 'long']);
});

test('rounds of long cleanups (BENCH_SHAPES_LONG): each fixed-rate run sized for the long window of that many seconds (the adaptive and unthrottled runs keep the mode\'s sizes: 100k and 150k rows in quick), in each round; both windows reported', () => {
  const quick: ShapesOptions = { candidates: 570_000, batchSize: 500, rates: [500, 8_000], aloneSeconds: 2, shortRows: 15_000, shortSeconds: 4, longFromSeconds: 3, longSeconds: 5, maxRunRows: 150_000, adaptiveRows: 100_000, kneeRatio: 1.25 };
  const long = withRounds(quick, 4, 10);
  assert.equal(long.longSeconds, 10);
  // 500 rows/s: 500 x 13 s x 1.25 = 8,125, so the short window's 15k; 8,000: 130,000; unthrottled 150k; adaptive 100k.
  assert.equal(shapeRowsNeeded(long), 4 * (15_000 + 130_000 + 150_000 + 100_000));
  assert.deepEqual(reportedWindows(long), ['short', 'long']);
});

test("latencyOf takes a pooled busy shape's transactions (300,000: reads at 2,000/s over 10 rounds of alone windows)", () => {
  // Script 0 is the renewal; a spread Math.max(...) over this many threw "Maximum call stack size exceeded".
  const transactions = Array.from({ length: 300_000 }, (_, i) => ({ ms: 1 + (i % 1000) / 100, script: i % 2 }));
  const latency = latencyOf(transactions);
  assert.equal(latency.transactions, 300_000);
  assert.equal(latency.renewalMaxMs, 1 + 998 / 100);
  assert.equal(latency.maxMs, 1 + 999 / 100);
});
