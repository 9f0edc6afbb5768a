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

/**
 * A read shared by every caller of one pool, made again when the last is older than
 * OVERRIDE_REFRESH_MS (one query for all policies). A failed read is not kept: the next call reads
 * again (the caller sees this one's error).
 */
function refreshedPerPool<T>(read: (pool: Pool) => Promise<T>): (pool: Pool) => Promise<T> {
  const caches = new WeakMap<Pool, { readAt: number; value: Promise<T> }>();
  return (pool) => {
    const now = performance.now();
    let cached = caches.get(pool);
    if (!cached || now - cached.readAt > OVERRIDE_REFRESH_MS) {
      const entry = { readAt: now, value: read(pool) };
      cached = entry;
      caches.set(pool, entry);
      entry.value.catch(() => {
        if (caches.get(pool) === entry) caches.delete(pool);
      });
    }
    return cached.value;
  };
}

const overridesInForce = refreshedPerPool(async (pool) => new Map((await admissionOverridesRead(pool)).map((row) => [row.policy, row])));
const pausedPolicies = refreshedPerPool(async (pool) => new Set(await admissionPausedRead(pool)));

/** The override in force for `policy` (null: the file's values). */
export async function overrideFor(pool: Pool, policy: string): Promise<AdmissionOverride | null> {
  return (await overridesInForce(pool)).get(policy) ?? null;
}

/**
 * Whether `reaper pause` holds the policy (cleanup_admission.paused): row-delete workers check it
 * before every admission, whatever the rate, so a pause stops every deletion within a second.
 */
export async function pausedFor(pool: Pool, policy: string): Promise<boolean> {
  return (await pausedPolicies(pool)).has(policy);
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
