/**
 * Adaptive row-delete admission (issue 18): the control law, pure. No clock, no database: every
 * input is an argument, so a test drives it with a signal it controls (docs/design.md "Adaptive
 * row-delete admission" states the law and why each constant has its value).
 *
 * Two halves:
 *  - a worker's own view of how PostgreSQL answers ITS statements: `latencyObserve` keeps a
 *    quiet-time baseline of the row-delete transaction's latency per size class and a smoothed ratio
 *    of recent latencies to it; `othersWaitingObserve` smooths how many other client backends of the
 *    database were seen waiting on a lock or on IO (pg_stat_activity, sampled by each admission).
 *  - `adaptRate`: one step of the shared rate (rows/s, kept in the policy's cleanup_admission row,
 *    so every worker uses and moves the same rate): multiplicative increase while the pressure is at
 *    the baseline, hold in a band above it, multiplicative decrease above that; never above the
 *    policy's rowsPerSecond (the ceiling) when one is set, never below a floor.
 */

export const ADAPTIVE = {
  /** At most one step of the shared rate per this much database time, whatever the number of workers. */
  stepMs: 250,
  /**
   * The rate a policy starts at (or the ceiling, when lower): generous, so a quiet database is not
   * slowed; at most floor ÷ 0.25³ (32,000), so a busy application's steps of × 0.25 bring it to
   * the floor in three steps.
   */
  startRowsPerSecond: 32_000,
  /** The rate never goes below this (or the ceiling, when lower): a busy database slows a cleanup, never stops it. */
  floorRowsPerSecond: 500,
  /** No ceiling set: the rate never goes above this (the schema's largest rowsPerSecond). */
  maxRowsPerSecond: 10_000_000,
  /** Pressure at or below this: raise. */
  raiseBelow: 1.4,
  /** Pressure at or above this: back off. Between the two: hold. */
  backOffAbove: 2,
  /** Raise: the rate doubles per second at baseline (factor 2^elapsed, at most 2 per step). */
  raisePerSecond: 2,
  /**
   * Back off: the rate is multiplied by this once per step; when the other clients' own load alone
   * is over the threshold, by less the further it is (backOffFactor x backOffAbove / load pressure,
   * at least backOffFactorLeast): an application busy most of the time (load pressure 6) brings the
   * start rate to the floor in three steps instead of eight. Only the load: it is smoothed over many
   * samples, while reaper's own latency ratio jumps with one slow statement (a restart, a stalled
   * link), and cutting the rate to a quarter for that would cost seconds of recovery for nothing.
   */
  backOffFactor: 0.7,
  backOffFactorLeast: 0.25,
  /** A raise never takes the rate above this multiple of the rows actually admitted per second (or the start rate). */
  demandHeadroom: 2,
  /** Smoothing of the latency ratio, per observed statement (exponential moving average weight of the newest). */
  ratioWeight: 0.5,
  /** Smoothing of the others-waiting count, per admission sample. */
  waitingWeight: 0.2,
  /** Smoothing of "another client is in a statement or transaction now" (0 or 1), per admission sample. */
  presenceWeight: 0.05,
  /**
   * The share of samples that see another client at which reaper's own latency counts in full; below
   * it, only that fraction of the latency's excess counts. Nobody else on the database: the latency
   * is reaper's own queueing (two workers' statements on a small server), and a cleanup alone is
   * held back by nothing (bench figure 1: workers alone ran at 0.17 of the raw DELETE when their own
   * queueing read as load). An application at 30 statements/s is seen in about 3 % of samples.
   */
  presenceFull: 0.05,
  /** Presence share below this: reaper has the database to itself (rows.ts aloneLeaseRows). */
  aloneBelow: 0.005,
  /** Alone: after an admitted take, a worker's groups of this long are admitted without a statement; then it samples again. */
  aloneProbeSeconds: 0.25,
  /**
   * How much pressure one other backend waiting (on average) adds: pressure = max(latency ratio, 1 +
   * this x waiting). Half: an application's own commits wait for their WAL flush too, reaper or not
   * (bench figure 7: about one foreground backend in IO or LWLock wait at 300 statements/s on a
   * loaded machine), so it takes more than that to back off.
   */
  waitingPressure: 0.5,
  /**
   * How much pressure the other clients' own load adds: pressure = max(..., 1 + this x active), where
   * active is the smoothed number of other client backends seen running a statement (state 'active')
   * at admission, i.e. by Little's law their statements/s x their latency: the share of the
   * database's time they keep it busy. 6: others busy a sixth of the time (0.17) back reaper off
   * (pressure 2), under 0.067 let it raise (1.4), between it holds; reaper's own interference
   * lengthens their statements and so raises this too. Gentle when busy: an application at 300 point
   * statements/s of about 0.6 ms (0.18) keeps reaper near its floor; one at 30/s (0.02) does not slow
   * it. Bench figure 7 (pinned, one core for PostgreSQL), 300 statements/s: the foreground's p99
   * stayed within 1.25x its own alone only at about 500 rows/s (fixed rate); reaper's own latency
   * read 1.1-1.2 throughout (it is barely slowed by a foreground that is slowed a lot by it); with
   * this term at 3 adaptive held at about 7,000 rows/s and the p99 at 3.3x.
   */
  activePressure: 6,
  /**
   * How much pressure the other clients' statement rate adds: pressure = max(..., 1 + rate / this),
   * where rate is the smoothed number of other client backends whose state changed (a statement
   * started or ended) within the last changeWindowMs, per second of that window: about their
   * statements per second, whatever the machine's speed. The active share above is their
   * statements/s x their latency, so the same application reads lower on a faster database: on the
   * 2026-12-04 evening machine (raw DELETE 113-174k rows/s) 300 statements/s read a look of 1.4-1.9,
   * in the hold band, the rate rose to 15,647 rows/s and the foreground's p99 was 1.9x its alone.
   * 200: an application at 200 statements/s backs reaper off (pressure 2), under 80/s lets it raise
   * (1.4). Measured (pgbench, 4 connections, 200 samples of a 5 ms window): 300 statements/s read
   * 300-370, 30/s read 18-47.
   */
  changesAtBackOff: 200,
  /** The window of the state-change count (ms): short, so that one connection's consecutive statements rarely count once; long enough that 30/s is seen at all. */
  changeWindowMs: 5,
  /**
   * No rate set: one deleting statement takes at most what the adaptive rate admits in this long (at
   * least one batch), so a low rate means small statements, not rare big ones. While other clients
   * share the database (presence share at least presenceFull), one batch per statement whatever the
   * rate (statementRows).
   */
  statementSeconds: 0.1,
  /**
   * A worker that has not taken for this long (between two runs, or never) looks at the other
   * clients before its first take (startLookSamples samples, startLookGapMs apart: 0.1 s); when
   * they are busy, that take starts a new rate, or one no worker has stepped for this long (from
   * another moment), at the floor (lookStartRate). Without the look a policy started at the start
   * rate whatever the application was doing, and took about three steps to come down.
   */
  restartAfterSeconds: 30,
  /**
   * Samples of the start look. At 300 statements/s of about 0.6 ms an application is seen running in
   * about one sample of five: with 20 samples the look's pressure had a spread of about ±0.5 around 2,
   * and missed the application in three runs of four (bench figure 7, 2026-12-04); 40 halve its variance.
   */
  startLookSamples: 40,
  startLookGapMs: 4,
  /**
   * A look whose first this-many samples saw nobody at all (no other client present, running,
   * waiting, nor a state change within changeWindowMs) ends there: nobody is using the database, and
   * the other 32 samples cost about 0.15 s at every run's start for nothing (bench cost figure,
   * 2026-12-05: a 500k run spent 0.52-0.60 s from the trigger to its first batch, of 8.8-9.6 s in
   * all). An application at 300 statements/s is seen about 1.5 times per sample (state changes), so
   * it never ends a look early; one at 30/s ends about one look in four early, which reads it quiet,
   * as the whole look does.
   */
  startLookQuietSamples: 8,
  /** A latency above the baseline becomes the new baseline with this time constant (seconds): a lasting change of the table is learnt, a load is not. */
  baselineRiseSeconds: 120,
  /**
   * A latency below the baseline moves it this far down (not all the way: one lucky statement is not
   * the quiet time; the baseline sits near a low percentile of the quiet latencies, not their minimum,
   * so the noise of a shared machine does not read as load).
   */
  baselineFallWeight: 0.1,
} as const;

/** One worker's reading of its own statements. Values, not objects with methods: the caller keeps the latest. */
export interface LatencyReading {
  /** Quiet-time latency (ms) per size class (floor(log2(rows))): a statement of 1,000 rows is never compared with one of 10. */
  baselineMs: ReadonlyMap<number, number>;
  /** Smoothed latency ÷ baseline of the recent statements; null before the first. */
  ratio: number | null;
  /** Smoothed number of other backends seen waiting on a lock or on IO; null before the first sample. */
  othersWaiting: number | null;
  /** Smoothed number of other client backends seen running a statement; null before the first sample. */
  othersActive: number | null;
  /** Smoothed rate of the other client backends' state changes (a statement started or ended) per second; null before the first sample. */
  othersChanges: number | null;
  /** Smoothed share of samples that saw another client in a statement or transaction; null before the first (counts as present). */
  othersPresent: number | null;
  /** Statements observed since this worker last proposed a step (a step needs at least one). */
  fresh: number;
  /** The caller's clock (ms) at the last statement observed; null before the first. */
  lastAt: number | null;
}

export const NO_READING: LatencyReading = { baselineMs: new Map(), ratio: null, othersWaiting: null, othersActive: null, othersChanges: null, othersPresent: null, fresh: 0, lastAt: null };

const sizeClass = (rows: number): number => Math.floor(Math.log2(Math.max(1, rows)));

/** One row-delete transaction took `ms` for `rows` rows, at `at` (ms, the caller's clock). */
export function latencyObserve(reading: LatencyReading, sample: { ms: number; rows: number; at: number }): LatencyReading {
  if (!(sample.ms > 0) || !(sample.rows > 0)) return reading;
  const size = sizeClass(sample.rows);
  const before = reading.baselineMs.get(size);
  let baseline: number;
  if (before === undefined) baseline = sample.ms;
  else if (sample.ms < before) baseline = before + (sample.ms - before) * ADAPTIVE.baselineFallWeight;
  else {
    const elapsedSeconds = reading.lastAt === null ? 0 : Math.max(0, (sample.at - reading.lastAt) / 1000);
    baseline = before + (sample.ms - before) * (1 - Math.exp(-elapsedSeconds / ADAPTIVE.baselineRiseSeconds));
  }
  const baselineMs = new Map(reading.baselineMs);
  baselineMs.set(size, baseline);
  const ratio = sample.ms / baseline;
  return {
    ...reading,
    baselineMs,
    ratio: smoothed(reading.ratio, ratio, ADAPTIVE.ratioWeight),
    fresh: reading.fresh + 1,
    lastAt: sample.at,
  };
}

/** Exponential moving average: the first sample as it is, then `weight` of each new one. */
function smoothed(previous: number | null, sample: number, weight: number): number {
  return previous === null ? sample : previous + (sample - previous) * weight;
}

/** An admission saw `count` other client backends of the database waiting on a lock or on IO. */
export function othersWaitingObserve(reading: LatencyReading, count: number): LatencyReading {
  return { ...reading, othersWaiting: smoothed(reading.othersWaiting, count, ADAPTIVE.waitingWeight) };
}

/** An admission saw `count` other client backends of the database running a statement (waiting or not). */
export function othersActiveObserve(reading: LatencyReading, count: number): LatencyReading {
  return { ...reading, othersActive: smoothed(reading.othersActive, count, ADAPTIVE.waitingWeight) };
}

/** An admission saw the other client backends of the database change state at `perSecond` (a statement started or ended). */
export function othersChangesObserve(reading: LatencyReading, perSecond: number): LatencyReading {
  return { ...reading, othersChanges: smoothed(reading.othersChanges, perSecond, ADAPTIVE.waitingWeight) };
}

/** An admission saw another client of the database in a statement or a transaction (`present`), or none. */
export function othersPresentObserve(reading: LatencyReading, present: boolean): LatencyReading {
  return { ...reading, othersPresent: smoothed(reading.othersPresent, present ? 1 : 0, ADAPTIVE.presenceWeight) };
}

/**
 * Every start look counts towards the presence share, busy or not: the share of its samples that saw
 * another client in a statement or a transaction, when more than the worker knew. Without it a look
 * that read an application in the hold band (so not busy: the reading is not replaced) left the
 * presence to the first take's one sample, and an application at 300 short statements/s on a fast
 * database is in a statement about a tenth of the time: nine takes in ten saw nobody, the worker
 * took the database for its own (hasDatabaseAlone in rows.ts) and admitted its groups without the
 * rate until a probe saw the application (bench figure 7, 2026-12-04 evening: 50,000 rows went in
 * 23 s while the shared rate read 500 to 1,900 rows/s, about 16,000 rows' worth; foreground p99
 * 2.3 x alone). A look that saw nobody changes nothing: the takes decide, as before.
 */
export function presenceLooked(reading: LatencyReading, presentShare: number): LatencyReading {
  if (!(presentShare > 0)) return reading;
  return { ...reading, othersPresent: Math.max(reading.othersPresent ?? 0, presentShare) };
}

/**
 * A busy start look (lookStartRate) replaces what this worker knew of the others' load (from
 * another moment) with the means of its samples, and its latency ratio starts again. Kept: the
 * baseline (the quiet time of each statement size) and the presence share, which says whether an
 * application uses the database at all and is meant to change slowly; but at least presenceFull:
 * an application busy enough to back off from is there, and a worker whose last run ended alone
 * (below aloneBelow) would otherwise go on admitting without the rate until a take saw it.
 */
export function othersLooked(reading: LatencyReading, look: OthersLook): LatencyReading {
  return { ...reading, othersWaiting: look.waiting, othersActive: look.active, othersChanges: look.changes, othersPresent: Math.max(reading.othersPresent ?? 0, ADAPTIVE.presenceFull), ratio: null, fresh: 0 };
}

/**
 * What a start look (the means of its samples) does. When the others' part of the pressure is at or
 * over backOffAbove, where the law would back off, the rate starts at the floor (where backing off
 * would take it: before the first statement instead of after three steps) and the caller keeps the
 * look as the worker's reading (othersLooked; `busy`). In the hold band (raiseBelow up to
 * backOffAbove) the start rate is graded, geometrically from the start rate at raiseBelow down to
 * the floor at backOffAbove (1.7: about 4,000 rows/s), and the takes' own samples go on deciding
 * (not busy): an application at 300 statements/s reads about 2 and a look is noisy, so an
 * all-or-nothing threshold started a run at the start rate in three runs of four, which deleted half
 * of figure 7's rows in the first three seconds (2026-12-04); a look of 30 statements/s on a slow
 * machine reads about 1.5 and starts at about 16,000 (half the start rate), and the takes raise it from there when they
 * read it quiet. Not the floor in the band: a start at the floor would stay there (the law never
 * raises in the band; 0.09 of the unthrottled rate at 30/s). Below raiseBelow: nothing (null), the
 * start rate or the stored one.
 */
export function lookStartRate(look: OthersLook, ceiling: number | null): { rate: number; othersPressure: number; busy: boolean } | null {
  const othersPressure = othersPressureOf(look);
  if (othersPressure < ADAPTIVE.raiseBelow) return null;
  const start = adaptiveStartRate(ceiling);
  const floor = Math.min(start, ADAPTIVE.floorRowsPerSecond);
  if (othersPressure >= ADAPTIVE.backOffAbove) return { rate: floor, othersPressure, busy: true };
  const within = (othersPressure - ADAPTIVE.raiseBelow) / (ADAPTIVE.backOffAbove - ADAPTIVE.raiseBelow);
  return { rate: Math.round(start * (floor / start) ** within), othersPressure, busy: false };
}

/**
 * Whether a start look has seen enough after `samples` samples whose sums are `seen` (present: the
 * samples that saw another client in a statement or transaction): all of startLookSamples, or
 * startLookQuietSamples that saw nobody at all.
 */
export function lookDone(samples: number, seen: OthersLook & { present: number }): boolean {
  if (samples >= ADAPTIVE.startLookSamples) return true;
  return samples >= ADAPTIVE.startLookQuietSamples && seen.waiting === 0 && seen.active === 0 && seen.changes === 0 && seen.present === 0;
}

/** One admission's sample of the other client backends: waiting, running a statement, changing state per second, present at all. */
export function othersObserve(reading: LatencyReading, sample: OthersLook & { present: number }): LatencyReading {
  return othersPresentObserve(othersChangesObserve(othersActiveObserve(othersWaitingObserve(reading, sample.waiting), sample.active), sample.changes), sample.present > 0);
}

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

/** What the other client backends were seen doing (one sample, or the means of a look): waiting on a lock or IO, running a statement, changing state per second. */
export interface OthersLook {
  waiting: number;
  active: number;
  changes: number;
}

/**
 * The others' part of the pressure: max(1 + waitingPressure x waiting, their load). The take's
 * reading and the start look both use it.
 */
export function othersPressureOf(look: OthersLook): number {
  return Math.max(1 + ADAPTIVE.waitingPressure * look.waiting, othersLoadOf(look.active, look.changes));
}

/** The others' own load: max(1 + activePressure x active, 1 + changes / changesAtBackOff). */
function othersLoadOf(active: number, changes: number): number {
  return Math.max(1 + ADAPTIVE.activePressure * active, 1 + changes / ADAPTIVE.changesAtBackOff);
}

/** The part of the pressure that is the other clients' own load (othersLoadOf: their active share, their statement rate); null before the first sample. */
export function loadPressureOf(reading: LatencyReading): number | null {
  return reading.othersActive === null ? null : othersLoadOf(reading.othersActive, reading.othersChanges ?? 0);
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

/** The rate a policy starts at: the start rate, or the ceiling when lower. */
export function adaptiveStartRate(ceiling: number | null): number {
  return ceiling === null ? ADAPTIVE.startRowsPerSecond : Math.min(ceiling, ADAPTIVE.startRowsPerSecond);
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
  elapsedSeconds: number;
  admittedRowsPerSecond: number;
}): { rate: number; decision: AdaptDecision } {
  const top = input.ceiling ?? ADAPTIVE.maxRowsPerSecond;
  const floor = Math.min(top, ADAPTIVE.floorRowsPerSecond);
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
