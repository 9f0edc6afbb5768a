/**
 * The constants of the adaptive row-delete admission (issue 18), apart from the law that uses them
 * (adaptive.ts) so that the law reads short. Each says why it has its value; docs/design.md
 * "Adaptive row-delete admission" lists them with the measurement behind each (issue 41 item 3).
 * shared/db/queries/admission.ts reads changeWindowMs (the state-change count's window) and
 * lookRecentSeconds (the start look's "a statement within the last second").
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
  /**
   * A start look that saw another client at all, quiet (others' pressure under raiseBelow): the
   * first statements go at this rate, and the takes raise it from there (lookStartRate). The knee
   * of a quiet application (30 statements/s, bench figure 7b over 20 rounds, two runs): 2,000
   * rows/s read 1.00 and 1.10 x the foreground's p99 alone, 8,000 read 1.01 and 1.45, the start
   * rate 32,000 (where such a run started before) 1.94 and 1.95.
   */
  seenStartRowsPerSecond: 2_000,
  /**
   * While other clients share the database (othersAbsent false: presence share at least
   * aloneBelow, or a statement within the last second), the rate stays at or under what keeps
   * reaper's deleting transactions busy this share of one backend's time: sharedBusyShare / (the
   * worker's smoothed quiet-time ms per row of them), the shared ceiling (sharedCeilingOf). The load law does not see the harm it does a quiet application: beside 30
   * statements/s every signal reads quiet, and a long cleanup doubled from the start rate to 32,000
   * and beyond (bench figure 7b, single runs 2026-12-06: 11-46k rows/s, the foreground's p99 1.3-7.1
   * x alone; the simulated database: harm 2.2-7.3 over 200k rows at knees 1k-8k). The knee of that
   * shape was at or above 8,000 rows/s: over 20 rounds of short runs 8,000 read 1.01-1.45 and
   * unthrottled 1.8-2.0; over 6 rounds of long ones (2026-12-07, AMD host) 8,000 read 0.97 in the
   * long window, 16,000 1.64, unthrottled 3.54 (surely over). At 0.08 the default law's rate rose to
   * this ceiling, about 6,000 rows/s there (a batch's quiet transaction about 0.013 ms a row), backed
   * off now and then, and the run averaged 3,900 (p99 1.12 x alone, 0.68-2.31). At 0.12 (the next
   * run, same command) it averaged 5,119 and read 1.42 (0.99-2.39; sampling only 1.19-1.76, over),
   * where that run read its knee at 4,000 (8,000: 1.29). So 0.08: about the knee of this shape on
   * this machine, as far as the noise (alone windows' p99 spread 5.7-5.9 x) lets it be read.
   * A share, not a rate: on a faster database the same share is more rows/s.
   */
  sharedBusyShare: 0.08,
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
  /** Smoothing of the others-waiting count, per admission sample (also of active, state changes, and per statement of the quiet ms per row). */
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
  /** Presence share below this, and no other statement within lookRecentSeconds at the last sample: reaper has the database to itself (othersAbsent). */
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
   * clients before its first take (startLookSamples samples, startLookGapMs apart: 0.1 s); when it
   * sees any, that take starts a new rate, or one no worker has stepped for this long (from another
   * moment), at the look's rate (lookStartRate: seenStartRowsPerSecond, lower the busier, the floor
   * when busy). Without the look a policy started at the start rate whatever the application was
   * doing, and took about three steps to come down.
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
   * waiting, a state change within changeWindowMs, nor a statement within lookRecentSeconds) ends
   * there: nobody is using the database, and the other 32 samples cost about 0.15 s at every run's
   * start for nothing (bench cost figure, 2026-12-05: a 500k run spent 0.52-0.60 s from the trigger
   * to its first batch, of 8.8-9.6 s in all). An application that ran a statement within the last
   * lookRecentSeconds is seen by the first sample, so it never ends a look early.
   */
  startLookQuietSamples: 8,
  /**
   * A start look sees another client when one of its sessions started or ended a statement within
   * this long (state_change), besides what it is doing at the sample. Since a look that sees
   * somebody starts gentle (lookStartRate), one that misses an application is a burst: by the 5 ms
   * change window alone an application at 30 statements/s was missed by about one look in four of
   * 8 samples, and with 24 samples bench figure 7b (quiet shape, 2026-12-07) still read 2 runs in 20
   * deleting their 15,000 rows in the first second. One second: the harm law's own "alone" horizon
   * (HARM.aloneAfterSeconds); an application at one statement a second or more is seen in every look.
   */
  lookRecentSeconds: 1,
  /** A latency above the baseline becomes the new baseline with this time constant (seconds): a lasting change of the table is learnt, a load is not. */
  baselineRiseSeconds: 120,
  /**
   * A latency below the baseline moves it this far down (not all the way: one lucky statement is not
   * the quiet time; the baseline sits near a low percentile of the quiet latencies, not their minimum,
   * so the noise of a shared machine does not read as load).
   */
  baselineFallWeight: 0.1,
} as const;
