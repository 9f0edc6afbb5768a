/**
 * The harm-driven law of the adaptive row-delete admission (issue 41 item 3), pure: `admission: {
 * law: harm }`. It reacts to what the other clients suffer, as PostgreSQL shows it without an
 * extension, not to their mere presence or load: the duration of each of their statements, read
 * from pg_stat_activity as state_change - query_start of a session that is idle (or idle in
 * transaction) again, i.e. its last statement, counted once (ended since the worker's previous
 * sample). docs/design.md "The harm law" states it and justifies each constant of HARM.
 *
 *   baseline  = geometric mean duration of the others' statements that end during the start look,
 *               before reaper deletes (on for up to HARM.baselineSeconds until there are enough)
 *   harm      = geometric mean duration of those that ended since the last step / baseline
 *   step (enough durations, and HARM.stepSeconds since the last step of any worker):
 *     climbing (from the start until the first harm over the target): rate x 2
 *     harm <= target: rate x up;  harm > target: rate x down
 *   start: the floor when the look saw another client (gentle), else the start rate
 *   alone (no other client for HARM.aloneAfterSeconds): unthrottled, as the load law
 */
import { ADAPTIVE } from './adaptive-constants';

/** Which law steps the rate: 'load' (the others' presence and load, and reaper's own latency; the default) or 'harm' (the others' statement durations, this file). */
export type AdaptiveLaw = 'load' | 'harm';

export const HARM = {
  /**
   * The harm the law steers to: the others' statements at most this many times their duration before
   * reaper deleted. Issue 41's target is 1.25 (p99 / alone, bench figure 7b's knee); 1.2 leaves room
   * for the rate's sawtooth and the estimate's noise (derivation in docs/design.md). Untuned on a real
   * database: chosen from the target, checked on the simulated one.
   */
  target: 1.18,
  /** Raise per step at or under the target (after the climb). */
  up: 1.1,
  /**
   * Back off per step over the target. With up 1.1 the rate settles where the estimate exceeds the
   * target in log 1.1 / (log 1.1 + log 1.25) = 30 % of the steps: a little under the target when the
   * estimate is noisy, never far over it.
   */
  down: 0.8,
  /**
   * The spread (standard deviation, natural log) a step's estimate of the harm may have: a step waits
   * for (spread of the others' log durations / precision)^2 durations, at least 8 and at most
   * `durationsAtMost`; the baseline, which every step divides by and whose error is never averaged
   * away, for sixteen times as many (a quarter of the spread), at most 4 x `durationsAtMost`. The
   * others' spread is measured (the baseline's own durations): 0.3 needs 9 a step and 144 for the
   * baseline; 0.8, 48 (64 capped) and 192 (1,024 capped).
   */
  precision: 0.1,
  /**
   * At most this many durations a step waits for, and four times as many for the baseline, whatever
   * the spread: pgbench beside figure 7b read p50 0.74 ms and p99 9 ms alone (a log spread of about
   * 1.07), for which `precision` asks 115 a step and 1,830 for the baseline: at the 30-40 durations a
   * second the samples see beside 300 statements/s the baseline never completed, and the law never
   * stepped (figure 7b, 2026-12-06: the floor throughout, every shape). 48 a step is about 1.2 s of
   * them there, with a step's log estimate within +-0.15 at that spread.
   */
  durationsAtMost: 48,
  /**
   * At most one step per this long (the shared rate, all workers): what a step did must show in the
   * durations the next one judges by, and the others' statements that started before it show the
   * old rate. Untuned: a second, the window over which the simulated harm follows the rate.
   */
  stepSeconds: 1,
  /**
   * The harm law samples the others at least this often while a worker waits for tokens (a read of
   * pg_stat_activity, no write): a sample shows each idle session's last statement only, so samples
   * only at the takes, which follow reaper's own statements, see the others at one phase of reaper's
   * cycle (on the simulated database at 900 rows/s in statements of 500 rows: harm read about 1.0
   * when it was 1.5). Ten reads a second cost about 2 ms of PostgreSQL's time (0.2 ms each).
   */
  sampleMs: 100,
  /**
   * A start look whose baseline is not complete (HARM.precision / 4) after its samples goes on
   * sampling every sampleMs for at most this long, reaper not deleting yet: the baseline must be the
   * others' durations without reaper, and durations seen while it deletes at the floor read the
   * floor's own harm as quiet (simulated figure 7, knee 600 rows/s: the floor does harm 1.17, and
   * the law then held the harm at 1.4). At 300 statements/s the first 40 samples are enough; beside
   * 30 statements/s the look takes about this long once per run. Untuned.
   */
  baselineSeconds: 3,
  /** No other client's statement ended, and none was in a statement or a transaction, for this long: reaper is alone (unthrottled). */
  aloneAfterSeconds: 1,
} as const;

/**
 * What one worker knows of the others' statement durations, as natural logs of milliseconds: the
 * law compares geometric means, which a heavy tail moves far less than the arithmetic mean (at a
 * log spread of 1.07 the arithmetic mean's estimate needs 1.9 times as many durations for the same
 * precision, (e^(s^2) - 1) / s^2 for a log-normal, more for a heavier tail), and a harm that lengthens every statement by a factor moves by exactly that factor.
 */
export interface HarmReading {
  /** Sum, sum of squares and count of the log durations seen before reaper deleted (the look, and the first takes at the floor until there are enough). */
  baseLn: number;
  baseLn2: number;
  baseCount: number;
  /** Sum and count of the log durations since the last step proposal. */
  freshLn: number;
  freshCount: number;
  /** Still doubling: no step has found harm over the target yet. */
  climbing: boolean;
  /** The database clock (epoch ms) of this worker's last sample: durations that ended later are new. Null before the first. */
  since: number | null;
  /** The database clock (epoch ms) of the last sample that saw another client (a statement ended since the one before, or one in a statement or transaction). */
  othersAt: number | null;
}

export const NO_HARM: HarmReading = { baseLn: 0, baseLn2: 0, baseCount: 0, freshLn: 0, freshCount: 0, climbing: true, since: null, othersAt: null };

/** The spread of the others' durations (standard deviation of their logs), from the baseline (0.3 until 8 are known). */
function spreadOf(reading: HarmReading): number {
  if (reading.baseCount < 8) return 0.3;
  const mean = reading.baseLn / reading.baseCount;
  return Math.sqrt(Math.max(0, reading.baseLn2 / reading.baseCount - mean * mean));
}

/** Durations a harm estimate needs for a relative error of `precision`: (spread / precision)^2, at least 8, at most `atMost`. */
function needed(reading: HarmReading, precision: number, atMost: number): number {
  return Math.min(atMost, Math.max(8, Math.ceil((spreadOf(reading) / precision) ** 2)));
}

/** Whether the baseline is complete (HARM.precision / 4): exported for the look (lookDone). */
export function harmBaselineDone(reading: HarmReading): boolean {
  return baselineDone(reading);
}

/** Whether the baseline is complete (HARM.precision / 4): until then the durations the takes see go to it, and the rate does not step. */
function baselineDone(reading: HarmReading): boolean {
  return reading.baseCount >= needed(reading, HARM.precision / 4, 4 * HARM.durationsAtMost);
}

/**
 * One sample's durations (ms) of the others' statements that ended since `since`, at `at` (the
 * sample's database clock), and whether it saw another client in a statement or a transaction
 * (`present`). `baseline`: before reaper deletes (the look); after, they go to the baseline too
 * until it is complete (the rate stays at the floor meanwhile, where the harm is least).
 */
export function harmObserve(reading: HarmReading, sample: { finishedMs: readonly number[]; at: number; present: number }, baseline: boolean): HarmReading {
  let sum = 0;
  let sum2 = 0;
  let count = 0;
  for (const ms of sample.finishedMs) {
    if (!(ms > 0)) continue;
    const ln = Math.log(ms);
    sum += ln;
    sum2 += ln * ln;
    count += 1;
  }
  const seen = count > 0 || sample.present > 0;
  const next = { ...reading, since: Math.max(reading.since ?? sample.at, sample.at), othersAt: seen ? sample.at : reading.othersAt };
  // The first sample (no `since`) shows every idle session's last statement of the last second: one
  // per session, however busy, not the stream of statements the steps judge (a real database: the
  // test's own short polls and the application's 5 ms statements read harm 11.8 with nothing
  // changed). It says someone is there (othersAt); the baseline starts with the next sample.
  if (reading.since === null) return next;
  if (baseline || !baselineDone(reading)) return { ...next, baseLn: reading.baseLn + sum, baseLn2: reading.baseLn2 + sum2, baseCount: reading.baseCount + count };
  return { ...next, freshLn: reading.freshLn + sum, freshCount: reading.freshCount + count };
}

/** Whether no other client has been seen for HARM.aloneAfterSeconds (or ever) by the sample at `at`: the harm law's "alone". */
export function harmAlone(reading: HarmReading): boolean {
  return reading.since !== null && (reading.othersAt === null || reading.since - reading.othersAt >= HARM.aloneAfterSeconds * 1000);
}

/** The others' statements now / before reaper deleted (geometric mean durations); null until the baseline is complete and a step has enough fresh durations. */
export function harmRatio(reading: HarmReading): number | null {
  if (!baselineDone(reading) || reading.freshCount < needed(reading, HARM.precision, HARM.durationsAtMost)) return null;
  return Math.exp(reading.freshLn / reading.freshCount - reading.baseLn / reading.baseCount);
}

/** One step of the shared rate by the harm, clamped to [min(floor, ceiling), ceiling or the largest rate]; `reading` after it starts a new window. */
export function harmStep(rate: number, reading: HarmReading, ceiling: number | null): { rate: number; harm: number; reading: HarmReading } | null {
  const harm = harmRatio(reading);
  if (harm === null) return null;
  const over = harm > HARM.target;
  const factor = over ? HARM.down : reading.climbing ? 2 : HARM.up;
  const top = ceiling ?? ADAPTIVE.maxRowsPerSecond;
  const next = Math.min(top, Math.max(Math.min(top, ADAPTIVE.floorRowsPerSecond), rate * factor));
  return { rate: next, harm, reading: { ...reading, freshLn: 0, freshCount: 0, climbing: reading.climbing && !over } };
}
