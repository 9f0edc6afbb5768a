/**
 * A simulated database for the adaptive admission's laws (issue 41 items 3 and 6): a foreground
 * application on `connections` connections, harmed by reaper's deletions, and what PostgreSQL's
 * pg_stat_activity would show a worker of it. Never the harm itself: the law has to infer it.
 *
 * The foreground. Each connection runs statements one after another with an exponential pause
 * between them (an open-ish load of `statementsPerSecond` in all). A statement that starts at t takes
 * aloneMs x harm(t) x noise, noise log-normal with spread `spread` (log), harm(t) = 1 + 0.25 x
 * (r / knee)^2 with r the rows reaper deleted over the second before t: the knee is what bench
 * figure 7b calls it, the highest rate at which the foreground's statements take at most 1.25 x their
 * own alone (harm 2 at twice the knee). `waitShare` of a harmed statement's extra time shows as a
 * wait event (IO:WALSync); `hiddenShare` (0 to 1) of the harm lands not in the statement but in the
 * pause after it (the client waits, e.g. a commit acknowledged late, invisible to pg_stat_activity):
 * a foreground whose harm the statement durations show only in part.
 *
 * What a sample shows (pg_stat_activity, other client sessions): per session its state (active or
 * idle), wait_event_type, query_start and state_change; from those the observables the SQL computes
 * (shared/db/queries/admission.ts OTHER_CLIENTS_COUNTS): waiting, active, present, state changes
 * within the last 5 ms per second, sessions that started or ended a statement within the last second
 * (recent), and the durations (state_change - query_start) of the idle
 * sessions' last statements that ended after `since` (null: within the last second, HARM.aloneAfterSeconds, as the SQL).
 */
import { ADAPTIVE } from '../../shared/admission/adaptive-constants';
import type { OthersSample } from '../../shared/db/queries/admission';

export interface Foreground {
  statementsPerSecond: number;
  aloneMs: number;
  connections: number;
  /** Log-normal spread of a statement's duration (0.3 unless said). */
  spread?: number;
  /** Share of the harm that lands outside the statement (0 unless said). */
  hiddenShare?: number;
}

interface Session {
  start: number;
  end: number;
  /** The previous statement (what pg_stat_activity shows while this one has not started). */
  lastStart: number | null;
  lastEnd: number | null;
}

export interface SimulatedSample extends OthersSample {
  /** Durations (ms) of the statements that ended after `since` (the idle sessions' last ones). */
  finishedMs: number[];
  /** The sample's clock (ms). */
  at: number;
}

const CHANGE_WINDOW_MS = 5;
/** ADAPTIVE.lookRecentSeconds, as the SQL counts it. */
const RECENT_MS = ADAPTIVE.lookRecentSeconds * 1000;

export class SimulatedDatabase {
  /** Reaper's deletions: time and cumulative rows, for the rate over any second (binary search). */
  private readonly times: number[] = [];
  private readonly cumulative: number[] = [];
  private readonly sessions: Session[];
  private readonly pauseMs: number;

  constructor(
    readonly knee: number,
    readonly foreground: Foreground,
    private readonly random: () => number,
  ) {
    this.pauseMs = foreground.statementsPerSecond > 0 ? (foreground.connections * 1000) / foreground.statementsPerSecond : Number.POSITIVE_INFINITY;
    this.sessions = Array.from({ length: foreground.connections }, () => {
      // The application ran before reaper started (5 s before the worker's clock starts at 0).
      const start = -5_000 + this.exponential(this.pauseMs);
      return { start, end: start + this.durationAt(start), lastStart: null, lastEnd: null };
    });
  }

  private exponential(mean: number): number {
    return -mean * Math.log(1 - this.random());
  }

  private normal(): number {
    return Math.sqrt(-2 * Math.log(1 - this.random())) * Math.cos(2 * Math.PI * this.random());
  }

  private rowsBefore(at: number): number {
    let low = 0;
    let high = this.times.length;
    while (low < high) {
      const mid = (low + high) >> 1;
      if (this.times[mid]! <= at) low = mid + 1;
      else high = mid;
    }
    return low === 0 ? 0 : this.cumulative[low - 1]!;
  }

  /** rows/s reaper deleted over the second before `at`. */
  rateAt(at: number): number {
    return this.rowsBefore(at) - this.rowsBefore(at - 1000);
  }

  /** The hidden truth: how many times its alone duration a foreground statement starting at `at` takes, pause included. */
  harmAt(at: number): number {
    return 1 + 0.25 * (this.rateAt(at) / this.knee) ** 2;
  }

  deleted(at: number, rows: number): void {
    if (this.times.length > 0 && at < this.times[this.times.length - 1]!) throw new Error('deletions out of order');
    this.times.push(at);
    this.cumulative.push((this.cumulative[this.cumulative.length - 1] ?? 0) + rows);
  }

  private durationAt(start: number): number {
    const { aloneMs, spread = 0.3, hiddenShare = 0 } = this.foreground;
    const harm = this.harmAt(start);
    return aloneMs * (1 + (harm - 1) * (1 - hiddenShare)) * Math.exp(spread * this.normal() - (spread * spread) / 2);
  }

  private advance(session: Session, at: number): void {
    while (session.end <= at) {
      const { aloneMs, hiddenShare = 0 } = this.foreground;
      const hidden = aloneMs * (this.harmAt(session.end) - 1) * hiddenShare;
      const start = session.end + hidden + this.exponential(this.pauseMs);
      session.lastStart = session.start;
      session.lastEnd = session.end;
      session.start = start;
      session.end = start + this.durationAt(start);
      if (session.start > at) break;
    }
  }

  /** One read of pg_stat_activity's other client sessions at `at` (never earlier than a previous one's): the counts and the durations ended after `since`. */
  sample(at: number, since: number | null): SimulatedSample {
    let active = 0;
    let waiting = 0;
    let changes = 0;
    let recent = 0;
    const finishedMs: number[] = [];
    for (const session of this.sessions) {
      this.advance(session, at);
      const running = session.start <= at && at < session.end;
      if (running) {
        active += 1;
        const harm = this.harmAt(session.start);
        if (this.random() < (harm - 1) / harm) waiting += 1;
        if (at - session.start <= CHANGE_WINDOW_MS) changes += 1;
        if (at - session.start <= RECENT_MS) recent += 1;
      } else {
        const start = session.start <= at ? session.start : session.lastStart;
        const end = session.start <= at ? session.end : session.lastEnd;
        if (start !== null && end !== null) {
          if (at - end <= CHANGE_WINDOW_MS) changes += 1;
          if (at - end <= RECENT_MS) recent += 1;
          if (end > (since ?? at - 1_000)) finishedMs.push(end - start);
        }
      }
    }
    return { waiting, active, present: active, changes: changes * (1000 / CHANGE_WINDOW_MS), recent, finishedMs, at };
  }
}
