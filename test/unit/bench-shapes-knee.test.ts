/**
 * Unit tests for figure 7b's knee (bench/figures/shapes.ts, issue 41): the highest rate whose
 * foreground p99 ÷ alone is at most 1.25, unthrottled counted at the rate it reached, a lower rate
 * over the line marked, and the adaptive contender's rate and p99 against it.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { summarise, type ShapeContender, type ShapeWindow } from '../../bench/figures/shapes';

const latency = { transactions: 100, p50Ms: 1, p99Ms: 2, maxMs: 3, renewalMaxMs: 3 };

function window(p99Ratio: number, rowsPerSecond: number): ShapeWindow {
  return { fromSeconds: 0, toSeconds: 4, rows: rowsPerSecond * 4, rowsPerSecond, foreground: latency, p99Ratio, p99RatioJustBefore: p99Ratio };
}

function contender(kind: ShapeContender['kind'], rate: number | null, p99Ratio: number, achieved: number): ShapeContender {
  const w = window(p99Ratio, achieved);
  return { kind, rowsPerSecond: rate, policy: 'p', runRows: 1, aloneJustBefore: latency, short: w, long: w, firstRowSeconds: 0.1, finishedInWindow: false, finishedOffRows: 0, deletedSeries: [], adaptiveRate: null };
}

function ladder(ratios: number[], unthrottled: number, adaptive: { ratio: number; rate: number }): ShapeContender[] {
  const rates = [500, 1000, 2000, 4000, 8000, 16000];
  return [
    ...rates.map((rate, i) => contender('fixed', rate, ratios[i]!, rate)),
    contender('unthrottled', null, unthrottled, 40000),
    contender('adaptive', null, adaptive.ratio, adaptive.rate),
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
