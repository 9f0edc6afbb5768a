import type { AnyRemoteDeletePolicy, Policy, RemoteDeletePolicy, RowDeletePolicy } from '../config/policies';
import type { Db, Pool } from '../db/pool';
import { admissionOverridesRead, admissionPausedRead, type AdmissionOverride } from '../db/queries/admission';

/**
 * Live admission control: `reaper admission set` stores an override in PostgreSQL
 * (cleanup_admission_overrides); every worker reads it at most OVERRIDE_REFRESH_MS later, so a
 * change takes effect within a second on every worker, without a restart. `reset` deletes the row
 * and the file's values are in force again.
 */
export const OVERRIDE_REFRESH_MS = 500;

interface Cached {
  readAt: number;
  value: Promise<Map<string, AdmissionOverride>>;
}

const caches = new WeakMap<Pool, Cached>();

/** The overrides in force, read again when the last read is older than OVERRIDE_REFRESH_MS (one query for all policies). */
export async function overrideFor(pool: Pool, policy: string): Promise<AdmissionOverride | null> {
  let cached = caches.get(pool);
  const now = performance.now();
  if (!cached || now - cached.readAt > OVERRIDE_REFRESH_MS) {
    const value = admissionOverridesRead(pool).then((rows) => new Map(rows.map((row) => [row.policy, row])));
    cached = { readAt: now, value };
    caches.set(pool, cached);
    // A failed read is not kept: the next call reads again (the caller sees this one's error).
    value.catch(() => {
      if (caches.get(pool) === cached) caches.delete(pool);
    });
  }
  return (await cached.value).get(policy) ?? null;
}

const pausedCaches = new WeakMap<Pool, { readAt: number; value: Promise<Set<string>> }>();

/**
 * Whether `reaper pause` holds the policy (cleanup_admission.paused), read again when the last
 * read is older than OVERRIDE_REFRESH_MS (one query for all policies): row-delete workers check it
 * before every admission, whatever the rate, so a pause stops every deletion within a second.
 */
export async function pausedFor(pool: Pool, policy: string): Promise<boolean> {
  let cached = pausedCaches.get(pool);
  const now = performance.now();
  if (!cached || now - cached.readAt > OVERRIDE_REFRESH_MS) {
    const entry = { readAt: now, value: admissionPausedRead(pool).then((names) => new Set(names)) };
    cached = entry;
    pausedCaches.set(pool, entry);
    // A failed read is not kept: the next call reads again (the caller sees this one's error).
    entry.value.catch(() => {
      if (pausedCaches.get(pool) === entry) pausedCaches.delete(pool);
    });
  }
  return (await cached.value).has(policy);
}

/** remote-delete: the file's admission with an override's values over it. */
export function remoteAdmissionWith(policy: AnyRemoteDeletePolicy, override: AdmissionOverride | null): RemoteDeletePolicy['admission'] {
  return {
    ratePerSecond: override?.rate ?? policy.admission.ratePerSecond,
    burst: override?.burst ?? policy.admission.burst,
    concurrency: override?.concurrency ?? policy.admission.concurrency,
  };
}

/** The row-delete throttle in force: null rate or concurrency means that limit is off. */
export interface RowAdmission {
  rowsPerSecond: number | null;
  /** Rows the bucket holds: the file's burst, else one batch. */
  burst: number;
  concurrency: number | null;
}

export function rowAdmissionWith(policy: RowDeletePolicy, override: AdmissionOverride | null): RowAdmission {
  return {
    rowsPerSecond: override?.rate ?? policy.admission?.rowsPerSecond ?? null,
    burst: override?.burst ?? policy.admission?.burst ?? policy.batchSize,
    concurrency: override?.concurrency ?? policy.admission?.concurrency ?? null,
  };
}

/** File values, override and what is in force, per policy: `reaper admission show` and `status`. */
export interface AdmissionView {
  policy: string;
  kind: Policy['kind'];
  file: { rate: number | null; burst: number | null; concurrency: number | null };
  override: AdmissionOverride | null;
  inForce: { rate: number | null; burst: number | null; concurrency: number | null };
  /** What `rate` counts. */
  rateUnit: 'calls/s' | 'keys/s' | 'rows/s';
}

export async function admissionViews(db: Db, policies: readonly Policy[]): Promise<AdmissionView[]> {
  const overrides = new Map((await admissionOverridesRead(db, policies.map((policy) => policy.name))).map((row) => [row.policy, row]));
  return policies.map((policy) => {
    const override = overrides.get(policy.name) ?? null;
    if (policy.kind === 'remote-delete') {
      const inForce = remoteAdmissionWith(policy, override);
      return {
        policy: policy.name,
        kind: policy.kind,
        file: { rate: policy.admission.ratePerSecond, burst: policy.admission.burst, concurrency: policy.admission.concurrency },
        override,
        inForce: { rate: inForce.ratePerSecond, burst: inForce.burst, concurrency: inForce.concurrency },
        rateUnit: policy.remote.kind === 's3' ? 'keys/s' : 'calls/s',
      };
    }
    const inForce = rowAdmissionWith(policy, override);
    return {
      policy: policy.name,
      kind: policy.kind,
      file: { rate: policy.admission?.rowsPerSecond ?? null, burst: policy.admission?.burst ?? policy.batchSize, concurrency: policy.admission?.concurrency ?? null },
      override,
      inForce: { rate: inForce.rowsPerSecond, burst: inForce.burst, concurrency: inForce.concurrency },
      rateUnit: 'rows/s',
    };
  });
}
