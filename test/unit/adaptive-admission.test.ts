/**
 * Unit tests of the adaptive row-delete admission's control law (shared/admission/adaptive.ts),
 * driven by a signal the test controls: the latency each simulated statement takes is set by the
 * test, the clock is a number the test moves. Nothing here depends on the machine's speed.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  ADAPTIVE,
  adaptiveStartRate,
  adaptRate,
  afterLook,
  afterTake,
  aloneOnDatabase,
  latencyObserve,
  loadPressureOf,
  lookDone,
  lookStartRate,
  NEW_WORKER,
  NO_LOOK,
  NO_READING,
  othersActiveObserve,
  othersObserve,
  othersLooked,
  presenceLooked,
  othersPresentObserve,
  othersWaitingObserve,
  pressureOf,
  sharedCeilingOf,
  statementRows,
  workerAlone,
  type LatencyReading,
} from '../../shared/admission/adaptive';
import type { AdaptiveRowsState } from '../../shared/db/queries/admission';
import { ConfigError } from '../../shared/config/errors';
import { parsePolicies, type RowDeletePolicy } from '../../shared/config/policies';
import { adaptiveAdmission } from '../../shared/admission/rows';

/**
 * A worker and its database in steps of ADAPTIVE.stepMs: each step the workers delete what the
 * rate allows (at most `demand` rows/s), in statements of 500 rows whose latency the test sets,
 * then one step of the rate. Returns the rate after every step.
 */
function simulate(options: { steps: number; latencyMs: (step: number, rate: number) => number; ceiling?: number | null; demand?: number; start?: { rate: number; reading: LatencyReading } }) {
  const stepSeconds = ADAPTIVE.stepMs / 1000;
  let rate = options.start?.rate ?? adaptiveStartRate(options.ceiling ?? null);
  let reading = options.start?.reading ?? NO_READING;
  let clock = 0;
  const rates: number[] = [];
  for (let step = 0; step < options.steps; step++) {
    const admitted = Math.min(rate, options.demand ?? Number.POSITIVE_INFINITY) * stepSeconds;
    const statements = Math.max(1, Math.round(admitted / 500));
    for (let i = 0; i < statements; i++) {
      clock += (stepSeconds * 1000) / statements;
      reading = latencyObserve(reading, { ms: options.latencyMs(step, rate), rows: 500, at: clock });
    }
    const next = adaptRate({ rate, pressure: pressureOf(reading), ceiling: options.ceiling ?? null, elapsedSeconds: stepSeconds, admittedRowsPerSecond: admitted / stepSeconds });
    reading = { ...reading, fresh: 0 };
    rate = next.rate;
    rates.push(rate);
  }
  return { rates, rate, reading };
}

test('at quiet-time latency the rate rises multiplicatively from a generous start, up to what the workers use', () => {
  assert.equal(adaptiveStartRate(null), ADAPTIVE.startRowsPerSecond);
  const { rates } = simulate({ steps: 20, latencyMs: () => 5, demand: 200_000 });
  assert.ok(rates[3]! > ADAPTIVE.startRowsPerSecond * 1.5, `raised within a second: ${rates.slice(0, 4).join(', ')}`);
  for (let i = 1; i < rates.length; i++) assert.ok(rates[i]! >= rates[i - 1]!, 'never lowered at baseline');
  // It does not run away from the demand: at most demandHeadroom x the rows actually admitted.
  assert.ok(rates.at(-1)! <= ADAPTIVE.demandHeadroom * 200_000, `capped near the demand: ${rates.at(-1)}`);
  assert.ok(rates.at(-1)! >= 200_000, `reached the demand: ${rates.at(-1)}`);
});

test('backs off multiplicatively when its statements slow down, and never below the floor', () => {
  const quiet = simulate({ steps: 8, latencyMs: () => 5, demand: 100_000 });
  const slow = simulate({ steps: 40, latencyMs: () => 15, demand: 100_000, start: quiet });
  assert.ok(slow.rates[0]! <= quiet.rate * ADAPTIVE.backOffFactor + 1e-9, `first slow step backs off: ${quiet.rate} -> ${slow.rates[0]}`);
  assert.ok(slow.rates[3]! <= quiet.rate * ADAPTIVE.backOffFactor ** 4 * 1.0001, `multiplicatively: ${slow.rates.slice(0, 4).join(', ')}`);
  for (let i = 1; i < slow.rates.length; i++) assert.ok(slow.rates[i]! <= slow.rates[i - 1]!, 'never raised while slow');
  assert.equal(slow.rate, ADAPTIVE.floorRowsPerSecond, 'down to the floor, not to zero');
});

test("the further the others' load is above the threshold, the bigger the back-off step (x 0.7 at the threshold, never below x 0.25); reaper's own latency alone steps x 0.7", () => {
  const step = (pressure: number, loadPressure: number | null) => adaptRate({ rate: 20_000, pressure, loadPressure, ceiling: null, elapsedSeconds: 0.25, admittedRowsPerSecond: 20_000 }).rate / 20_000;
  assert.equal(step(ADAPTIVE.backOffAbove, ADAPTIVE.backOffAbove), ADAPTIVE.backOffFactor);
  assert.ok(Math.abs(step(4, 4) - 0.35) < 1e-9, `load pressure 4: x ${step(4, 4)}`);
  assert.equal(step(50, 50), ADAPTIVE.backOffFactorLeast);
  assert.equal(step(50, 1.2), ADAPTIVE.backOffFactor, 'a slow statement of its own (latency pressure 50, little load): x 0.7');
  assert.equal(step(50, null), ADAPTIVE.backOffFactor, 'no load read yet: x 0.7');
  // A busy application (one of its statements running in every sample): from the start rate to the floor in three steps.
  let reading = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  for (let i = 0; i < 40; i++) reading = othersActiveObserve(reading, 1);
  let rate: number = ADAPTIVE.startRowsPerSecond;
  for (let i = 0; i < 3; i++) rate = adaptRate({ rate, pressure: pressureOf(reading), loadPressure: loadPressureOf(reading), ceiling: null, elapsedSeconds: 0.25, admittedRowsPerSecond: rate }).rate;
  assert.equal(rate, ADAPTIVE.floorRowsPerSecond);
});

test('recovers when its statements speed up again', () => {
  const quiet = simulate({ steps: 8, latencyMs: () => 5, demand: 100_000 });
  const slow = simulate({ steps: 20, latencyMs: () => 20, demand: 100_000, start: quiet });
  const recovered = simulate({ steps: 60, latencyMs: () => 5, demand: 100_000, start: slow });
  assert.ok(slow.rate < quiet.rate / 10, `slowed: ${slow.rate}`);
  assert.ok(recovered.rate >= quiet.rate * 0.9, `back to where it was within ${60 * ADAPTIVE.stepMs} ms: ${recovered.rate} vs ${quiet.rate}`);
});

test('a latency that follows the rate settles between the two: the rate holds where the database answers at about its quiet time', () => {
  // The database slows down once the rate passes 30,000 rows/s (latency grows with the excess).
  const latencyMs = (_step: number, rate: number): number => 5 * Math.max(1, rate / 30_000) ** 2;
  const { rates } = simulate({ steps: 200, latencyMs, demand: 1_000_000 });
  const tail = rates.slice(-80);
  assert.ok(Math.max(...tail) < 60_000 && Math.min(...tail) > 10_000, `oscillates around the knee: ${Math.min(...tail)}..${Math.max(...tail)}`);
});

test('never exceeds the configured ceiling (admission.rowsPerSecond), and starts at it when it is lower than the start rate', () => {
  assert.equal(adaptiveStartRate(3_000), 3_000);
  const { rates } = simulate({ steps: 60, latencyMs: () => 5, ceiling: 3_000, demand: 1_000_000 });
  assert.ok(rates.every((rate) => rate <= 3_000), `max ${Math.max(...rates)}`);
  assert.equal(rates.at(-1), 3_000);
  // A rate stored above a lowered ceiling is brought under it by the next step, whatever the signal.
  for (const pressure of [null, 1, 1.4, 3]) assert.ok(adaptRate({ rate: 50_000, pressure, ceiling: 3_000, elapsedSeconds: 1, admittedRowsPerSecond: 0 }).rate <= 3_000);
  // A ceiling under the floor: the ceiling wins.
  assert.equal(adaptRate({ rate: 100, pressure: 5, ceiling: 100, elapsedSeconds: 1, admittedRowsPerSecond: 0 }).rate, 100);
});

test("while others share the database the rate steps to at most the shared ceiling: reaper's transactions busy sharedBusyShare of a backend's time at their own ms per row; alone, or before a transaction, none", () => {
  assert.equal(sharedCeilingOf(NO_READING), null, 'no transaction yet: no ceiling');
  // 5 ms per 500 rows = 0.01 ms a row: busy sharedBusyShare of the time at 100,000 x that share rows/s (8,000 at 0.08).
  const expected = Math.round((ADAPTIVE.sharedBusyShare * 1000) / 0.01);
  let reading = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  assert.equal(sharedCeilingOf(reading), expected, 'others not sampled yet count as present');
  reading = othersPresentObserve(reading, true);
  const ceiling = sharedCeilingOf(reading)!;
  assert.equal(ceiling, expected);
  // A quiet application: seen in 3 % of samples, every other signal quiet.
  for (let i = 0; i < 200; i++) reading = othersPresentObserve(reading, i % 33 === 0);
  assert.ok(reading.othersPresent! >= ADAPTIVE.aloneBelow && sharedCeilingOf(reading) === expected, `a quiet application shares the database: presence ${reading.othersPresent}`);
  const raised = adaptRate({ rate: 0.75 * expected, pressure: 1, ceiling: null, sharedCeiling: ceiling, elapsedSeconds: 1, admittedRowsPerSecond: 0.75 * expected });
  assert.deepEqual(raised, { rate: expected, decision: 'raise' }, 'a raise stops at the shared ceiling');
  // A rate from a time alone (32,000) comes down to it at the next step, whatever the signal; a user's lower ceiling still wins; never under the floor.
  for (const pressure of [null, 1, 1.6]) assert.equal(adaptRate({ rate: 32_000, pressure, ceiling: null, sharedCeiling: ceiling, elapsedSeconds: 1, admittedRowsPerSecond: 0 }).rate, expected);
  assert.equal(adaptRate({ rate: 6_000, pressure: 1, ceiling: 3_000, sharedCeiling: ceiling, elapsedSeconds: 1, admittedRowsPerSecond: 0 }).rate, 3_000);
  assert.equal(adaptRate({ rate: 6_000, pressure: 1, ceiling: null, sharedCeiling: 100, elapsedSeconds: 1, admittedRowsPerSecond: 0 }).rate, ADAPTIVE.floorRowsPerSecond);
  // The quiet-time ms per row, not the latency: one transaction that waited 1.5 s for a row lock
  // leaves the ceiling where it was (with the raw latency it fell to the floor for about 25
  // transactions); a lasting change (bigger rows) is learnt as the baseline is, in minutes.
  reading = latencyObserve(reading, { ms: 1_500, rows: 500, at: 1_000 });
  assert.equal(sharedCeilingOf(reading), expected, 'a lock wait is not busy time');
  for (let i = 1; i <= 60; i++) reading = latencyObserve(reading, { ms: 10, rows: 500, at: 1_000 + i * 10_000 });
  assert.ok(Math.abs(sharedCeilingOf(reading)! - expected / 2) < expected * 0.025, `ten minutes at twice the ms per row: half the ceiling (${sharedCeilingOf(reading)})`);
  // Nobody else seen lifts it.
  for (let i = 0; i < 200; i++) reading = othersPresentObserve(reading, false);
  assert.equal(sharedCeilingOf(reading), null, `nobody else (presence ${reading.othersPresent}): alone, no ceiling`);
});

test('alone needs nobody present of late and nobody who started or ended a statement within the last second (the last sample): a quiet application between two statements is not nobody', () => {
  let reading = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  for (let i = 0; i < 200; i++) reading = othersObserve(reading, { waiting: 0, active: 0, changes: 0, present: 0, recent: 0 });
  assert.equal(aloneOnDatabase(reading), true, 'nobody: alone');
  assert.equal(sharedCeilingOf(reading), null, 'nobody: no shared ceiling');
  // An application at 30 statements/s: almost never caught in a statement, but its last one ended within the second.
  reading = othersObserve(reading, { waiting: 0, active: 0, changes: 0, present: 0, recent: 1 });
  assert.ok(reading.othersPresent! < ADAPTIVE.aloneBelow, 'the presence share alone reads nobody');
  assert.equal(aloneOnDatabase(reading), false, 'a statement within the last second: not alone');
  assert.equal(sharedCeilingOf(reading), Math.round((ADAPTIVE.sharedBusyShare * 1000) / 0.01), 'and the shared ceiling holds');
  reading = othersObserve(reading, { waiting: 0, active: 0, changes: 0, present: 0, recent: 0 });
  assert.equal(aloneOnDatabase(reading), true, 'a second with no statement: alone again');
});

test('between raise and back-off the rate holds; without a new statement it holds', () => {
  const hold = adaptRate({ rate: 10_000, pressure: (ADAPTIVE.raiseBelow + ADAPTIVE.backOffAbove) / 2, ceiling: null, elapsedSeconds: 1, admittedRowsPerSecond: 10_000 });
  assert.deepEqual(hold, { rate: 10_000, decision: 'hold' });
  assert.deepEqual(adaptRate({ rate: 10_000, pressure: null, ceiling: null, elapsedSeconds: 1, admittedRowsPerSecond: 10_000 }), { rate: 10_000, decision: 'hold' });
  const reading = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  assert.equal(pressureOf({ ...reading, fresh: 0 }), null, 'a reading already used for a step is not used again');
});

test('the baseline: a small statement is not judged against a big one; a lasting change is learnt in minutes, a short load is not', () => {
  let reading = latencyObserve(NO_READING, { ms: 50, rows: 1_000, at: 0 });
  reading = latencyObserve(reading, { ms: 2, rows: 10, at: 10 });
  assert.ok(Math.abs(reading.ratio! - 1) < 1e-9, `a first statement of another size is its own baseline: ${reading.ratio}`);
  // 3x for 10 s: still judged slow.
  let at = 10;
  for (let i = 0; i < 100; i++) reading = latencyObserve(reading, { ms: 6, rows: 10, at: (at += 100) });
  assert.ok(reading.ratio! > ADAPTIVE.backOffAbove, `a 10 s load stays a load: ${reading.ratio}`);
  // 3x for 10 minutes: the new quiet time.
  for (let i = 0; i < 6_000; i++) reading = latencyObserve(reading, { ms: 6, rows: 10, at: (at += 100) });
  assert.ok(reading.ratio! < ADAPTIVE.raiseBelow, `a lasting change is learnt: ${reading.ratio}`);
  // Faster again: the baseline follows down within a few dozen statements.
  for (let i = 0; i < 40; i++) reading = latencyObserve(reading, { ms: 2, rows: 10, at: (at += 100) });
  assert.ok(reading.baselineMs.get(3)! < 2.1, `baseline ${reading.baselineMs.get(3)}`);
});

test('other backends waiting on locks or IO add pressure: the rate backs off though its own statements are fast', () => {
  let reading = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  assert.equal(pressureOf(reading), 1);
  for (let i = 0; i < 20; i++) reading = othersWaitingObserve(reading, 2);
  assert.ok(pressureOf(reading)! >= ADAPTIVE.backOffAbove, `pressure ${pressureOf(reading)}`);
  assert.equal(adaptRate({ rate: 10_000, pressure: pressureOf(reading), ceiling: null, elapsedSeconds: 0.25, admittedRowsPerSecond: 10_000 }).decision, 'back-off');
});

test("the others' own load (their statements seen running) backs the rate off when they keep the database busy, and not when they are light", () => {
  const quiet = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  // An application keeping the database busy about half the time (one statement running in every other sample).
  let busy = quiet;
  for (let i = 0; i < 40; i++) busy = othersActiveObserve(busy, i % 2);
  assert.ok(pressureOf(busy)! >= ADAPTIVE.backOffAbove, `busy: pressure ${pressureOf(busy)}`);
  assert.equal(adaptRate({ rate: 20_000, pressure: pressureOf(busy), ceiling: null, elapsedSeconds: 0.25, admittedRowsPerSecond: 20_000 }).decision, 'back-off');
  // A light one (a statement running in one sample of fifty): reaper's own statements decide, and they are quiet.
  let light = quiet;
  for (let i = 0; i < 200; i++) light = othersActiveObserve(light, i % 50 === 0 ? 1 : 0);
  assert.ok(pressureOf(light)! <= ADAPTIVE.raiseBelow, `light: pressure ${pressureOf(light)}`);
  // The busy one goes quiet again: the pressure falls back within a few dozen samples.
  let after = busy;
  for (let i = 0; i < 30; i++) after = othersActiveObserve(after, 0);
  assert.ok(pressureOf(after)! <= ADAPTIVE.raiseBelow, `after: pressure ${pressureOf(after)}`);
});

test("reaper's own latency counts in the measure others share the database: alone it is reaper's own queueing, with an application it is load", () => {
  let slow = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  for (let i = 1; i <= 5; i++) slow = latencyObserve(slow, { ms: 20, rows: 500, at: i * 100 });
  assert.ok(pressureOf(slow)! >= ADAPTIVE.backOffAbove, 'no presence read yet: counted in full');
  let alone = slow;
  for (let i = 0; i < 50; i++) alone = othersPresentObserve(alone, false);
  assert.ok(pressureOf(alone)! <= ADAPTIVE.raiseBelow, `nobody else: pressure ${pressureOf(alone)}`);
  let shared = alone;
  // An application seen in a few samples of a hundred (about 30 statements/s) is enough to count it in full.
  for (let i = 0; i < 100; i++) shared = othersPresentObserve(shared, i % 15 === 0);
  assert.ok(pressureOf(shared)! >= ADAPTIVE.backOffAbove, `an application present: pressure ${pressureOf(shared)}`);
});

test("the start look: an application busy enough that the law would back off starts the rate at the floor; in the hold band the start is graded down from the seen start rate to the floor; a lighter one starts at the seen start rate (issue 41 item 4); nobody changes nothing; the ceiling bounds all", () => {
  // Means of the look's samples: at 300 statements/s of about 0.6 ms one running in about one sample of five.
  assert.deepEqual(lookStartRate({ waiting: 0, active: 0.2, changes: 0, present: 0, recent: 0 }, null), { rate: ADAPTIVE.floorRowsPerSecond, othersPressure: 1 + ADAPTIVE.activePressure * 0.2, busy: true });
  // Waiting on locks or IO counts too (as in the pressure).
  assert.equal(lookStartRate({ waiting: 2, active: 0, changes: 0, present: 0, recent: 0 }, null)?.rate, ADAPTIVE.floorRowsPerSecond);
  // At 30 statements/s: one in about fifty samples: gentle, not the start rate (not busy: the takes raise it from there).
  assert.deepEqual(lookStartRate({ waiting: 0, active: 0.05, changes: 0, present: 0, recent: 0 }, null), { rate: ADAPTIVE.seenStartRowsPerSecond, othersPressure: 1 + ADAPTIVE.activePressure * 0.05, busy: false });
  assert.equal(lookStartRate({ waiting: 0, active: 0, changes: 0, present: 0.025, recent: 0 }, null)?.rate, ADAPTIVE.seenStartRowsPerSecond, 'seen in a transaction only');
  assert.equal(lookStartRate({ waiting: 0, active: 0, changes: 0, present: 0, recent: 0.3 }, null)?.rate, ADAPTIVE.seenStartRowsPerSecond, 'seen only by a statement it ran within the last second');
  assert.equal(lookStartRate({ waiting: 0, active: 0, changes: 0, present: 0, recent: 0 }, null), null, 'nobody: the start rate, fast');
  assert.equal(lookStartRate({ waiting: 0, active: 0.05, changes: 0, present: 0, recent: 0 }, 1_000)?.rate, 1_000, 'a ceiling below the seen start rate');
  // The hold band: graded, not busy (the takes' own samples decide from there), lower the busier.
  const band = (pressure: number) => lookStartRate({ waiting: 0, active: (pressure - 1) / ADAPTIVE.activePressure, changes: 0, present: 0, recent: 0 }, null)!;
  assert.equal(band(ADAPTIVE.raiseBelow).rate, ADAPTIVE.seenStartRowsPerSecond, 'the band starts at the seen start rate');
  const middle = band((ADAPTIVE.raiseBelow + ADAPTIVE.backOffAbove) / 2);
  assert.equal(middle.busy, false);
  assert.equal(middle.rate, Math.round(Math.sqrt(ADAPTIVE.seenStartRowsPerSecond * ADAPTIVE.floorRowsPerSecond)), 'half way: the geometric mean');
  assert.ok(band(1.5).rate > middle.rate && middle.rate > band(1.9).rate && band(1.9).rate > ADAPTIVE.floorRowsPerSecond, 'lower the busier');
  assert.equal(lookStartRate({ waiting: 0, active: 0.5, changes: 0, present: 0, recent: 0 }, 200)?.rate, 200, 'a ceiling below the floor');
  assert.equal(lookStartRate({ waiting: 0, active: 0.1, changes: 0, present: 0, recent: 0 }, 200)?.rate, 200, 'in the band, a ceiling below the floor');
  assert.ok(lookStartRate({ waiting: 0, active: 0.1, changes: 0, present: 0, recent: 0 }, 5_000)!.rate <= 5_000, 'in the band, at most the ceiling');
  // A busy look replaces what the worker knew of the others' load (from another moment) and starts its latency ratio again; the baseline and the presence share stay.
  let before = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
  before = latencyObserve(before, { ms: 50, rows: 500, at: 100 });
  for (let i = 0; i < 20; i++) before = othersActiveObserve(othersPresentObserve(before, true), 0);
  const looked = othersLooked(before, { waiting: 0, active: 0.3, changes: 0 });
  assert.deepEqual([looked.othersActive, looked.othersWaiting, looked.ratio, looked.fresh], [0.3, 0, null, 0]);
  assert.equal(looked.othersPresent, before.othersPresent);
  // A worker whose last run ended alone: an application busy enough to back off from is there.
  let alone = NO_READING;
  for (let i = 0; i < 100; i++) alone = othersPresentObserve(alone, false);
  assert.ok(alone.othersPresent! < ADAPTIVE.aloneBelow);
  assert.equal(othersLooked(alone, { waiting: 0, active: 0.3, changes: 0 }).othersPresent, ADAPTIVE.presenceFull);
  assert.equal(looked.baselineMs, before.baselineMs);
  assert.equal(pressureOf(looked), null, 'no statement judged since the look: the first step waits for one');
  assert.equal(loadPressureOf(looked), 1 + ADAPTIVE.activePressure * 0.3, 'and then backs off from the load the look saw');
  // Every look, busy or not, counts towards the presence share: the share of its samples that saw another client.
  assert.equal(presenceLooked(NO_READING, 0.1).othersPresent, 0.1, 'a quiet look that saw an application now and then: present from the start');
  assert.equal(presenceLooked(alone, 0.1).othersPresent, 0.1, 'a worker whose last run ended alone: present again');
  assert.equal(presenceLooked(alone, 0), alone, 'a look that saw nobody changes nothing: the takes decide');
  assert.equal(presenceLooked(before, 0.01).othersPresent, before.othersPresent, 'a higher share already known stays');
});

test('a look that saw somebody (here a state change, never a client in a statement) counts them present at least presenceFull: the first take that samples nobody is not "alone", so the gentle start rate is in force', () => {
  // 40 samples, 12 of which saw a state change (an application at 30 statements/s); none caught it in a statement.
  const sums = { ...NO_LOOK, samples: 40, changes: 12 * 200 };
  const looked = afterLook(NEW_WORKER, sums, null, 0);
  assert.equal(looked.looked?.rate, ADAPTIVE.seenStartRowsPerSecond);
  assert.equal(looked.reading.othersPresent, ADAPTIVE.presenceFull);
  const state: AdaptiveRowsState = { rate: ADAPTIVE.seenStartRowsPerSecond, adaptedAt: '0', sinceStepSeconds: 0, admittedSinceStep: 0, pressure: null, othersWaiting: 0, othersActive: 0, othersPresent: 0, othersChanges: 0, othersRecent: 0, othersFinishedMs: [], sampledAt: 0 };
  const view = { ...NEW_WORKER, ...looked, looked: null, ...afterTake({ ...NEW_WORKER, ...looked }, state, 10) };
  assert.equal(workerAlone(view, { rated: false, braked: false }), false, 'not alone after one take that saw nobody');
  // A look that saw nobody: no floor, the takes decide (alone after a take that saw nobody: unthrottled).
  const quiet = afterLook(NEW_WORKER, { ...NO_LOOK, samples: ADAPTIVE.startLookQuietSamples }, null, 0);
  assert.equal(quiet.looked, null);
  assert.equal(workerAlone({ ...NEW_WORKER, ...quiet, ...afterTake({ ...NEW_WORKER, ...quiet }, state, 10) }, { rated: false, braked: false }), true);
});

test("the others' statement rate (state changes per second) backs reaper off whatever their statements' latency: the same application reads a lower active share on a faster database", () => {
  // 300 statements/s of about 0.3 ms on a fast database: running in about one sample of twelve
  // (active share 0.08, hold band by itself), but about 300 state changes per second.
  const fast = { waiting: 0, active: 0.08, changes: 320 };
  assert.ok(1 + ADAPTIVE.activePressure * fast.active < ADAPTIVE.backOffAbove, 'the active share alone would hold');
  assert.deepEqual(lookStartRate({ ...fast, present: 0, recent: 0 }, null), { rate: ADAPTIVE.floorRowsPerSecond, othersPressure: 1 + 320 / ADAPTIVE.changesAtBackOff, busy: true });
  // 30 statements/s (measured 18-47 changes/s): seen, so the look starts gentle (issue 41 item 4), but not busy; the takes raise.
  assert.deepEqual(lookStartRate({ waiting: 0, active: 0.005, changes: 47, present: 0, recent: 0 }, null), { rate: ADAPTIVE.seenStartRowsPerSecond, othersPressure: 1 + 47 / ADAPTIVE.changesAtBackOff, busy: false });
  // In the takes: one sample per admission, smoothed; the law backs off at 300/s and raises at 30/s.
  // Seen running in one sample of `activeEvery` (about 1/12 at 300/s, 1/100 at 30/s on that database).
  const takes = (changes: number, activeEvery: number) => {
    let reading = latencyObserve(NO_READING, { ms: 5, rows: 500, at: 0 });
    for (let i = 1; i <= 30; i++) reading = othersObserve(reading, { waiting: 0, active: i % activeEvery === 0 ? 1 : 0, changes: i % 2 === 0 ? changes * 1.6 : changes * 0.4, present: i % 10 === 0 ? 1 : 0, recent: 1 });
    return reading;
  };
  const busy = takes(300, 12);
  assert.ok(Math.abs(busy.othersChanges! - 300) < 60, `smoothed: ${busy.othersChanges}`);
  assert.ok(pressureOf(busy)! >= ADAPTIVE.backOffAbove, `300/s: pressure ${pressureOf(busy)}`);
  assert.equal(loadPressureOf(busy), Math.max(1 + ADAPTIVE.activePressure * busy.othersActive!, 1 + busy.othersChanges! / ADAPTIVE.changesAtBackOff), 'the load: the larger of the two terms');
  const backedOff = adaptRate({ rate: 20_000, pressure: pressureOf(busy), loadPressure: loadPressureOf(busy), ceiling: null, elapsedSeconds: 0.25, admittedRowsPerSecond: 20_000 });
  assert.equal(backedOff.decision, 'back-off');
  assert.ok(backedOff.rate < 20_000 * ADAPTIVE.backOffFactor, `a step larger than backOffFactor at a load over the threshold: ${backedOff.rate}`);
  const quiet = takes(30, 100);
  assert.ok(pressureOf(quiet)! <= ADAPTIVE.raiseBelow, `30/s: pressure ${pressureOf(quiet)}`);
  assert.equal(adaptRate({ rate: 20_000, pressure: pressureOf(quiet), loadPressure: loadPressureOf(quiet), ceiling: null, elapsedSeconds: 0.25, admittedRowsPerSecond: 20_000 }).decision, 'raise');
  // A busy look keeps the rate it saw as the worker's reading.
  assert.equal(othersLooked(NO_READING, fast).othersChanges, 320);
});

test('a start look ends early only when its first samples saw nobody at all; anything seen, it takes all its samples', () => {
  const nobody = { waiting: 0, active: 0, changes: 0, present: 0, recent: 0 };
  assert.equal(lookDone(0, nobody), false);
  assert.equal(lookDone(ADAPTIVE.startLookQuietSamples - 1, nobody), false);
  assert.equal(lookDone(ADAPTIVE.startLookQuietSamples, nobody), true, 'nobody in the first samples: done');
  assert.ok(ADAPTIVE.startLookQuietSamples < ADAPTIVE.startLookSamples);
  // One state change, one session present, running or waiting, or one that ran a statement within the last second, in any sample: the whole look.
  for (const seen of [{ ...nobody, changes: 200 }, { ...nobody, present: 1 }, { ...nobody, active: 1 }, { ...nobody, waiting: 1 }, { ...nobody, recent: 1 }]) {
    assert.equal(lookDone(ADAPTIVE.startLookQuietSamples, seen), false, JSON.stringify(seen));
    assert.equal(lookDone(ADAPTIVE.startLookSamples - 1, seen), false);
    assert.equal(lookDone(ADAPTIVE.startLookSamples, seen), true);
  }
});

test('statement size: alone, what the rate admits in statementSeconds (at least one batch); shared with an application or not known yet, one batch', () => {
  const batchSize = 500;
  assert.equal(statementRows(NO_READING, 30_000, batchSize), batchSize, 'no presence read yet: one batch');
  let alone = NO_READING;
  for (let i = 0; i < 100; i++) alone = othersPresentObserve(alone, false);
  assert.equal(statementRows(alone, 30_000, batchSize), 30_000 * ADAPTIVE.statementSeconds, 'alone at 30,000 rows/s: 3,000 rows');
  assert.equal(statementRows(alone, 1_000, batchSize), batchSize, 'alone at a low rate: still at least one batch');
  let shared = alone;
  for (let i = 0; i < 100; i++) shared = othersPresentObserve(shared, i % 10 === 0);
  assert.ok(shared.othersPresent! >= ADAPTIVE.presenceFull, `presence ${shared.othersPresent}`);
  assert.equal(statementRows(shared, 30_000, batchSize), batchSize, 'an application present: one batch, whatever the rate');
});

test('policies: adaptive is on unless `admission: { adaptive: false }`; a wrong value is refused naming the field', () => {
  const policy = (admission: string): RowDeletePolicy =>
    parsePolicies(`policies:\n  - name: p\n    kind: row-delete\n    schedule: "* * * * *"\n    table: t\n    key: id\n    expiresAt: e\n${admission}`, 'test.yaml', {}).get('p') as RowDeletePolicy;
  assert.equal(adaptiveAdmission(policy('')), true);
  assert.equal(adaptiveAdmission(policy('    admission: { rowsPerSecond: 100, concurrency: 1 }\n')), true);
  assert.equal(adaptiveAdmission(policy('    admission: { adaptive: false }\n')), false);
  assert.equal(adaptiveAdmission(policy('    admission: { adaptive: true, rowsPerSecond: 100 }\n')), true);
  assert.throws(
    () => policy('    admission: { adaptive: "no" }\n'),
    (error: unknown) => error instanceof ConfigError && /policies\.0\.admission\.adaptive/.test(error.message) && /"no"/.test(error.message),
  );
});
