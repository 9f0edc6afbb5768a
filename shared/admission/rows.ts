import { Gauge, type Registry } from 'prom-client';
import type { RowDeletePolicy } from '../config/policies';
import type { Db, Pool } from '../db/pool';
import { admissionRowsEnsure, admissionRowsSlotTry, admissionRowsTake } from '../db/queries/admission';
import { replicationLagRead, replicationLagReadable } from '../db/queries/replication';
import { overrideFor, rowAdmissionWith, type RowAdmission } from './overrides';

/**
 * The row-delete throttle, global across workers (issue 12): a token bucket of ROWS per second
 * kept in cleanup_admission (the same table and controller as remote-delete), a cap on row-delete
 * statements running at once (advisory slots taken inside the deleting transaction), and the
 * replica-lag brake (no admission while a standby's replay lag is over the policy's maximum).
 * A group of batches takes tokens for its item count before its transaction begins.
 */

/** Longest wait between two asks while the bucket is empty, the policy paused or the brake on. */
const MAX_ASK_INTERVAL_MS = 250;
const MIN_ASK_INTERVAL_MS = 5;

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
}
const gaugesByRegistry = new WeakMap<Registry, Gauges>();

/** reaper_replication_lag_seconds and reaper_replication_brake_engaged{policy}, registered on first use. */
export function brakeGauges(registry: Registry): Gauges {
  let gauges = gaugesByRegistry.get(registry);
  if (!gauges) {
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
 * Start-up check of a policy with a brake: the worker's role must read the standbys' lag
 * (pg_read_all_stats), or every standby would read as unknown and the brake would stop every
 * deletion after its grace. Refusing to start names the missing grant instead.
 */
export async function assertBrakeReadable(pool: Pool, policy: RowDeletePolicy): Promise<void> {
  if (!policy.brake) return;
  const { role, readable } = await replicationLagReadable(pool);
  if (!readable) {
    throw new Error(
      `brake.maxReplicationLagSeconds needs the standbys' replay lag, which role "${role}" cannot read: GRANT pg_read_all_stats TO "${role}" (reaper roles --print includes it)`,
    );
  }
}

/**
 * Waits (up to `holdMs`) until the policy may delete `rows` rows: the brake is off, the policy is
 * not paused, and the bucket gave the tokens. Unthrottled and without a brake: admitted at once,
 * no query. Refused after `holdMs`: the caller hands the batches back (delay tier).
 */
export async function admitRows(
  pool: Pool,
  policy: RowDeletePolicy,
  rows: number,
  options: { holdMs: number; registry?: Registry; stopping?: () => boolean; now?: () => number },
): Promise<RowsAdmitted | RowsRefused> {
  const started = performance.now();
  const now = options.now ?? (() => performance.now());
  const maxLag = policy.brake?.maxReplicationLagSeconds ?? null;
  const standbys = policy.brake?.standbys ?? [];
  const gauges = options.registry ? brakeGauges(options.registry) : null;
  for (;;) {
    const admission = rowAdmissionWith(policy, await overrideFor(pool, policy.name));
    if (admission.rowsPerSecond === null && maxLag === null) return { admitted: true, admission, waitedMs: performance.now() - started };
    let reason: RowsRefused['reason'];
    let retryInMs: number;
    if (admission.rowsPerSecond === null) {
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
      const capacity = Math.max(1, admission.burst);
      let known = ensured.get(pool);
      if (!known) ensured.set(pool, (known = new Set()));
      if (!known.has(policy.name)) {
        await admissionRowsEnsure(pool, policy.name, capacity);
        known.add(policy.name);
      }
      const at = now();
      const unknownBrakes = maxLag !== null && unknownLagBrakes(pool, policy, at);
      const take = await admissionRowsTake(pool, { policy: policy.name, rowsPerSecond: admission.rowsPerSecond, capacity, rows, maxLagSeconds: maxLag, standbys, unknownBrakes });
      if (maxLag !== null) noteUnknownLag(pool, policy.name, take.unknownStandbys, at);
      gauges?.lag.set(take.replicationLagSeconds);
      gauges?.unknown.set(take.unknownStandbys.length);
      gauges?.braked.set({ policy: policy.name }, take.braked ? 1 : 0);
      if (take.admitted) return { admitted: true, admission, waitedMs: performance.now() - started };
      reason = take.braked ? 'replica-lag' : take.paused ? 'paused' : 'throttled';
      // The tokens missing arrive at the rate; ask again then (bounded both ways).
      const missing = Math.min(rows, capacity) - take.tokens;
      retryInMs = reason === 'throttled' ? Math.min(MAX_ASK_INTERVAL_MS, Math.max(MIN_ASK_INTERVAL_MS, (missing / admission.rowsPerSecond) * 1000)) : MAX_ASK_INTERVAL_MS;
    }
    const waitedMs = performance.now() - started;
    if (waitedMs + retryInMs > options.holdMs || options.stopping?.()) return { admitted: false, reason, retryInMs: Math.max(retryInMs, 1000), waitedMs };
    await new Promise((resolve) => setTimeout(resolve, retryInMs));
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
