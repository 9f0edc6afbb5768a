/**
 * Adaptive row-delete admission (issue 18): the control law, pure. No clock, no database, no state
 * of its own: from a worker's reading of the database (adaptive-signal.ts) and the shared rate to
 * the next rate and the size of a statement. docs/design.md "Adaptive row-delete admission" states
 * the same law; the constants and why they have their values are in adaptive-constants.ts.
 *
 *   pressure = max(latency pressure, 1 + 0.5 x others waiting, load)
 *     latency pressure = 1 + (own latency ratio - 1) x min(1, presence / 0.05)
 *     load             = max(1 + 6 x others active, 1 + others' state changes/s / 200)
 *   step (at most one per 250 ms, for all workers):
 *     pressure <= 1.4  raise: rate x 2^elapsed (at most x 2), not above max(32,000, 2 x admitted rows/s)
 *     in between       hold (and hold with no new statement to judge by)
 *     pressure >= 2    back off: rate x 0.7, or x max(0.25, 0.7 x 2 / load) when the load alone is >= 2
 *   clamped to [min(500, ceiling), ceiling or 10,000,000], and while others share the database
 *     (not othersAbsent) to at most 0.08 / (own quiet ms per row / 1000): reaper's deleting
 *     transactions busy at most 0.08 of a backend's time (the shared ceiling)
 *   start: min(32,000, ceiling) when the start look saw nobody; one that saw somebody starts at
 *     2,000 (pressure under 1.4), graded geometrically down to the floor at 2, the floor above
 *   a statement: one batch while others share the database (presence >= 0.05), else what the rate admits in 0.1 s
 *   alone (othersAbsent: presence < 0.005 and no other statement within the last second; quiet,
 *     no rate set, no brake): no rate, a probe every 0.25 s
 */
import { ADAPTIVE } from './adaptive-constants';
import { lookSawSomebody, type LatencyReading, type LookMeans, type OthersLook } from './adaptive-signal';

/**
 * The signal the rate reacts to: 1 is the quiet time; null when this worker has no new statement to
 * judge by. The latency's excess over the baseline counts in the measure others share the database
 * (ADAPTIVE.presenceFull); others waiting, and the others' own load (active), count always.
 */
export function pressureOf(reading: LatencyReading): number | null {
  if (reading.fresh === 0 || reading.ratio === null) return null;
  const shared = reading.othersPresent === null ? 1 : Math.min(1, reading.othersPresent / ADAPTIVE.presenceFull);
  const latency = 1 + (reading.ratio - 1) * shared;
  return Math.max(latency, othersPressureOf({ waiting: reading.othersWaiting ?? 0, active: reading.othersActive ?? 0, changes: reading.othersChanges ?? 0 }));
}

/** The others' part of the pressure: max(1 + waitingPressure x waiting, their load). The take's reading and the start look both use it. */
export function othersPressureOf(look: OthersLook): number {
  return Math.max(1 + ADAPTIVE.waitingPressure * look.waiting, othersLoadOf(look.active, look.changes));
}

/** The others' own load: max(1 + activePressure x active, 1 + changes / changesAtBackOff). */
function othersLoadOf(active: number, changes: number): number {
  return Math.max(1 + ADAPTIVE.activePressure * active, 1 + changes / ADAPTIVE.changesAtBackOff);
}

/** The part of the pressure that is the other clients' own load (their active share, their statement rate); null before the first sample. */
export function loadPressureOf(reading: LatencyReading): number | null {
  return reading.othersActive === null ? null : othersLoadOf(reading.othersActive, reading.othersChanges ?? 0);
}

export type AdaptDecision = 'raise' | 'hold' | 'back-off';

/**
 * One step of the shared rate. `elapsedSeconds`: since the last step (of any worker);
 * `admittedRowsPerSecond`: rows admitted per second over that time, by every worker; `ceiling`:
 * the policy's rowsPerSecond (file or `reaper admission set`), null when none is set;
 * `loadPressure`: the part of `pressure` that is the other clients' load (loadPressureOf), which
 * alone makes a back-off step bigger than backOffFactor.
 */
export function adaptRate(input: {
  rate: number;
  pressure: number | null;
  loadPressure?: number | null;
  ceiling: number | null;
  /** sharedCeilingOf the reading: null alone, or before the first statement. */
  sharedCeiling?: number | null;
  elapsedSeconds: number;
  admittedRowsPerSecond: number;
}): { rate: number; decision: AdaptDecision } {
  const { floor, top } = rateBounds(input.ceiling, input.sharedCeiling ?? null);
  const clamp = (rate: number): number => Math.min(top, Math.max(floor, rate));
  const { pressure } = input;
  if (pressure === null || (pressure > ADAPTIVE.raiseBelow && pressure < ADAPTIVE.backOffAbove)) return { rate: clamp(input.rate), decision: 'hold' };
  if (pressure >= ADAPTIVE.backOffAbove) {
    const load = input.loadPressure ?? 1;
    const factor = load >= ADAPTIVE.backOffAbove ? Math.max(ADAPTIVE.backOffFactorLeast, (ADAPTIVE.backOffFactor * ADAPTIVE.backOffAbove) / load) : ADAPTIVE.backOffFactor;
    return { rate: clamp(input.rate * factor), decision: 'back-off' };
  }
  // At baseline: raise, but not past what the workers can use (a rate far above the demand would
  // take many back-off steps to come down when the database gets busy).
  const factor = Math.min(ADAPTIVE.raisePerSecond, ADAPTIVE.raisePerSecond ** Math.max(0, input.elapsedSeconds));
  const demandCap = Math.max(ADAPTIVE.startRowsPerSecond, ADAPTIVE.demandHeadroom * input.admittedRowsPerSecond);
  return { rate: clamp(Math.max(input.rate, Math.min(input.rate * factor, demandCap))), decision: 'raise' };
}

/**
 * While other clients share the database (not othersAbsent, or not known yet): the rate that keeps
 * this worker's deleting transactions, at their smoothed quiet-time ms per row,
 * busy ADAPTIVE.sharedBusyShare of one backend's time (the shared rate is all workers', and each
 * worker's transactions take about as long per row). Null when nobody else is seen (alone: no
 * rate) or before this worker's first transaction. Never under the floor (adaptRate).
 */
export function sharedCeilingOf(reading: LatencyReading): number | null {
  if (reading.msPerRow === null || !(reading.msPerRow > 0)) return null;
  if (othersAbsent(reading)) return null;
  return Math.round((ADAPTIVE.sharedBusyShare * 1000) / reading.msPerRow);
}

/**
 * The bounds every step clamps the rate to: the floor (or the policy's ceiling, when lower) and the
 * policy's ceiling (10,000,000 when none), lowered to the shared ceiling when there is one, never
 * under the floor.
 */
function rateBounds(ceiling: number | null, sharedCeiling: number | null): { floor: number; top: number } {
  const most = ceiling ?? ADAPTIVE.maxRowsPerSecond;
  const floor = Math.min(most, ADAPTIVE.floorRowsPerSecond);
  return { floor, top: sharedCeiling === null ? most : Math.min(most, Math.max(floor, sharedCeiling)) };
}

/** The rate a policy starts at: the start rate, or the ceiling when lower. */
export function adaptiveStartRate(ceiling: number | null): number {
  return ceiling === null ? ADAPTIVE.startRowsPerSecond : Math.min(ceiling, ADAPTIVE.startRowsPerSecond);
}

/** What a start look decides (lookStartRate). */
export interface LookStart {
  rate: number;
  othersPressure: number;
  busy: boolean;
}

/**
 * What a start look (the means of its samples; `present`: the share that saw another client in a
 * statement or a transaction; `recent`: the share that saw one start or end a statement within
 * ADAPTIVE.lookRecentSeconds) does. A look that saw nobody at all (no other client present,
 * running, waiting, a state change, nor a recent statement): nothing (null), the start rate or the stored one: fast
 * when nobody is there. A look that saw somebody starts gentle (issue 41 item 4):
 * - others' pressure at or over backOffAbove, where the law would back off: the floor (where
 *   backing off would take it: before the first statement instead of after three steps), and the
 *   caller keeps the look as the worker's reading (othersLooked; `busy`);
 * - under raiseBelow (an application seen, but quiet): seenStartRowsPerSecond, and the takes
 *   raise it from there while they read it quiet;
 * - in the hold band between: graded geometrically from seenStartRowsPerSecond at raiseBelow
 *   down to the floor at backOffAbove, and the takes' own samples go on deciding (not busy): an
 *   application at 300 statements/s reads about 2 and a look is noisy, so an all-or-nothing
 *   threshold started a run at the start rate in three runs of four (2026-12-04).
 * Before 2026-12-07 a quiet application (under raiseBelow) started at the start rate, 32,000: beside
 * 30 statements/s a 15,000-row run was done in 0.3 s and the foreground's p99 read 1.94 and 1.95 x
 * alone over 20 rounds (two runs), where fixed 2,000 rows/s read 1.00 and 1.10 (docs/performance.md).
 */
export function lookStartRate(look: LookMeans, ceiling: number | null): LookStart | null {
  if (!lookSawSomebody(look)) return null;
  const othersPressure = othersPressureOf(look);
  const start = adaptiveStartRate(ceiling);
  const floor = Math.min(start, ADAPTIVE.floorRowsPerSecond);
  if (othersPressure >= ADAPTIVE.backOffAbove) return { rate: floor, othersPressure, busy: true };
  const gentle = Math.min(start, ADAPTIVE.seenStartRowsPerSecond);
  const within = Math.max(0, othersPressure - ADAPTIVE.raiseBelow) / (ADAPTIVE.backOffAbove - ADAPTIVE.raiseBelow);
  return { rate: Math.round(gentle * (floor / gentle) ** within), othersPressure, busy: false };
}

/**
 * The most rows one deleting statement may take, adaptive with no rate set. Alone on the database,
 * what the rate admits in ADAPTIVE.statementSeconds (at least one batch): fewer, bigger statements
 * cost the database less per row. Shared with other clients (or not known yet): one batch. An
 * application statement that arrives while reaper deletes waits behind that statement's work and
 * its commit's WAL flush, however low the rate; bench figure 7 (pinned): at about 30,000 rows/s in
 * statements of 3,000 rows the foreground's p99 was 12.9x its own alone, at a fixed 5,000 rows/s in
 * statements of one batch (500) 2.9x.
 */
export function statementRows(reading: LatencyReading, rate: number, batchSize: number): number {
  const shared = reading.othersPresent === null || reading.othersPresent >= ADAPTIVE.presenceFull;
  return shared ? batchSize : Math.max(batchSize, rate * ADAPTIVE.statementSeconds);
}

/**
 * Nobody else seen of late: the presence share below ADAPTIVE.aloneBelow, and the last sample saw no
 * other session start or end a statement within ADAPTIVE.lookRecentSeconds. Not the presence
 * alone: an application at 30 statements/s of 0.6 ms is in a statement about 2 % of the time, so
 * between two samples that catch it the presence share decays under aloneBelow, and the worker read
 * "alone" and admitted without the rate (the simulated database, 2026-12-07: seconds of 30-76k
 * rows/s in a long run beside it, where the shared rate was 8,000); its last statement is within
 * the last second in every sample.
 */
export function othersAbsent(reading: LatencyReading): boolean {
  return reading.othersPresent !== null && reading.othersPresent < ADAPTIVE.aloneBelow && (reading.othersRecent ?? 0) === 0;
}

/**
 * The shared ceiling as adaptRate applies it (the gauge reaper_row_admission_shared_ceiling): never
 * under the floor, never over the policy's own ceiling (`ceiling`: rowsPerSecond, null when none);
 * null when there is none (alone, or before the worker's first transaction).
 */
export function sharedCeilingInForce(reading: LatencyReading, ceiling: number | null): number | null {
  const shared = sharedCeilingOf(reading);
  return shared === null ? null : rateBounds(ceiling, shared).top;
}

/**
 * Whether reaper has the database to itself (docs/design.md "Alone on the database"): no other
 * client seen of late (othersAbsent) and the pressure quiet. Only with no rate
 * set and no brake, and once the worker has taken at least once (`taken`); the caller checks those.
 */
export function aloneOnDatabase(reading: LatencyReading): boolean {
  if (!othersAbsent(reading)) return false;
  const pressure = pressureOf(reading);
  return pressure === null || pressure <= ADAPTIVE.raiseBelow;
}
