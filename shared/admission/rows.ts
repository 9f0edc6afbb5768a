import type { Gauge, Registry } from 'prom-client';
import { promClient } from '../lazy-modules';
import type { RowDeletePolicy } from '../config/policies';
import type { Db, Pool } from '../db/pool';
import { admissionOthersSample, admissionRowsEnsure, admissionRowsSlotTry, admissionRowsTake, type AdaptiveRowsTake } from '../db/queries/admission';
import { replicationLagRead, replicationLagReadable } from '../db/queries/replication';
import {
  ADAPTIVE,
  HARM,
  adaptiveStartRate,
  afterAdmitted,
  afterLook,
  afterSample,
  afterStatement,
  afterTake,
  lookAdd,
  lookDone,
  lookGapMs,
  lookDue,
  NEW_WORKER,
  NO_LOOK,
  NO_READING,
  sharedCeilingInForce,
  statementRows,
  takeToSend,
  workerAlone,
  type AdaptiveLaw,
  type WorkerView,
} from './adaptive';
import { overrideFor, pausedFor, rowAdmissionWith, type RowAdmission } from './overrides';

/**
 * The row-delete throttle, global across workers (issue 12): a token bucket of ROWS per second
 * kept in cleanup_admission (the same table and controller as remote-delete), a cap on row-delete
 * statements running at once (advisory slots taken inside the deleting transaction), and the
 * replica-lag brake (no admission while a standby's replay lag is over the policy's maximum).
 * A group of batches takes tokens for its item count before its transaction begins.
 *
 * Adaptive admission (issue 18, on unless `admission: { adaptive: false }`): the bucket's rate is
 * the shared adaptive rate kept in the same row (at most rowsPerSecond when set), stepped by the
 * control law in adaptive.ts from what each worker sees of its own statements (noteRowStatement)
 * and of the other backends' waits (read by the take itself). This file does the I/O and applies
 * what the pure worker view (adaptive-worker.ts) decides; the SQL is in db/queries/admission.ts.
 */

/** Longest wait between two asks while the bucket is empty, the policy paused or the brake on. */
const MAX_ASK_INTERVAL_MS = 250;
const MIN_ASK_INTERVAL_MS = 5;
/**
 * Longest wait between two asks of a throttled group: it asks again when its missing tokens should
 * have arrived at the rate it read, but not later than this, so a rate raised meanwhile (an adaptive
 * step by another worker, `reaper admission set`) is used within a second. Every
 * ask is a write under the bucket row's lock and a commit: with 250 ms, at the adaptive floor (500
 * rows/s, one batch of 500 per statement) the waiting groups of two workers asked 15-45 times a
 * second for one admitted statement (bench figure 7, 2026-12-03), on the database the application
 * was using.
 */
const MAX_THROTTLED_ASK_INTERVAL_MS = 1_000;

export interface RowsAdmitted {
  admitted: true;
  /** What was in force for this grant (the slot step uses its concurrency). */
  admission: RowAdmission;
  waitedMs: number;
}

export interface RowsRefused {
  admitted: false;
  reason: 'throttled' | 'paused' | 'replica-lag';
  /** A good time to ask again. */
  retryInMs: number;
  waitedMs: number;
}

interface Gauges {
  lag: Gauge<never>;
  unknown: Gauge<never>;
  braked: Gauge<'policy'>;
  rate: Gauge<'policy'>;
  latencyRatio: Gauge<'policy'>;
  othersWaiting: Gauge<'policy'>;
  othersActive: Gauge<'policy'>;
  othersChanges: Gauge<'policy'>;
  sharedCeiling: Gauge<'policy'>;
}
const gaugesByRegistry = new WeakMap<Registry, Gauges>();

/** reaper_replication_lag_seconds and reaper_replication_brake_engaged{policy}, registered on first use. */
export function brakeGauges(registry: Registry): Gauges {
  let gauges = gaugesByRegistry.get(registry);
  if (!gauges) {
    const { Gauge } = promClient();
    gauges = {
      lag: new Gauge({ name: 'reaper_replication_lag_seconds', help: "Largest known physical standby replay lag seen by this worker's last row-delete admission (pg_stat_replication)", registers: [registry] }),
      unknown: new Gauge({
        name: 'reaper_replication_lag_unknown_standbys',
        help: "Standbys whose replay lag this worker's last row-delete admission could not read (disconnected, not reporting): braked after the policy's grace",
        registers: [registry],
      }),
      braked: new Gauge({
        name: 'reaper_replication_brake_engaged',
        help: 'row-delete: 1 while the replica-lag brake stops admission (lag over brake.maxReplicationLagSeconds)',
        labelNames: ['policy'],
        registers: [registry],
      }),
      rate: new Gauge({
        name: 'reaper_row_admission_rate',
        help: "row-delete: rows/s the policy's global bucket refills at, as this worker last read it (adaptive: the shared adaptive rate, at most admission.rowsPerSecond; fixed: rowsPerSecond)",
        labelNames: ['policy'],
        registers: [registry],
      }),
      latencyRatio: new Gauge({
        name: 'reaper_row_admission_latency_ratio',
        help: "row-delete adaptive admission: this worker's smoothed latency of its deleting transactions / their quiet-time latency (1: quiet; the rate backs off at 2)",
        labelNames: ['policy'],
        registers: [registry],
      }),
      othersWaiting: new Gauge({
        name: 'reaper_row_admission_others_waiting',
        help: 'row-delete adaptive admission: smoothed count of other client backends of the database seen waiting on a lock or on IO at admission (pg_stat_activity)',
        labelNames: ['policy'],
        registers: [registry],
      }),
      othersActive: new Gauge({
        name: 'reaper_row_admission_others_active',
        help: "row-delete adaptive admission: smoothed count of other client backends of the database seen running a statement at admission (pg_stat_activity): the share of the database's time the application keeps it busy (the rate backs off above 0.17)",
        labelNames: ['policy'],
        registers: [registry],
      }),
      sharedCeiling: new Gauge({
        name: 'reaper_row_admission_shared_ceiling',
        help: "row-delete adaptive admission (the default load law): the most rows/s the rate steps to while other clients share the database, as this worker last read it: its deleting transactions busy at most 0.08 of a backend's time at their quiet-time ms per row, within the floor and admission.rowsPerSecond (0: nobody else seen, no transaction yet, or the harm law)",
        labelNames: ['policy'],
        registers: [registry],
      }),
      othersChanges: new Gauge({
        name: 'reaper_row_admission_others_changes_per_second',
        help: "row-delete adaptive admission: smoothed state changes per second of the other client backends of the database (a statement started or ended, pg_stat_activity.state_change within the last 5 ms at admission): about the application's statements per second (the rate backs off above 200)",
        labelNames: ['policy'],
        registers: [registry],
      }),
    };
    gaugesByRegistry.set(registry, gauges);
  }
  return gauges;
}

const ensured = new WeakMap<Pool, Set<string>>();

/**
 * The brake fails closed: a standby whose lag is unknown brakes once it has been unknown for the
 * policy's `unknownLagGraceSeconds` (a standby reconnecting, or between its WAL replies, is unknown
 * for a moment). Per pool and policy: when this process first read an unknown lag with no known
 * read since. A new process starts its grace again.
 */
const unknownSince = new WeakMap<Pool, Map<string, number>>();
/** `brake.unknownLagGraceSeconds` when the policy does not say. */
const DEFAULT_UNKNOWN_LAG_GRACE_SECONDS = 30;

function unknownLagBrakes(pool: Pool, policy: RowDeletePolicy, now: number): boolean {
  const since = unknownSince.get(pool)?.get(policy.name) ?? now;
  return now - since >= (policy.brake?.unknownLagGraceSeconds ?? DEFAULT_UNKNOWN_LAG_GRACE_SECONDS) * 1000;
}

function noteUnknownLag(pool: Pool, policy: string, unknown: readonly string[], now: number): void {
  let byPolicy = unknownSince.get(pool);
  if (!byPolicy) unknownSince.set(pool, (byPolicy = new Map()));
  if (unknown.length === 0) byPolicy.delete(policy);
  else if (!byPolicy.has(policy)) byPolicy.set(policy, now);
}

/**
 * Start-up check of a row-delete policy whose brake or adaptive admission (the default) reads
 * server statistics: the standbys' replay lag (pg_stat_replication) and other sessions' state
 * (pg_stat_activity), which PostgreSQL shows another role only through pg_read_all_stats. Without
 * it the brake would read every standby as unknown and stop every deletion after its grace, and
 * adaptive admission would see nobody and admit without a rate (issue 40). One query for both;
 * refusing to start names the missing grant and what needs it.
 */
export async function assertStatisticsReadable(pool: Pool, policy: RowDeletePolicy): Promise<void> {
  const needs = [
    policy.brake ? "brake.maxReplicationLagSeconds needs the standbys' replay lag" : null,
    adaptiveAdmission(policy) ? "adaptive admission (the default) reads other sessions' state in pg_stat_activity" : null,
  ].filter((need): need is string => need !== null);
  if (needs.length === 0) return;
  const { role, readable } = await replicationLagReadable(pool);
  if (!readable) {
    throw new Error(
      `${needs.join(', and ')}, which role "${role}" cannot read: GRANT pg_read_all_stats TO "${role}" (reaper roles --print includes it)${adaptiveAdmission(policy) ? ', or set admission: { adaptive: false }' : ''}`,
    );
  }
}

/** Adaptive admission is the default: `admission: { adaptive: false }` turns it off. */
export function adaptiveAdmission(policy: RowDeletePolicy): boolean {
  return policy.admission?.adaptive !== false;
}

/**
 * One worker's view of the adaptive rate, per pool and policy (adaptive-worker.ts), kept as one
 * object that the pure functions' changes are applied to (Object.assign), so that concurrent
 * admissions and statements of the worker see each other's changes; and the start look under way.
 */
interface Observer extends WorkerView {
  /** The start look under way (concurrent admissions of one worker wait for the one look). */
  looking: Promise<void> | null;
}
const observers = new WeakMap<Pool, Map<string, Observer>>();

function observerFor(pool: Pool, policy: string): Observer {
  let byPolicy = observers.get(pool);
  if (!byPolicy) observers.set(pool, (byPolicy = new Map()));
  let observer = byPolicy.get(policy);
  if (!observer) byPolicy.set(policy, (observer = { ...NEW_WORKER, looking: null }));
  return observer;
}

/**
 * The row-delete handler reports each committed deleting transaction here: `ms` from holding its
 * statement slot to COMMIT (the DELETE and its WAL flush; slot waits left out) for `rows` rows. The next admission of this worker judges the database by it. No-op when
 * the policy's admission is not adaptive. `at`: the caller's performance.now() (tests move it).
 */
export function noteRowStatement(pool: Pool, policy: RowDeletePolicy, sample: { ms: number; rows: number; at?: number }): void {
  if (!adaptiveAdmission(policy)) return;
  const observer = observerFor(pool, policy.name);
  Object.assign(observer, afterStatement(observer, { ms: sample.ms, rows: sample.rows, at: sample.at ?? performance.now() }));
}

/**
 * The most rows one deleting statement (a chunk of a coalesced group) may take: throttled, one
 * bucket (the burst); adaptive with no rate set, statementRows (one batch while other clients share
 * the database; alone, what the shared rate admits in ADAPTIVE.statementSeconds as this worker last
 * read it); otherwise no limit.
 */
export function maxRowsPerStatement(pool: Pool, policy: RowDeletePolicy, inForce: RowAdmission): number {
  if (inForce.rowsPerSecond !== null) return inForce.burst;
  if (!adaptiveAdmission(policy)) return Number.POSITIVE_INFINITY;
  // Before this worker's first take nothing is known of the others: one batch (statementRows with
  // no reading). It was no limit: a worker's first group went as one statement of up to prefetch x
  // batch rows, admitted by one take of a one-batch bucket that then stayed in debt for n / rate
  // seconds (bench figure 7b, 2026-12-06: 2,500-9,000 rows in the first second with the rate read
  // at the floor from the start, then nothing; a run of 15,000 rows went whole in the first groups).
  const observer = observers.get(pool)?.get(policy.name);
  return statementRows(observer?.reading ?? NO_READING, observer?.seen?.state.rate ?? adaptiveStartRate(null), policy.batchSize);
}

/**
 * A worker's first admission, or its first after ADAPTIVE.restartAfterSeconds without one (between
 * two runs): it looks at the other clients first (ADAPTIVE.startLookSamples samples of
 * pg_stat_activity, one autocommit statement each, so each reads it afresh; lookDone ends it after
 * ADAPTIVE.startLookQuietSamples when those saw nobody at all). When it saw anybody
 * (lookStartRate), the next take starts a new rate, or one nobody stepped for that long, at the
 * look's rate: the floor when busy, graded in the hold band, seenStartRowsPerSecond under it. About 0.2 s once per run and worker
 * (0.04 s on a database nobody else uses); concurrent admissions of the worker share the one look.
 */
async function lookIfStale(pool: Pool, observer: Observer, ceiling: number | null, at: number, law: AdaptiveLaw): Promise<void> {
  if (!lookDue(observer, at)) return;
  observer.looking ??= (async () => {
    let sums = NO_LOOK;
    while (!lookDone(sums.samples, sums, law)) {
      if (sums.samples > 0) await new Promise((resolve) => setTimeout(resolve, lookGapMs(sums.samples)));
      sums = lookAdd(sums, await admissionOthersSample(pool, law === 'harm' ? sums.harm.since : undefined));
    }
    Object.assign(observer, afterLook(observer, sums, ceiling, at, law));
  })().finally(() => {
    observer.looking = null;
  });
  await observer.looking;
}

/**
 * Per pool and policy, while admissions are queued in this process: the end of the last one
 * (admitRows takes turns behind it), and why the last refused ask was refused (what a group that
 * gave up waiting for its turn reports). Gone when the queue is empty.
 */
interface Turns {
  end: Promise<void>;
  lastRefusal: RowsRefused['reason'] | null;
}
const turns = new WeakMap<Pool, Map<string, Turns>>();

/**
 * Waits (up to `holdMs`) until the policy may delete `rows` rows: the brake is off, the policy is
 * not paused, and the bucket gave the tokens. Not adaptive, unthrottled and without a brake: admitted at once,
 * no query. Refused after `holdMs`: the caller hands the batches back (delay tier).
 *
 * The groups of one worker (one pool) ask for one policy in turn, oldest first: a group waiting for
 * tokens is the worker's one asker, and the next asks only once it is admitted or refused, so the
 * oldest group goes first and a worker never asks twice at once for the same tokens (every ask is
 * an UPDATE and a commit on the application's database). Waiting for the turn counts in the group's
 * hold budget; one that runs out of it waiting is refused for the reason of the last refused ask
 * here (the one in turn is still asking, refused for that reason). At the adaptive floor most of
 * the asks were a group's later chunks asking one after another (row-delete.ts); the turns alone
 * changed the count little (bench figure 7's statement log, docs/design.md).
 */
export async function admitRows(
  pool: Pool,
  policy: RowDeletePolicy,
  rows: number,
  options: { holdMs: number; registry?: Registry; stopping?: () => boolean; now?: () => number },
): Promise<RowsAdmitted | RowsRefused> {
  const started = performance.now();
  let byPolicy = turns.get(pool);
  if (!byPolicy) turns.set(pool, (byPolicy = new Map()));
  let queue = byPolicy.get(policy.name);
  if (!queue) byPolicy.set(policy.name, (queue = { end: Promise.resolve(), lastRefusal: null }));
  const before = queue.end;
  let done!: () => void;
  const mine = new Promise<void>((resolve) => (done = resolve));
  // The next in line waits for this one's turn and this one's end: one that gives up waiting
  // still keeps its place until the ones before it are through.
  const end = before.then(() => mine);
  queue.end = end;
  let timer: NodeJS.Timeout | undefined;
  try {
    const myTurn = await Promise.race([before.then(() => true), new Promise<false>((resolve) => (timer = setTimeout(() => resolve(false), options.holdMs)))]);
    if (!myTurn) return { admitted: false, reason: queue.lastRefusal ?? 'throttled', retryInMs: 1000, waitedMs: performance.now() - started };
    return await admitRowsInTurn(pool, policy, rows, options, started, queue);
  } finally {
    clearTimeout(timer);
    done();
    if (queue.end === end) byPolicy.delete(policy.name);
  }
}

async function admitRowsInTurn(
  pool: Pool,
  policy: RowDeletePolicy,
  rows: number,
  options: { holdMs: number; registry?: Registry; stopping?: () => boolean; now?: () => number },
  started: number,
  queue: Turns,
): Promise<RowsAdmitted | RowsRefused> {
  const now = options.now ?? (() => performance.now());
  const maxLag = policy.brake?.maxReplicationLagSeconds ?? null;
  const standbys = policy.brake?.standbys ?? [];
  const gauges = options.registry ? brakeGauges(options.registry) : null;
  const adaptive = adaptiveAdmission(policy);
  const law = policy.admission?.law ?? 'load';
  for (;;) {
    const admission = rowAdmissionWith(policy, await overrideFor(pool, policy.name));
    // `reaper pause <policy>`: nothing is admitted, whatever the rate (an unthrottled or "alone"
    // policy takes no token, so the pause is checked here, before any shortcut).
    const paused = await pausedFor(pool, policy.name);
    if (!paused && admission.rowsPerSecond === null && maxLag === null && !adaptive) return { admitted: true, admission, waitedMs: performance.now() - started };
    let reason: RowsRefused['reason'];
    let retryInMs: number;
    if (paused) {
      reason = 'paused';
      retryInMs = MAX_ASK_INTERVAL_MS;
    } else if (admission.rowsPerSecond === null && !adaptive) {
      // A brake without a rate: only the lag is read.
      const at = now();
      const lag = await replicationLagRead(pool, { standbys });
      const braked = lag.lagSeconds > maxLag! || (lag.unknown.length > 0 && unknownLagBrakes(pool, policy, at));
      noteUnknownLag(pool, policy.name, lag.unknown, at);
      gauges?.lag.set(lag.lagSeconds);
      gauges?.unknown.set(lag.unknown.length);
      gauges?.braked.set({ policy: policy.name }, braked ? 1 : 0);
      if (!braked) return { admitted: true, admission, waitedMs: performance.now() - started };
      reason = 'replica-lag';
      retryInMs = MAX_ASK_INTERVAL_MS;
    } else {
      const observer = adaptive ? observerFor(pool, policy.name) : null;
      if (observer) await lookIfStale(pool, observer, admission.rowsPerSecond, now(), law);
      const alone = observer !== null && workerAlone(observer, { rated: admission.rowsPerSecond !== null, braked: policy.brake?.maxReplicationLagSeconds !== undefined }, law);
      if (alone && observer.aloneUntil > now()) return { admitted: true, admission, waitedMs: performance.now() - started };
      const capacity = Math.max(1, admission.burst);
      let known = ensured.get(pool);
      if (!known) ensured.set(pool, (known = new Set()));
      if (!known.has(policy.name)) {
        await admissionRowsEnsure(pool, policy.name, capacity);
        known.add(policy.name);
      }
      const at = now();
      const unknownBrakes = maxLag !== null && unknownLagBrakes(pool, policy, at);
      let adaptiveTake: AdaptiveRowsTake | null = null;
      if (observer) {
        const { take, next } = takeToSend(observer, admission.rowsPerSecond, at, alone, law);
        Object.assign(observer, next);
        adaptiveTake = take;
      }
      const take = await admissionRowsTake(pool, {
        policy: policy.name,
        rowsPerSecond: admission.rowsPerSecond,
        capacity,
        rows,
        maxLagSeconds: maxLag,
        standbys,
        unknownBrakes,
        adaptive: adaptiveTake,
      });
      if (maxLag !== null) noteUnknownLag(pool, policy.name, take.unknownStandbys, at);
      gauges?.lag.set(take.replicationLagSeconds);
      gauges?.unknown.set(take.unknownStandbys.length);
      gauges?.braked.set({ policy: policy.name }, take.braked ? 1 : 0);
      let rate = admission.rowsPerSecond ?? ADAPTIVE.maxRowsPerSecond;
      if (observer) Object.assign(observer, afterTake(observer, take.adaptive, at));
      if (observer && take.adaptive) {
        rate = Math.min(rate, take.adaptive.rate);
        gauges?.latencyRatio.set({ policy: policy.name }, observer.reading.ratio ?? 1);
        gauges?.othersWaiting.set({ policy: policy.name }, observer.reading.othersWaiting ?? 0);
        gauges?.othersActive.set({ policy: policy.name }, observer.reading.othersActive ?? 0);
        gauges?.othersChanges.set({ policy: policy.name }, observer.reading.othersChanges ?? 0);
        gauges?.sharedCeiling.set({ policy: policy.name }, law === 'load' ? (sharedCeilingInForce(observer.reading, admission.rowsPerSecond) ?? 0) : 0);
      }
      gauges?.rate.set({ policy: policy.name }, rate);
      if (take.admitted) {
        if (observer) Object.assign(observer, afterAdmitted(alone, now()));
        return { admitted: true, admission, waitedMs: performance.now() - started };
      }
      reason = take.braked ? 'replica-lag' : take.paused ? 'paused' : 'throttled';
      // The tokens missing arrive at the rate; ask again then (bounded both ways).
      const missing = Math.min(rows, capacity) - take.tokens;
      retryInMs = reason === 'throttled' ? Math.min(MAX_THROTTLED_ASK_INTERVAL_MS, Math.max(MIN_ASK_INTERVAL_MS, (missing / rate) * 1000)) : MAX_ASK_INTERVAL_MS;
    }
    queue.lastRefusal = reason;
    const waitedMs = performance.now() - started;
    if (waitedMs + retryInMs > options.holdMs || options.stopping?.()) return { admitted: false, reason, retryInMs: Math.max(retryInMs, 1000), waitedMs };
    await waitSampling(pool, adaptive && law === 'harm' ? observerFor(pool, policy.name) : null, retryInMs);
  }
}

/**
 * Waits `ms`; the harm law (`observer` given) samples the other clients every HARM.sampleMs
 * meanwhile (one read of pg_stat_activity each, no write), so that its durations are not only
 * those of the moments its takes follow reaper's own statements (adaptive-harm.ts).
 */
async function waitSampling(pool: Pool, observer: Observer | null, ms: number): Promise<void> {
  const until = performance.now() + ms;
  for (;;) {
    const left = until - performance.now();
    if (left <= 0) return;
    await new Promise((resolve) => setTimeout(resolve, observer ? Math.min(left, HARM.sampleMs) : left));
    if (!observer || performance.now() >= until) return;
    // A sample is an extra look, not the take: one that fails (a busy pool, a lost link) is skipped,
    // never the batch's failure; the take itself still reports its own errors.
    const sample = await admissionOthersSample(pool, observer.harm.since).catch(() => null);
    if (sample) Object.assign(observer, afterSample(observer, sample));
  }
}

/**
 * Takes one of the policy's `concurrency` statement slots inside the caller's open transaction, or
 * answers false at once: it never waits inside the transaction (docs/design.md invariant 18); the
 * caller ends the transaction and asks again (untilRowSlot). No cap: nothing to take. The slot is an
 * advisory transaction lock: COMMIT, ROLLBACK or a dead connection frees it.
 */
export async function takeRowSlot(client: Db, policy: string, concurrency: number | null): Promise<boolean> {
  if (concurrency === null) return true;
  return (await admissionRowsSlotTry(client, policy, concurrency)) !== null;
}

/**
 * Runs `attempt` (one whole transaction that starts with takeRowSlot and answers 'no-slot' when
 * every slot is in use) until it gets a slot or `until` (performance.now() clock) has passed. The
 * waits between attempts happen with no transaction open: a worker waiting for a slot holds no
 * snapshot, no lock and no "idle in transaction" connection.
 */
export async function untilRowSlot<T>(attempt: () => Promise<T | 'no-slot'>, options: { until: number; stopping?: (() => boolean) | undefined }): Promise<T | 'no-slot'> {
  for (let tries = 0; ; tries++) {
    const result = await attempt();
    if (result !== 'no-slot') return result;
    const pauseMs = Math.min(50, 2 * 2 ** tries);
    if (performance.now() + pauseMs > options.until || options.stopping?.()) return 'no-slot';
    await new Promise((resolve) => setTimeout(resolve, pauseMs));
  }
}
