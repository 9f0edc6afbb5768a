/**
 * The adaptive row-delete admission's laws against a simulated database (issue 41 items 3 and 6):
 * do they find the knee of applications they were not tuned on?
 *
 * The database (test/support/simulated-database.ts) runs a foreground application whose statements
 * reaper's deletions lengthen by harm(r) = 1 + 0.25 x (r / knee)^2, and shows a worker only what
 * pg_stat_activity would: the other sessions' states, wait events, and the durations of the
 * statements that ended since its last sample (state_change - query_start of an idle session). The
 * hidden harm is read only by the test's own ticks, to judge the outcome.
 *
 * The workers run the real code path's pure parts (adaptive-worker.ts: the look, the alone test,
 * the step proposal, the take's sample, the statement's latency), one or two of them interleaved in
 * time order, against SharedRow, which mirrors the shared row's SQL (admissionRowsTake), with the
 * ask-again interval of rows.ts.
 *
 * The band (issue 41 item 2's targets, applied to the model): over the second half of a 60 s run,
 * the mean rate is at least 0.7 x the knee and the foreground's mean harm at most 1.25. A short run
 * (15,000 rows) is judged over its whole length: mean harm at most 1.25, done within 12 s (it
 * measures the others first and starts at the floor: no burst at the start).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as adaptive from '../../shared/admission/adaptive';
import type { AdaptiveRowsState, AdaptiveRowsTake, OthersSample } from '../../shared/db/queries/admission';
import { prng } from '../support/prng';
import { SimulatedDatabase, type Foreground } from '../support/simulated-database';

/** The policy's cleanup_admission row and its one-statement take (admissionRowsTake's SQL, adaptive, no ceiling, no brake). */
class SharedRow {
  private rate: number | null = null;
  private adaptedAt: number | null = null;
  private admittedSince = 0;
  private pressure: number | null = null;
  private tokens: number;
  private refilledAt = 0;

  constructor(private readonly capacity: number) {
    this.tokens = capacity;
  }

  take(now: number, take: AdaptiveRowsTake, rows: number, others: OthersSample): { admitted: boolean; tokens: number; state: AdaptiveRowsState } {
    const restarted = take.restart != null && this.adaptedAt !== null && this.adaptedAt <= now - take.restart.staleSeconds * 1000;
    const stepped = this.adaptedAt === null || restarted || (take.proposal !== null && String(this.adaptedAt) === take.proposal.seenAdaptedAt);
    const nextRate = restarted ? take.startRate : stepped && take.proposal ? take.proposal.rate : (this.rate ?? take.startRate);
    this.tokens = Math.min(this.capacity, this.tokens + (Math.max(0, now - this.refilledAt) / 1000) * nextRate);
    this.refilledAt = Math.max(now, this.refilledAt);
    const admitted = this.tokens >= Math.min(rows, this.capacity);
    if (admitted) this.tokens -= rows;
    this.rate = nextRate;
    if (stepped) {
      this.adaptedAt = now;
      this.admittedSince = 0;
      const pressure = take.proposal?.pressure ?? take.restart?.pressure ?? null;
      if (pressure !== null) this.pressure = pressure;
    }
    if (admitted) this.admittedSince += rows;
    const state: AdaptiveRowsState = {
      rate: nextRate,
      adaptedAt: String(this.adaptedAt),
      sinceStepSeconds: (now - this.adaptedAt!) / 1000,
      admittedSinceStep: this.admittedSince,
      pressure: this.pressure,
      othersWaiting: others.waiting,
      othersActive: others.active,
      othersPresent: others.present,
      othersChanges: others.changes,
      othersRecent: others.recent,
      othersFinishedMs: others.finishedMs,
      sampledAt: others.at,
    };
    return { admitted, tokens: this.tokens, state };
  }
}

const BATCH = 500;
const TAKE_MS = 1;
const SAMPLE_MS = 0.5;
const REAPER_MS_PER_500_ROWS = 5;

interface Run {
  database: SimulatedDatabase;
  row: SharedRow;
  law: adaptive.AdaptiveLaw;
  /** Rows left to delete (shared by the workers); Infinity: a backlog that never ends. */
  left: number;
  endMs: number;
  random: () => number;
}

/**
 * One worker of rows.ts: a group's statement size (maxRowsPerStatement), its admission
 * (admitRowsInTurn: the look, the alone shortcut, the take, asking again), its deleting
 * transaction. A generator that yields the time of its next action, so that two workers (and the
 * judge's ticks) act in time order against one database.
 */
function* worker(run: Run, startAt: number): Generator<number, void, void> {
  const { database, row, law } = run;
  let view: adaptive.WorkerView = adaptive.NEW_WORKER;
  const apply = (change: Partial<adaptive.WorkerView>): void => {
    view = { ...view, ...change };
  };
  let now = startAt;
  while (now < run.endMs && run.left > 0) {
    const rows = Math.min(run.left, adaptive.statementRows(view.reading, view.seen?.state.rate ?? adaptive.adaptiveStartRate(null), BATCH));
    for (;;) {
      if (adaptive.lookDue(view, now)) {
        const at = now;
        let sums = adaptive.NO_LOOK;
        while (!adaptive.lookDone(sums.samples, sums, law)) {
          if (sums.samples > 0) now += adaptive.lookGapMs(sums.samples);
          yield now;
          sums = adaptive.lookAdd(sums, database.sample(now, sums.harm.since));
          now += SAMPLE_MS;
        }
        apply(adaptive.afterLook(view, sums, null, at, law));
      }
      const alone = adaptive.workerAlone(view, { rated: false, braked: false }, law);
      if (alone && view.aloneUntil > now) break;
      const at = now;
      const { take, next } = adaptive.takeToSend(view, null, at, alone, law);
      apply(next);
      yield now;
      const outcome = row.take(now, take, rows, database.sample(now, take.since ?? null));
      now += TAKE_MS;
      apply(adaptive.afterTake(view, outcome.state, at));
      if (outcome.admitted) {
        apply(adaptive.afterAdmitted(alone, now));
        break;
      }
      const missing = Math.min(rows, BATCH) - outcome.tokens;
      const until = now + Math.min(1_000, Math.max(5, (missing / outcome.state.rate) * 1000));
      // The harm law samples the others while it waits (rows.ts waitSampling).
      for (now += adaptive.HARM.sampleMs; law === 'harm' && now < until; now += adaptive.HARM.sampleMs) {
        yield now;
        apply(adaptive.afterSample(view, database.sample(now, view.harm.since)));
      }
      now = until;
    }
    if (run.left <= 0) return;
    run.left -= rows;
    // The deleting transaction (barely slowed by the harm it does, as bench figure 7 measured): its latency is what noteRowStatement reports.
    const ms = ((REAPER_MS_PER_500_ROWS * rows) / 500) * (1 + 0.2 * (1 - 1 / database.harmAt(now))) * (0.9 + 0.2 * run.random());
    now += ms;
    yield now;
    database.deleted(now, rows);
    apply(adaptive.afterStatement(view, { ms, rows, at: now }));
  }
}

interface Outcome {
  /** Mean rows/s over the judged span (the second half; a finite run: its whole length). */
  rowsPerSecond: number;
  /** The foreground's mean harm over the same span (the hidden truth, ticks of 100 ms). */
  harm: number;
  /** ms until the last row (a finite run), or the run's length. */
  doneMs: number;
  /** Rows deleted in the run's first second (the workers start at 0). */
  firstSecondRows: number;
  /** The most rows deleted in any second ending 5 s or more into the run (100 ms apart), up to its end. */
  peakRowsPerSecondAfter5s: number;
}

function simulate(options: { knee: number; foreground: Foreground; law?: adaptive.AdaptiveLaw; seconds?: number; seed?: number; workers?: number; rows?: number }): Outcome {
  const seconds = options.seconds ?? 60;
  const random = prng(options.seed ?? 41);
  const total = options.rows ?? Number.POSITIVE_INFINITY;
  const run: Run = { database: new SimulatedDatabase(options.knee, options.foreground, random), row: new SharedRow(BATCH), law: options.law ?? 'harm', left: total, endMs: seconds * 1000, random };
  const workers = Array.from({ length: options.workers ?? 1 }, (_, i) => ({ steps: worker(run, i * 37), at: i * 37, done: false }));
  const fromMs = Number.isFinite(total) ? 0 : run.endMs / 2;
  let harmSum = 0;
  let ticks = 0;
  let doneMs = run.endMs;
  let deletedFrom = 0;
  let tick = fromMs;
  for (;;) {
    const live = workers.filter((w) => !w.done);
    if (live.length === 0) break;
    const next = live.reduce((a, b) => (b.at < a.at ? b : a));
    // The judge's ticks: every deletion up to a tick is recorded before it reads the harm.
    for (; tick <= Math.min(next.at, run.endMs) && tick <= doneMs; tick += 100, ticks++) harmSum += run.database.harmAt(tick);
    const before = run.left;
    const step = next.steps.next();
    if (step.done) next.done = true;
    else next.at = step.value;
    if (run.left < before && run.left <= 0 && Number.isFinite(total)) doneMs = Math.min(doneMs, next.at);
  }
  deletedFrom = Number.isFinite(total) ? total - Math.max(0, run.left) : 0;
  if (!Number.isFinite(total)) {
    // The backlog that never ends: rows deleted over the second half, from the database's own record.
    deletedFrom = run.database.rateAt(run.endMs) >= 0 ? rowsBetween(run.database, fromMs, run.endMs) : 0;
  }
  const spanMs = (Number.isFinite(total) ? doneMs : run.endMs) - fromMs;
  let peak = 0;
  for (let at = 5_000; at <= Math.min(doneMs, run.endMs); at += 100) peak = Math.max(peak, run.database.rateAt(at));
  return { rowsPerSecond: deletedFrom / (spanMs / 1000), harm: harmSum / Math.max(1, ticks), doneMs, firstSecondRows: run.database.rateAt(1_000), peakRowsPerSecondAfter5s: peak };
}

function rowsBetween(database: SimulatedDatabase, fromMs: number, toMs: number): number {
  let rows = 0;
  for (let at = fromMs + 1000; at <= toMs; at += 1000) rows += database.rateAt(at);
  return rows;
}

const QUIET: Foreground = { statementsPerSecond: 30, aloneMs: 0.6, connections: 4 };
const FIGURE_7: Foreground = { statementsPerSecond: 300, aloneMs: 0.6, connections: 4 };
const MANY: Foreground = { statementsPerSecond: 2_000, aloneMs: 0.6, connections: 16 };

interface Case {
  name: string;
  knee: number;
  foreground: Foreground;
  workers?: number;
  seed?: number;
  /** Most mean harm allowed (1.25 unless said, with why). */
  harmAtMost?: number;
  /** Why the harm law misses this case (node:test todo), or absent when it meets the band. */
  todo?: string;
}

/** The seven cases of issue 41's first simulator: the harm law was designed against these. */
const DESIGNED: Case[] = [
  // Marginal: the floor (500 rows/s, one statement of 500 rows a second) is 0.83 of this knee and
  // already does harm 1.17; a rate of 600 is one or two whole statements in a second.
  {
    name: 'figure 7 (300 statements/s), knee 600 rows/s',
    knee: 600,
    foreground: FIGURE_7,
    todo: 'harm 1.262 at 0.97 x the knee since the law compares geometric means (1.236 with arithmetic ones, which never stepped beside heavy-tailed statements): a rate of 600 is one or two whole statements of 500 rows in a second, and the floor alone already does harm 1.17',
  },
  { name: 'quiet (30 statements/s), knee 1,000 rows/s', knee: 1_000, foreground: QUIET },
  { name: 'quiet (30 statements/s), knee 4,000 rows/s', knee: 4_000, foreground: QUIET },
  { name: 'quiet (30 statements/s), knee 16,000 rows/s', knee: 16_000, foreground: QUIET },
  { name: 'many (2,000 statements/s), knee 1,000 rows/s', knee: 1_000, foreground: MANY },
  { name: 'many (2,000 statements/s), knee 4,000 rows/s', knee: 4_000, foreground: MANY },
  { name: 'many (2,000 statements/s), knee 16,000 rows/s', knee: 16_000, foreground: MANY },
];

/** Cases the law was not tuned on: other knees, two workers, noisier statements, harm that the statements show only in part, other seeds. */
const UNSEEN: Case[] = [
  { name: 'figure 7 (300 statements/s), knee 2,000 rows/s', knee: 2_000, foreground: FIGURE_7 },
  { name: 'figure 7 (300 statements/s), knee 8,000 rows/s', knee: 8_000, foreground: FIGURE_7 },
  { name: 'figure 7, two workers, knee 4,000 rows/s', knee: 4_000, foreground: FIGURE_7, workers: 2 },
  { name: 'many (2,000 statements/s), two workers, knee 8,000 rows/s', knee: 8_000, foreground: MANY, workers: 2 },
  {
    name: 'noisy statements (100/s of 2 ms, log spread 0.8), knee 4,000 rows/s',
    knee: 4_000,
    foreground: { statementsPerSecond: 100, aloneMs: 2, connections: 8, spread: 0.8 },
    // In the band since the law compares geometric means (0.83 x the knee, harm 1.18); with
    // arithmetic means a step's estimate was about +-10 % at this spread and the rule settled at
    // 0.61 x the knee, harm 1.12 (it was a todo case).
  },
  {
    name: 'harm half outside the statements (300/s), knee 2,000 rows/s: the law steers the half it sees, so the whole harm stays under 1 + 2 x 0.25',
    knee: 2_000,
    foreground: { ...FIGURE_7, hiddenShare: 0.5 },
    harmAtMost: 1.5,
  },
  {
    // Bench figure 7b's pgbench alone read p50 0.74 ms and p99 9.0 ms (300/s, a loaded machine): a
    // log-normal with p99 / p50 = 12 has a log spread of ln 12 / 2.33 = 1.07.
    name: 'heavy-tailed statements (300/s, log spread 1.07, as figure 7b read pgbench), knee 4,000 rows/s',
    knee: 4_000,
    foreground: { ...FIGURE_7, spread: 1.07 },
    todo: 'harm 1.253 at 0.98 x the knee: a step waits for at most 48 durations (about 1.2 s here), whose log estimate is within +-0.15 at this spread, so the rate sawtooths about the knee; before durationsAtMost the law never stepped (500 rows/s, 0.13 x the knee)',
  },
  { name: 'heavy-tailed statements (30/s, log spread 1.07), knee 8,000 rows/s', knee: 8_000, foreground: { ...QUIET, spread: 1.07 } },
  { name: 'quiet (30 statements/s), knee 8,000 rows/s, seed 7', knee: 8_000, foreground: QUIET, seed: 7 },
  { name: 'many (2,000 statements/s), knee 2,000 rows/s, seed 3', knee: 2_000, foreground: MANY, seed: 3 },
];

function describe(outcome: Outcome, knee: number): string {
  return `mean rate ${Math.round(outcome.rowsPerSecond)} rows/s = ${(outcome.rowsPerSecond / knee).toFixed(2)} x knee, mean harm ${outcome.harm.toFixed(3)}`;
}

for (const one of [...DESIGNED, ...UNSEEN]) {
  test(`harm law, simulated database, ${one.name}: settles near the knee (mean rate >= 0.7 x knee, foreground harm <= ${one.harmAtMost ?? 1.25})`, { todo: one.todo ?? false }, (t) => {
    const outcome = simulate({ knee: one.knee, foreground: one.foreground, workers: one.workers, seed: one.seed });
    const summary = describe(outcome, one.knee);
    t.diagnostic(summary);
    assert.ok(outcome.rowsPerSecond >= 0.7 * one.knee, `too slow: ${summary}`);
    assert.ok(outcome.harm <= (one.harmAtMost ?? 1.25), `too harmful: ${summary}`);
  });
}

test("harm law beside figure 7b's heavy-tailed statements (300/s, log spread 1.07), knee 4,000: it steps at all (>= 0.5 x the knee, harm <= 1.3)", (t) => {
  // The band's case above is todo (harm 1.253); this bound is the regression it guards against: with
  // no cap on the durations a step and the baseline wait for, the baseline never completed and the
  // rate never left the floor (500 rows/s, 0.13 x the knee), as on the real figure 7b.
  const outcome = simulate({ knee: 4_000, foreground: { ...FIGURE_7, spread: 1.07 } });
  const summary = describe(outcome, 4_000);
  t.diagnostic(summary);
  assert.ok(outcome.rowsPerSecond >= 0.5 * 4_000, `stuck near the floor: ${summary}`);
  assert.ok(outcome.harm <= 1.3, `too harmful: ${summary}`);
});

for (const [foreground, knee] of [
  [QUIET, 16_000],
  [FIGURE_7, 2_000],
  [MANY, 8_000],
] as const) {
  // Not 0.7 x the knee: the law measures the others' quiet durations before it deletes (up to
  // HARM.baselineSeconds beside a quiet application) and starts at the floor; a run this short ends
  // while it climbs. The bound is what it measured (8 to 10 s), with a little room.
  test(`harm law, a short run (15,000 rows) beside ${foreground.statementsPerSecond} statements/s, knee ${knee}: no burst at the start, harm <= 1.25 over the run, done within 12 s`, (t) => {
    const outcome = simulate({ knee, foreground, rows: 15_000, seconds: 120 });
    const summary = `${describe(outcome, knee)}, done in ${(outcome.doneMs / 1000).toFixed(1)} s`;
    t.diagnostic(summary);
    assert.ok(outcome.harm <= 1.25, `too harmful: ${summary}`);
    assert.ok(outcome.doneMs <= 12_000, `too slow: ${summary}`);
  });
}

test('harm law, a long run (200,000 rows) beside 300 statements/s, knee 4,000: harm <= 1.25 over the run, at >= 0.7 x the knee', (t) => {
  const outcome = simulate({ knee: 4_000, foreground: FIGURE_7, rows: 200_000, seconds: 600 });
  const summary = `${describe(outcome, 4_000)}, done in ${(outcome.doneMs / 1000).toFixed(1)} s`;
  t.diagnostic(summary);
  assert.ok(outcome.harm <= 1.25, `too harmful: ${summary}`);
  assert.ok(outcome.rowsPerSecond >= 0.7 * 4_000, `too slow: ${summary}`);
});

test('the load law (the default) on the simulated database: figure 7, the shape it was tuned on, stays under the knee', (t) => {
  const outcome = simulate({ knee: 600, foreground: FIGURE_7, law: 'load' });
  t.diagnostic(describe(outcome, 600));
  assert.ok(outcome.harm <= 1.25, describe(outcome, 600));
});

for (const seed of [41, 7, 3]) {
  // Issue 41 item 4, the default law. Before the start look graded a quiet application (2026-12-07)
  // this run started at the start rate, 32,000 rows/s, and deleted all 15,000 rows in the first
  // second (0.2-0.6 s), or, when the look caught nobody in a statement, without the rate at all
  // (72,000 rows/s). Knee 8,000: bench figure 7b read 2,000 rows/s harmless beside 30 statements/s
  // and 8,000 undecided (1.01, 1.45); at a knee of 4,000 this run reads harm 1.16-1.26 (doubling
  // per second from 2,000 overshoots within it), at 2,000 or below it is over the line.
  test(`the load law, a short run (15,000 rows) beside a quiet application (30 statements/s), seed ${seed}: gentle first statements (at most the seen start rate and a batch in the first second), harm <= 1.25 at a knee of 8,000; with nobody there, fast`, (t) => {
    const outcome = simulate({ knee: 8_000, foreground: QUIET, rows: 15_000, seconds: 120, law: 'load', seed });
    const summary = `${describe(outcome, 8_000)}, ${outcome.firstSecondRows} rows in the first second, done in ${(outcome.doneMs / 1000).toFixed(1)} s`;
    t.diagnostic(summary);
    assert.ok(outcome.firstSecondRows <= adaptive.ADAPTIVE.seenStartRowsPerSecond + BATCH, `a burst at the start: ${summary}`);
    assert.ok(outcome.harm <= 1.25, `too harmful: ${summary}`);
    const alone = simulate({ knee: 8_000, foreground: { ...QUIET, statementsPerSecond: 0 }, rows: 15_000, seconds: 120, law: 'load', seed });
    assert.equal(alone.firstSecondRows, 15_000, `nobody there: all of it in the first second (${(alone.doneMs / 1000).toFixed(2)} s)`);
  });
}

for (const { seed, workers } of [
  { seed: 41, workers: 1 },
  { seed: 7, workers: 1 },
  { seed: 3, workers: 2 },
]) {
  // The shared ceiling (ADAPTIVE.sharedBusyShare): this simulated reaper takes 5 ms per 500 rows
  // (a little more while it harms), so it keeps its transactions busy sharedBusyShare of the time
  // at about 100,000 x that rows/s (8,000 at 0.08). Without the ceiling the load law read every
  // signal quiet beside 30 statements/s and doubled to 32,000 rows/s and past it (harm 3.5-4.1 over
  // these runs at a knee of 8,000). Whether a real quiet application's knee lies at that busy share
  // is the bench's question (figure 7b, long cleanups); the simulated knee is set there.
  const ceiling = Math.round((adaptive.ADAPTIVE.sharedBusyShare * 1000 * 500) / REAPER_MS_PER_500_ROWS);
  test(`the load law, a long run (200,000 rows) beside a quiet application (30 statements/s), ${workers} worker(s), seed ${seed}: it climbs to the shared ceiling and stays under it (no second over 1.1 x the ceiling after the first 5 s, mean >= 0.7 x it), harm <= 1.25 with the knee at the ceiling`, (t) => {
    const outcome = simulate({ knee: ceiling, foreground: QUIET, rows: 200_000, seconds: 600, law: 'load', seed, workers });
    const summary = `ceiling ${ceiling}: ${describe(outcome, ceiling)}, peak ${outcome.peakRowsPerSecondAfter5s} rows/s after 5 s, done in ${(outcome.doneMs / 1000).toFixed(1)} s`;
    t.diagnostic(summary);
    assert.ok(outcome.peakRowsPerSecondAfter5s <= 1.1 * ceiling, `past the shared ceiling: ${summary}`);
    assert.ok(outcome.rowsPerSecond >= 0.7 * ceiling, `too slow: ${summary}`);
    assert.ok(outcome.harm <= 1.25, `too harmful: ${summary}`);
  });
}

test('the load law, 40 short runs beside quiet applications (30 and 5 statements/s, 20 seeds each): the start look sees every one (a statement within lookRecentSeconds), so no run deletes more than the seen start rate and a batch in its first second', () => {
  // By the 5 ms change window alone the look's first 8 samples missed 30 statements/s in about one
  // look in four (bench: 2 runs of 16 were a burst with 24 samples); 5 statements/s in most looks.
  const bursts: string[] = [];
  for (const statementsPerSecond of [30, 5]) {
    for (let seed = 1; seed <= 20; seed++) {
      const outcome = simulate({ knee: 8_000, foreground: { ...QUIET, statementsPerSecond }, rows: 15_000, seconds: 60, law: 'load', seed });
      if (outcome.firstSecondRows > adaptive.ADAPTIVE.seenStartRowsPerSecond + BATCH) bursts.push(`${statementsPerSecond}/s seed ${seed}: ${outcome.firstSecondRows} rows`);
    }
  }
  assert.deepEqual(bursts, [], 'runs that deleted more in their first second');
});

test('the simulated database itself: the harm is 1.25 at the knee, durations show it, reaper alone reads nobody and runs unthrottled', () => {
  const database = new SimulatedDatabase(4_000, FIGURE_7, prng(7));
  database.deleted(0, 4_000);
  assert.equal(database.harmAt(500), 1.25);
  assert.equal(database.harmAt(1_500), 1, 'a second later the deletions are out of the window');
  let changes = 0;
  let since: number | null = null;
  const durations: number[] = [];
  for (let i = 0; i < 2_000; i++) {
    const sample = database.sample(2_000 + i, since);
    changes += sample.changes;
    durations.push(...sample.finishedMs);
    since = sample.at;
  }
  assert.ok(changes / 2_000 > 250 && changes / 2_000 < 370, `300 statements/s read as about 300 state changes/s (pgbench read 300-370, docs/design.md): ${changes / 2_000}`);
  assert.ok(durations.length > 500 && durations.length <= 620, `2 s of 300 statements/s show each statement at most once: ${durations.length}`);
  const geometric = Math.exp(durations.reduce((sum, ms) => sum + Math.log(ms), 0) / durations.length);
  assert.ok(geometric > 0.5 && geometric < 0.7, `their durations read as their 0.6 ms: ${geometric}`);
  for (const law of ['harm', 'load'] as const) {
    const alone = simulate({ knee: 4_000, foreground: { statementsPerSecond: 0, aloneMs: 0.6, connections: 4 }, seconds: 10, law });
    assert.ok(alone.rowsPerSecond > 50_000, `${law}, alone: ${Math.round(alone.rowsPerSecond)} rows/s`);
  }
});

