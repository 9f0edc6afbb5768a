/**
 * The adaptive row-delete admission's law against a simulated database (issue 41 items 3 and 6):
 * does it find the knee of applications it was not tuned on?
 *
 * The model. A foreground application runs `statementsPerSecond` short statements on
 * `connections` connections, each `aloneMs` long when reaper does nothing. Reaper's deletions harm
 * it: over a second in which reaper deleted r rows, each foreground statement takes
 * aloneMs x harm(r), harm(r) = 1 + 0.25 x (r / knee)^2, so the knee is what bench figure 7b calls
 * it: the highest rate at which the foreground's latency is at most 1.25 x its own alone (harm 2 at
 * twice the knee, 5 at four times). Reaper's own statements (5 ms per 500 rows) are barely slowed
 * (at most x 1.2, as bench figure 7 measured while the foreground's p99 was 13 x). The model
 * produces what PostgreSQL shows the law, sampled at each take and each sample of a start look:
 *  - active: the foreground backends in a statement: Poisson with mean statements/s x latency
 *    (Little's law), at most `connections`; present: the same (an autocommit application);
 *  - waiting: of those, each waits (Lock, LWLock, IO) with probability (harm - 1) / harm: the time
 *    reaper added to its statement is time spent waiting for reaper;
 *  - changes: backends whose state changed within the last 5 ms, per second of that window
 *    (Poisson with mean statements/s x 5.5 ms, at most `connections`, x 200): 300 statements/s
 *    read 300-370 in pgbench (docs/design.md), this reads about 330.
 *
 * The worker is one worker of the real code path's pure parts (adaptive-worker.ts: the look, the
 * alone test, the step proposal, the take's sample, the statement's latency), with the shared
 * row's SQL (admissionRowsTake) mirrored by SharedRow below, and the ask-again interval of rows.ts.
 *
 * The band (issue 41 item 2's targets, applied to the model): over the second half of a 60 s run,
 * the mean rate is at least 0.7 x the knee and the foreground's mean harm at most 1.25.
 * Cases the law of today misses are `todo`, each with why: that is the evidence for item 3.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as adaptive from '../../shared/admission/adaptive';
import type { AdaptiveRowsState, AdaptiveRowsTake, OthersSample } from '../../shared/db/queries/admission';
import { prng } from '../support/prng';

interface Foreground {
  statementsPerSecond: number;
  aloneMs: number;
  connections: number;
}

function poisson(random: () => number, mean: number): number {
  if (mean > 30) return Math.max(0, Math.round(mean + Math.sqrt(mean) * Math.sqrt(-2 * Math.log(random() || 1e-12)) * Math.cos(2 * Math.PI * random())));
  const limit = Math.exp(-mean);
  let count = 0;
  for (let product = random(); product > limit; product *= random()) count += 1;
  return count;
}

const REAPER_MS_PER_500_ROWS = 5;
const CHANGE_WINDOW_MS = 5.5;

/** The simulated database: reaper's deletions over time, the harm they do, and what pg_stat_activity shows. */
class SimulatedDatabase {
  private readonly deletions: { at: number; rows: number }[] = [];
  private windowStart = 0;
  private inWindow = 0;

  constructor(
    private readonly knee: number,
    private readonly foreground: Foreground,
    private readonly random: () => number,
  ) {}

  /** rows/s reaper deleted over the last second before `at` (`at` never goes back, and no deletion is later than it). */
  rateAt(at: number): number {
    while (this.windowStart < this.deletions.length && this.deletions[this.windowStart]!.at <= at - 1000) this.inWindow -= this.deletions[this.windowStart++]!.rows;
    return this.inWindow;
  }

  harmAt(at: number): number {
    return 1 + 0.25 * (this.rateAt(at) / this.knee) ** 2;
  }

  deleted(at: number, rows: number): void {
    this.deletions.push({ at, rows });
    this.inWindow += rows;
  }

  /** One read of pg_stat_activity's other clients at `at`. */
  sample(at: number): OthersSample {
    const { statementsPerSecond, aloneMs, connections } = this.foreground;
    const harm = this.harmAt(at);
    const active = Math.min(connections, poisson(this.random, (statementsPerSecond * aloneMs * harm) / 1000));
    let waiting = 0;
    for (let i = 0; i < active; i++) if (this.random() < (harm - 1) / harm) waiting += 1;
    const changed = Math.min(connections, poisson(this.random, (statementsPerSecond * CHANGE_WINDOW_MS) / 1000));
    return { waiting, active, present: active, changes: changed * (1000 / adaptive.ADAPTIVE.changeWindowMs) };
  }

  /** How long reaper's statement of `rows` rows takes at `at` (ms): barely slowed by the harm it does, a little noise. */
  reaperStatementMs(rows: number, at: number): number {
    const harm = this.harmAt(at);
    return ((REAPER_MS_PER_500_ROWS * rows) / 500) * (1 + 0.2 * (1 - 1 / harm)) * (0.9 + 0.2 * this.random());
  }
}

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
    };
    return { admitted, tokens: this.tokens, state };
  }
}

const BATCH = 500;
const TAKE_MS = 1;
const SAMPLE_MS = 0.5;

/**
 * One worker deleting a backlog that never ends for `seconds` simulated seconds, beside the
 * foreground. Returns the mean rate and the foreground's mean harm over the second half, and the
 * shared rate at the end.
 */
function simulate(options: { knee: number; foreground: Foreground; seconds?: number; seed?: number }): { rowsPerSecond: number; harm: number; rate: number } {
  const seconds = options.seconds ?? 60;
  const random = prng(options.seed ?? 41);
  const database = new SimulatedDatabase(options.knee, options.foreground, random);
  const row = new SharedRow(BATCH);
  let view: adaptive.WorkerView = adaptive.NEW_WORKER;
  const apply = (change: Partial<adaptive.WorkerView>): void => {
    view = { ...view, ...change };
  };
  let now = 0;
  let rate: number = adaptive.adaptiveStartRate(null);
  let deletedSecondHalf = 0;
  // The foreground's harm over the second half, one look per 100 ms (the rate over the second before each).
  let harmSum = 0;
  let ticks = 0;
  let nextTick = (seconds * 1000) / 2;
  while (now < seconds * 1000) {
    // The group's statement size (maxRowsPerStatement), then its admission (admitRowsInTurn).
    const rows = adaptive.statementRows(view.reading, view.seen?.state.rate ?? adaptive.adaptiveStartRate(null), BATCH);
    for (;;) {
      if (adaptive.lookDue(view, now)) {
        const at = now;
        let sums = adaptive.NO_LOOK;
        while (!adaptive.lookDone(sums.samples, sums)) {
          if (sums.samples > 0) now += adaptive.ADAPTIVE.startLookGapMs;
          sums = adaptive.lookAdd(sums, database.sample(now));
          now += SAMPLE_MS;
        }
        apply(adaptive.afterLook(view, sums, null, at));
      }
      const alone = adaptive.workerAlone(view, { rated: false, braked: false });
      if (alone && view.aloneUntil > now) break;
      const at = now;
      const { take, next } = adaptive.takeToSend(view, null, at, alone);
      apply(next);
      const outcome = row.take(now, take, rows, database.sample(now));
      now += TAKE_MS;
      apply(adaptive.afterTake(view, outcome.state, at));
      rate = outcome.state.rate;
      if (outcome.admitted) {
        apply(adaptive.afterAdmitted(alone, now));
        break;
      }
      const missing = Math.min(rows, BATCH) - outcome.tokens;
      now += Math.min(1_000, Math.max(5, (missing / rate) * 1000));
    }
    // The deleting transaction: its latency is what noteRowStatement reports.
    const ms = database.reaperStatementMs(rows, now);
    now += ms;
    // Every deletion recorded so far happened before these ticks: each reads the second before it.
    for (; nextTick <= Math.min(now, seconds * 1000); nextTick += 100, ticks++) harmSum += database.harmAt(nextTick);
    database.deleted(now, rows);
    if (now > (seconds * 1000) / 2 && now <= seconds * 1000) deletedSecondHalf += rows;
    apply(adaptive.afterStatement(view, { ms, rows, at: now }));
  }
  return { rowsPerSecond: deletedSecondHalf / (seconds / 2), harm: harmSum / ticks, rate };
}

interface Case {
  name: string;
  knee: number;
  foreground: Foreground;
  /** Why today's law misses this case (node:test todo), or absent when it meets the band. */
  todo?: string;
}

const QUIET: Foreground = { statementsPerSecond: 30, aloneMs: 0.6, connections: 4 };
const FIGURE_7: Foreground = { statementsPerSecond: 300, aloneMs: 0.6, connections: 4 };
const MANY: Foreground = { statementsPerSecond: 2_000, aloneMs: 0.6, connections: 16 };

const QUIET_MISS =
  "today's law reads the others' load (6 x active, changes / 200), not their harm: 30 statements/s of 0.6 ms read about 1.1-1.2 and their state changes never move, so the rate rises until the harm itself lengthens their statements enough (active = 30/s x 0.6 ms x harm) for the load to leave the raise band, about harm 3.7 by the formula; seeds 1-5 and 41 settled at 1.9-4.5 x the knee, harm 2.3-6.5, the more the higher the knee";
const MANY_MISS = "today's law reads 2,000 statements/s as about 1,600 state changes/s (pressure about 9) and an active share over 1 whatever reaper does: the rate sits at its floor (500 rows/s, 0.03-0.5 x these knees; harm 1.00-1.06), far under what the application would allow";

const CASES: Case[] = [
  { name: 'figure 7 (300 statements/s), knee 600 rows/s: the shape the law was tuned on (it holds its floor, 500, just under this knee)', knee: 600, foreground: FIGURE_7 },
  { name: 'quiet (30 statements/s), knee 1,000 rows/s', knee: 1_000, foreground: QUIET, todo: QUIET_MISS },
  { name: 'quiet (30 statements/s), knee 4,000 rows/s', knee: 4_000, foreground: QUIET, todo: QUIET_MISS },
  { name: 'quiet (30 statements/s), knee 16,000 rows/s', knee: 16_000, foreground: QUIET, todo: QUIET_MISS },
  { name: 'many (2,000 statements/s), knee 1,000 rows/s', knee: 1_000, foreground: MANY, todo: MANY_MISS },
  { name: 'many (2,000 statements/s), knee 4,000 rows/s', knee: 4_000, foreground: MANY, todo: MANY_MISS },
  { name: 'many (2,000 statements/s), knee 16,000 rows/s', knee: 16_000, foreground: MANY, todo: MANY_MISS },
];

for (const one of CASES) {
  test(`simulated database, ${one.name}: settles near the knee (mean rate >= 0.7 x knee, foreground harm <= 1.25)`, { todo: one.todo ?? false }, (t) => {
    const outcome = simulate({ knee: one.knee, foreground: one.foreground });
    const summary = `mean rate ${Math.round(outcome.rowsPerSecond)} rows/s = ${(outcome.rowsPerSecond / one.knee).toFixed(2)} x knee, mean harm ${outcome.harm.toFixed(2)}, shared rate at the end ${Math.round(outcome.rate)}`;
    t.diagnostic(summary);
    assert.ok(outcome.rowsPerSecond >= 0.7 * one.knee, `too slow: ${summary}`);
    assert.ok(outcome.harm <= 1.25, `too harmful: ${summary}`);
  });
}

test('the simulated database itself: the harm is 1.25 at the knee, reaper alone reads nobody, the foreground reads as measured', () => {
  const random = prng(7);
  const database = new SimulatedDatabase(4_000, FIGURE_7, random);
  database.deleted(0, 4_000);
  assert.equal(database.harmAt(500), 1.25);
  assert.equal(database.harmAt(1_500), 1, 'a second later the deletions are out of the window');
  let changes = 0;
  for (let i = 0; i < 2_000; i++) changes += database.sample(2_000).changes;
  assert.ok(changes / 2_000 > 300 && changes / 2_000 < 370, `300 statements/s read as 300-370 state changes/s (pgbench, docs/design.md): ${changes / 2_000}`);
  // Nobody else on the database: the worker finds it alone and runs unthrottled, far above any knee.
  const alone = simulate({ knee: 4_000, foreground: { statementsPerSecond: 0, aloneMs: 0.6, connections: 4 }, seconds: 10 });
  assert.ok(alone.rowsPerSecond > 50_000, `alone: ${Math.round(alone.rowsPerSecond)} rows/s`);
});
