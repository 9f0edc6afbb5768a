/**
 * Adaptive row-delete admission: the signal, pure. What one worker reads of the database and keeps
 * between its takes (a LatencyReading): its own deleting transactions' latency against a quiet-time
 * baseline per size class, and the other client backends seen at each admission (waiting on a lock
 * or IO, running a statement, changing state, present at all), each smoothed. No clock, no
 * database: every sample is an argument. The law that turns a reading into a rate is adaptive.ts.
 */
import { ADAPTIVE } from './adaptive-constants';
import { HARM, harmBaselineDone, harmObserve, NO_HARM, type AdaptiveLaw, type HarmReading } from './adaptive-harm';

/** One worker's reading of its own statements. Values, not objects with methods: the caller keeps the latest. */
export interface LatencyReading {
  /** Quiet-time latency (ms) per size class (floor(log2(rows))): a statement of 1,000 rows is never compared with one of 10. */
  baselineMs: ReadonlyMap<number, number>;
  /** Smoothed latency ÷ baseline of the recent statements; null before the first. */
  ratio: number | null;
  /**
   * Smoothed ms per row of this worker's quiet deleting transactions (the shared ceiling,
   * sharedCeilingOf): only those within raiseBelow of their size class's baseline count. A
   * transaction that waited 1.5 s for a row lock, or a slow moment, is not reaper's busy time: with
   * every transaction counted one such wait held the ceiling at the floor for about 25 of them. A
   * lasting change (bigger rows, a slower disk) is learnt as the baseline is, in minutes. Null
   * before the first.
   */
  msPerRow: number | null;
  /** Smoothed number of other backends seen waiting on a lock or on IO; null before the first sample. */
  othersWaiting: number | null;
  /** Smoothed number of other client backends seen running a statement; null before the first sample. */
  othersActive: number | null;
  /** Smoothed rate of the other client backends' state changes (a statement started or ended) per second; null before the first sample. */
  othersChanges: number | null;
  /** Smoothed share of samples that saw another client in a statement or transaction; null before the first (counts as present). */
  othersPresent: number | null;
  /** The last sample's count of other client sessions that started or ended a statement within ADAPTIVE.lookRecentSeconds (not smoothed: it spans a second already); null before the first. */
  othersRecent: number | null;
  /** Statements observed since this worker last proposed a step (a step needs at least one). */
  fresh: number;
  /** The caller's clock (ms) at the last statement observed; null before the first. */
  lastAt: number | null;
}

export const NO_READING: LatencyReading = { baselineMs: new Map(), ratio: null, msPerRow: null, othersWaiting: null, othersActive: null, othersChanges: null, othersPresent: null, othersRecent: null, fresh: 0, lastAt: null };

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
    msPerRow: sample.ms <= ADAPTIVE.raiseBelow * baseline ? smoothed(reading.msPerRow, sample.ms / sample.rows, ADAPTIVE.waitingWeight) : reading.msPerRow,
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
 * took the database for its own (workerAlone in adaptive-worker.ts) and admitted its groups without the
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
 * Whether a start look has seen enough after `samples` samples whose sums are `seen` (present: the
 * samples that saw another client in a statement or transaction): all of startLookSamples, or
 * startLookQuietSamples that saw nobody at all.
 */
export function lookDone(samples: number, seen: LookMeans & { harm?: HarmReading }, law: AdaptiveLaw = 'load'): boolean {
  const quiet = !lookSawSomebody(seen);
  if (law === 'harm' && seen.harm && seen.harm.othersAt !== null && !harmBaselineDone(seen.harm)) {
    // The harm law's baseline (adaptive-harm.ts): on until it is complete, at most HARM.baselineSeconds after the first samples.
    return samples >= ADAPTIVE.startLookSamples + (HARM.baselineSeconds * 1000) / HARM.sampleMs;
  }
  if (samples >= ADAPTIVE.startLookSamples) return true;
  return samples >= ADAPTIVE.startLookQuietSamples && quiet;
}

/**
 * The longest a worker's start look lasts (lookDone, lookGapMs), its samples' own time left out:
 * the load law's ADAPTIVE.startLookSamples gaps (0.16 s), the harm law's baseline after them. The
 * scheduler waits about this long, and a margin, for a run's first take (run-executor.ts paceWindow).
 */
export function lookLongestMs(law: AdaptiveLaw = 'load'): number {
  return ADAPTIVE.startLookSamples * ADAPTIVE.startLookGapMs + (law === 'harm' ? HARM.baselineSeconds * 1000 : 0);
}

/** The pause before a start look's next sample: ADAPTIVE.startLookGapMs, then HARM.sampleMs while the harm law's baseline fills. */
export function lookGapMs(samples: number): number {
  return samples < ADAPTIVE.startLookSamples ? ADAPTIVE.startLookGapMs : HARM.sampleMs;
}

/** One admission's sample of the other client backends: waiting, running a statement, changing state per second, present at all, a statement within the last second. */
export function othersObserve(reading: LatencyReading, sample: OthersLook & { present: number; recent: number }): LatencyReading {
  const smoothedOthers = othersPresentObserve(othersChangesObserve(othersActiveObserve(othersWaitingObserve(reading, sample.waiting), sample.active), sample.changes), sample.present > 0);
  return { ...smoothedOthers, othersRecent: sample.recent };
}

/** What the other client backends were seen doing (one sample, or the means of a look): waiting on a lock or IO, running a statement, changing state per second. */
export interface OthersLook {
  waiting: number;
  active: number;
  changes: number;
}

/**
 * A start look's samples (their sums, or their means): besides OthersLook, the samples that saw
 * another client in a statement or a transaction (present), and that saw one start or end a
 * statement within ADAPTIVE.lookRecentSeconds (recent).
 */
export interface LookMeans extends OthersLook {
  present: number;
  recent: number;
}

/** Whether a look (its sums or its means) saw another client at all: the one test of "somebody is there" (lookDone, lookStartRate). */
export function lookSawSomebody(look: LookMeans): boolean {
  return look.waiting > 0 || look.active > 0 || look.changes > 0 || look.present > 0 || look.recent > 0;
}


/**
 * A start look's samples so far: how many, and the sums of their counts (present: the samples that
 * saw another client at all); `harm`: the others' statement durations it saw, the harm law's
 * baseline (adaptive-harm.ts: reaper has not deleted yet).
 */
export interface LookSums extends LookMeans {
  samples: number;
  harm: HarmReading;
}

/** A new look: every look measures the harm law's baseline afresh (the application may have changed since the last run). */
export const NO_LOOK: LookSums = { samples: 0, waiting: 0, active: 0, changes: 0, present: 0, recent: 0, harm: NO_HARM };

/** One more sample of a start look (one pg_stat_activity read). */
export function lookAdd(sums: LookSums, sample: LookMeans & { finishedMs?: readonly number[]; at?: number }): LookSums {
  const harm = sample.at === undefined ? sums.harm : harmObserve(sums.harm, { finishedMs: sample.finishedMs ?? [], at: sample.at, present: sample.present }, true);
  const recent = sums.recent + (sample.recent > 0 ? 1 : 0);
  return { samples: sums.samples + 1, waiting: sums.waiting + sample.waiting, active: sums.active + sample.active, changes: sums.changes + sample.changes, present: sums.present + (sample.present > 0 ? 1 : 0), recent, harm };
}
