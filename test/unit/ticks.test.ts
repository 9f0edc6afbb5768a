/**
 * Unit tests for scheduled-tick arithmetic (services/scheduler/ticks.ts): the one catch-up tick a
 * scheduler computes at start-up, and second truncation.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { CRON_TIMEZONE, latestMissedTick, truncateToSecond } from '../../services/scheduler/ticks';

const at = (iso: string) => new Date(iso);
const EVERY_MINUTE = '* * * * *';
const EVERY_2_SECONDS = '*/2 * * * * *';

function assertTick(actual: Date | null, expected: string | null): void {
  assert.equal(actual === null ? null : actual.toISOString(), expected);
}

test('truncateToSecond drops milliseconds and keeps whole seconds', () => {
  assert.equal(truncateToSecond(at('2026-11-29T20:00:07.999Z')).toISOString(), '2026-11-29T20:00:07.000Z');
  assert.equal(truncateToSecond(at('2026-11-29T20:00:07.001Z')).toISOString(), '2026-11-29T20:00:07.000Z');
  assert.equal(truncateToSecond(at('2026-11-29T20:00:07.000Z')).toISOString(), '2026-11-29T20:00:07.000Z');
});

test('truncateToSecond returns a new Date and leaves its argument alone', () => {
  const input = at('2026-11-29T20:00:07.500Z');
  const output = truncateToSecond(input);
  assert.notEqual(output, input);
  assert.equal(input.toISOString(), '2026-11-29T20:00:07.500Z');
});

test('cron is evaluated in UTC', () => {
  assert.equal(CRON_TIMEZONE, 'Etc/UTC');
  assertTick(latestMissedTick('0 9 * * *', at('2026-03-01T00:00:00Z'), at('2026-03-02T08:00:00Z')), '2026-03-01T09:00:00.000Z');
});

// ---------------------------------------------------------------------------------------------
// Every minute (5 fields)
// ---------------------------------------------------------------------------------------------

test('every minute: none missed when the last tick is the latest one', () => {
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T20:05:00Z'), at('2026-11-29T20:05:59.999Z')), null);
});

test('every minute: none missed when now is before the next tick', () => {
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T20:05:00Z'), at('2026-11-29T20:05:30Z')), null);
});

test('every minute: one missed tick is found', () => {
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T20:05:00Z'), at('2026-11-29T20:06:12Z')), '2026-11-29T20:06:00.000Z');
});

test('every minute: several missed gives only the latest one', () => {
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T20:00:00Z'), at('2026-11-29T20:07:42.5Z')), '2026-11-29T20:07:00.000Z');
});

test('every minute: "after" is exclusive and "now" is inclusive', () => {
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T20:06:00Z'), at('2026-11-29T20:06:00Z')), null);
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T20:05:59.999Z'), at('2026-11-29T20:06:00Z')), '2026-11-29T20:06:00.000Z');
});

test('every minute: "after" in the future of "now" finds nothing', () => {
  assertTick(latestMissedTick(EVERY_MINUTE, at('2026-11-29T21:00:00Z'), at('2026-11-29T20:06:00Z')), null);
});

test('a sparse 5-field schedule: the latest matching minute, not just the latest minute', () => {
  assertTick(latestMissedTick('*/5 * * * *', at('2026-11-29T19:00:00Z'), at('2026-11-29T20:14:59Z')), '2026-11-29T20:10:00.000Z');
  assertTick(latestMissedTick('0 0 * * *', at('2026-11-01T00:00:00Z'), at('2026-11-29T20:00:00Z')), '2026-11-29T00:00:00.000Z');
});

// ---------------------------------------------------------------------------------------------
// Every 2 seconds (6 fields, seconds first)
// ---------------------------------------------------------------------------------------------

test('every 2 seconds: none missed', () => {
  assertTick(latestMissedTick(EVERY_2_SECONDS, at('2026-11-29T20:00:06Z'), at('2026-11-29T20:00:07.900Z')), null);
});

test('every 2 seconds: one missed tick is found', () => {
  assertTick(latestMissedTick(EVERY_2_SECONDS, at('2026-11-29T20:00:06Z'), at('2026-11-29T20:00:08.100Z')), '2026-11-29T20:00:08.000Z');
});

test('every 2 seconds: several missed gives only the latest even second', () => {
  assertTick(latestMissedTick(EVERY_2_SECONDS, at('2026-11-29T20:00:00Z'), at('2026-11-29T20:00:17.500Z')), '2026-11-29T20:00:16.000Z');
  assertTick(latestMissedTick(EVERY_2_SECONDS, at('2026-11-29T19:00:00Z'), at('2026-11-29T20:00:00Z')), '2026-11-29T20:00:00.000Z');
});

test('every 2 seconds: a missed tick in the previous minute is found across the minute boundary', () => {
  assertTick(latestMissedTick(EVERY_2_SECONDS, at('2026-11-29T20:00:57Z'), at('2026-11-29T20:01:00.000Z')), '2026-11-29T20:01:00.000Z');
  assertTick(latestMissedTick(EVERY_2_SECONDS, at('2026-11-29T20:00:57Z'), at('2026-11-29T20:00:59.999Z')), '2026-11-29T20:00:58.000Z');
});

// ---------------------------------------------------------------------------------------------
// Lookback limits: 31 days for 5 fields, 1 day for 6 fields
// ---------------------------------------------------------------------------------------------

test('5 fields: a tick exactly 31 days back is found; one just beyond is not', () => {
  // May 1st only; May has 31 days, so June 1st 00:00 is exactly 31 days later.
  const mayFirst = '0 0 1 5 *';
  assertTick(latestMissedTick(mayFirst, at('2020-01-01T00:00:00Z'), at('2026-06-01T00:00:00Z')), '2026-05-01T00:00:00.000Z');
  assertTick(latestMissedTick(mayFirst, at('2020-01-01T00:00:00Z'), at('2026-06-01T00:01:00Z')), null);
});

test('5 fields: a yearly schedule missed for months finds nothing within the lookback', () => {
  assertTick(latestMissedTick('0 0 1 1 *', at('2020-01-01T00:00:00Z'), at('2026-06-15T00:00:00Z')), null);
});

test('6 fields: a tick exactly one day back is found; one just beyond is not', () => {
  const dailyMidnight = '0 0 0 * * *';
  assertTick(latestMissedTick(dailyMidnight, at('2020-01-01T00:00:00Z'), at('2026-11-29T23:59:59Z')), '2026-11-29T00:00:00.000Z');
  const monthly = '0 0 0 1 * *';
  assertTick(latestMissedTick(monthly, at('2020-01-01T00:00:00Z'), at('2026-11-02T00:00:00Z')), '2026-11-01T00:00:00.000Z');
  assertTick(latestMissedTick(monthly, at('2020-01-01T00:00:00Z'), at('2026-11-02T00:00:01Z')), null);
});

test('the lookback is bounded in time too: a long gap is computed quickly', () => {
  // CPU time of this process, not wall time: on a loaded 2-core machine the wall clock measures the
  // other processes too (a 1.2 s computation was seen to take 6 s of wall time at load 20).
  const started = process.cpuUsage();
  assertTick(latestMissedTick('0 0 1 1 *', at('2000-01-01T00:00:00Z'), at('2026-06-15T00:00:00Z')), null);
  assertTick(latestMissedTick('0 0 0 1 1 *', at('2000-01-01T00:00:00Z'), at('2026-06-15T00:00:00Z')), null);
  const used = process.cpuUsage(started);
  const cpuMs = (used.user + used.system) / 1000;
  assert.ok(cpuMs < 5000, `took ${cpuMs} ms of CPU`);
});
