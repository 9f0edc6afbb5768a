/**
 * One worker's side of the adaptive row-delete admission, pure: what it keeps between its takes
 * (WorkerView) and how each event changes it: a start look ends, a take is about to be sent (the
 * step the law proposes), a take came back, a deleting transaction committed. rows.ts does the I/O
 * (pg_stat_activity samples, the take statement) and applies these; a test drives them with a
 * simulated database instead (test/unit/adaptive-simulated.test.ts).
 */
import type { AdaptiveRowsState, AdaptiveRowsTake, OthersSample } from '../db/queries/admission';
import { ADAPTIVE } from './adaptive-constants';
import { adaptiveStartRate, adaptRate, aloneOnDatabase, loadPressureOf, lookStartRate, othersPressureOf, pressureOf, sharedCeilingOf, type LookStart } from './adaptive-law';
import { HARM, harmAlone, harmObserve, harmStep, NO_HARM, type AdaptiveLaw, type HarmReading } from './adaptive-harm';
import { latencyObserve, lookSawSomebody, NO_READING, othersLooked, othersObserve, presenceLooked, type LatencyReading, type LookSums, type OthersLook } from './adaptive-signal';

export interface WorkerView {
  reading: LatencyReading;
  /** The shared state its last take saw, and when (the worker's clock, ms); null before the first. */
  seen: { state: AdaptiveRowsState; at: number } | null;
  /** While reaper has the database to itself: groups until then are admitted without a statement (workerAlone). */
  aloneUntil: number;
  /** When this worker last took (its clock); null before the first. Stale after ADAPTIVE.restartAfterSeconds: it looks first. */
  lastTakeAt: number | null;
  /** A start look's rate (lookStartRate: the floor when busy, graded in the hold band, seenStartRowsPerSecond under it), for the next take to set; null once taken, or when the look saw nobody. */
  looked: LookStart | null;
  /** The harm law's reading (adaptive-harm.ts): the others' statement durations, before reaper deleted and since the last step. */
  harm: HarmReading;
}

export const NEW_WORKER: WorkerView = { reading: NO_READING, seen: null, aloneUntil: 0, lastTakeAt: null, looked: null, harm: NO_HARM };

/** A worker's first admission, or its first after ADAPTIVE.restartAfterSeconds without one (between two runs): it looks at the others first. */
export function lookDue(view: WorkerView, at: number): boolean {
  return view.lastTakeAt === null || at - view.lastTakeAt >= ADAPTIVE.restartAfterSeconds * 1000;
}

/**
 * A start look begun at `at` ended with these sums (lookDone said enough): every look counts towards
 * the presence share; one the law calls busy replaces the reading of the others' load; the next take
 * sets the look's rate (lookStartRate). Not stale again until another pause, whatever that take's outcome.
 */
export function afterLook(view: WorkerView, sums: LookSums, ceiling: number | null, at: number, law: AdaptiveLaw = 'load'): Pick<WorkerView, 'reading' | 'looked' | 'lastTakeAt' | 'harm'> {
  const look = { waiting: sums.waiting / sums.samples, active: sums.active / sums.samples, changes: sums.changes / sums.samples };
  const present = sums.present / sums.samples;
  const looked = law === 'harm' ? harmLookStart(sums, look, ceiling) : lookStartRate({ ...look, present, recent: sums.recent / sums.samples }, ceiling);
  // A look that saw somebody: present at least presenceFull, however few of its samples caught them
  // in a statement (an application at 30 statements/s of 0.6 ms is in one about 2 % of the time, so
  // most looks count none): otherwise the first take's sample of nobody read "alone" and the worker
  // admitted its groups without the rate it was just given (workerAlone; the simulated database,
  // quiet application, 2026-12-07: 72,000 rows/s after a look that started at 2,000).
  const reading = presenceLooked(view.reading, looked ? Math.max(present, ADAPTIVE.presenceFull) : present);
  return { reading: looked?.busy ? othersLooked(reading, look) : reading, looked, lastTakeAt: at, harm: sums.harm };
}

/**
 * The harm law's start: a look that saw another client at all (in a statement or a transaction,
 * running, a state change, or a statement that ended within HARM.aloneAfterSeconds) starts at the floor and climbs from there (adaptive-harm.ts), since
 * the harm reaper does is not known before it deletes: gentle first statements. A look that saw
 * nobody: nothing (null), the takes decide (alone: unthrottled).
 */
function harmLookStart(sums: LookSums, look: OthersLook, ceiling: number | null): LookStart | null {
  if (!lookSawSomebody(sums) && sums.harm.othersAt === null) return null;
  return { rate: Math.min(adaptiveStartRate(ceiling), ADAPTIVE.floorRowsPerSecond), othersPressure: othersPressureOf(look), busy: true };
}

/**
 * Adaptive with no rate set (`rated`) and no brake, once a take has been seen, while the law says
 * alone (no other client seen, the pressure quiet): an admitted take lets this worker's groups of
 * the next ADAPTIVE.aloneProbeSeconds through without a statement each (afterAdmitted); the next
 * take after that is the probe that samples the database again. The shared rate is not in force
 * meanwhile and does not step: when another client appears, reaper goes on from the stored rate.
 * There is nobody to be gentle to, and an admission statement per group of a few hundred rows, and
 * the asking again of refused ones, was most of reaper's own cost per row (bench `--only cost`,
 * quick: 3.2 PostgreSQL CPU s per 100k rows with it, 1.35 with adaptive off). Once another client
 * is seen, every group asks again.
 */
export function workerAlone(view: WorkerView, limits: { rated: boolean; braked: boolean }, law: AdaptiveLaw = 'load'): boolean {
  // The harm law: alone when no other client's statement has ended, and none was in one, for HARM.aloneAfterSeconds.
  return !limits.rated && !limits.braked && view.seen !== null && (law === 'harm' ? harmAlone(view.harm) : aloneOnDatabase(view.reading));
}

/**
 * The adaptive part of a take about to be sent at `at`: after a look that was not quiet, its rate
 * (restart: a new rate, or one from another moment); else a step proposal when the last step (of
 * any worker) is at least ADAPTIVE.stepMs old and this worker has a new statement to judge by; the
 * take stores it only if no other worker stepped since (adapted_at). Alone the rate is not in force
 * and is left where it is: the probe's own sample may show another client, and the next take then
 * steps on all it has read since. `next`: the view's change (applied before the take is sent).
 */
export function takeToSend(view: WorkerView, ceiling: number | null, at: number, alone: boolean, law: AdaptiveLaw = 'load'): { take: AdaptiveRowsTake; next: Partial<WorkerView> } {
  const { take, next } = proposeTake(view, ceiling, at, alone, law);
  // The harm law's take also returns the durations of the others' statements that ended since this worker's last sample.
  return { take: law === 'harm' ? { ...take, since: view.harm.since } : take, next };
}

function proposeTake(view: WorkerView, ceiling: number | null, at: number, alone: boolean, law: AdaptiveLaw): { take: AdaptiveRowsTake; next: Partial<WorkerView> } {
  if (view.looked) {
    return { take: { startRate: view.looked.rate, proposal: null, restart: { staleSeconds: ADAPTIVE.restartAfterSeconds, pressure: view.looked.othersPressure } }, next: { looked: null } };
  }
  const startRate = adaptiveStartRate(ceiling);
  const { seen } = view;
  const pressure = pressureOf(view.reading);
  const hold = { take: { startRate, proposal: null }, next: {} };
  if (!seen || (pressure === null && law === 'load') || alone) return hold;
  const elapsedSeconds = seen.state.sinceStepSeconds + Math.max(0, at - seen.at) / 1000;
  if (elapsedSeconds * 1000 < (law === 'harm' ? HARM.stepSeconds * 1000 : ADAPTIVE.stepMs)) return hold;
  if (law === 'harm') {
    const step = harmStep(seen.state.rate, view.harm, ceiling);
    if (!step) return hold;
    return { take: { startRate, proposal: { rate: step.rate, pressure: step.harm, seenAdaptedAt: seen.state.adaptedAt } }, next: { harm: step.reading } };
  }
  const admittedRowsPerSecond = seen.state.admittedSinceStep / Math.max(elapsedSeconds, 0.001);
  const step = adaptRate({ rate: seen.state.rate, pressure: pressure!, loadPressure: loadPressureOf(view.reading), ceiling, sharedCeiling: sharedCeilingOf(view.reading), elapsedSeconds, admittedRowsPerSecond });
  return { take: { startRate, proposal: { rate: step.rate, pressure, seenAdaptedAt: seen.state.adaptedAt } }, next: { reading: { ...view.reading, fresh: 0 } } };
}

/** A take sent at `at` came back with the shared state (null: not adaptive, or no row) and its sample of the others. */
export function afterTake(view: WorkerView, state: AdaptiveRowsState | null, at: number): Partial<WorkerView> {
  if (!state) return { lastTakeAt: at };
  const others = { waiting: state.othersWaiting, active: state.othersActive, changes: state.othersChanges, present: state.othersPresent, recent: state.othersRecent };
  const harm = harmObserve(view.harm, { finishedMs: state.othersFinishedMs, at: state.sampledAt, present: state.othersPresent }, false);
  return { lastTakeAt: at, seen: { state, at }, reading: othersObserve(view.reading, others), harm };
}

/** A sample of the others while the worker waits for tokens (the harm law: HARM.sampleMs). */
export function afterSample(view: WorkerView, sample: OthersSample): Pick<WorkerView, 'harm'> {
  return { harm: harmObserve(view.harm, { finishedMs: sample.finishedMs, at: sample.at, present: sample.present }, false) };
}

/** The take admitted at `now`: alone, the groups of the next ADAPTIVE.aloneProbeSeconds go without a statement. */
export function afterAdmitted(alone: boolean, now: number): Pick<WorkerView, 'aloneUntil'> {
  return { aloneUntil: alone ? now + ADAPTIVE.aloneProbeSeconds * 1000 : 0 };
}

/** A deleting transaction of `rows` rows committed in `ms`, at `at` (the worker's clock). */
export function afterStatement(view: WorkerView, sample: { ms: number; rows: number; at: number }): Pick<WorkerView, 'reading'> {
  return { reading: latencyObserve(view.reading, sample) };
}
