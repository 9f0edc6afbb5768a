import type { Db } from '../pool';

/**
 * Global admission per policy (cleanup_admission): one row, locked for the few milliseconds of a
 * grant, so the token bucket and the concurrency cap hold across every worker process together.
 */

export interface AdmissionState {
  /** Whole and fractional tokens available now (after refill). */
  tokens: number;
  /** The database instant the refill was computed for; stored back as refilled_at. */
  refilledAt: string;
  paused: boolean;
  /** Milliseconds until a remote 429 block ends; 0 when not blocked. */
  blockedForMs: number;
}

/** Locks the policy's admission row (creating it full) and returns its refilled state. Call inside a transaction. */
export async function admissionLockAndRefill(db: Db, policy: string, rate: { ratePerSecond: number; burst: number }): Promise<AdmissionState> {
  await db.query(
    `INSERT INTO cleanup_admission (policy, tokens, refilled_at) VALUES ($1, $2, clock_timestamp()) ON CONFLICT (policy) DO NOTHING`,
    [policy, rate.burst],
  );
  const result = await db.query<{ tokens: number; refilled_at: string; paused: boolean; blocked_for_ms: number }>(
    `SELECT least($2::float8, a.tokens + greatest(0, extract(epoch FROM n.at - a.refilled_at)) * $3::float8) AS tokens,
            reaper_iso(n.at) AS refilled_at,
            a.paused,
            greatest(0, coalesce(extract(epoch FROM a.blocked_until - n.at) * 1000, 0))::float8 AS blocked_for_ms
     FROM cleanup_admission a, (SELECT clock_timestamp() AS at) n
     WHERE a.policy = $1 FOR UPDATE OF a`,
    [policy, rate.burst, rate.ratePerSecond],
  );
  const row = result.rows[0]!;
  return { tokens: row.tokens, refilledAt: row.refilled_at, paused: row.paused, blockedForMs: row.blocked_for_ms };
}

/**
 * Stores the bucket after a grant, as of the instant its refill was computed (the row is still
 * locked, so nobody refilled in between): neither losing nor inventing tokens.
 */
export async function admissionStoreTokens(db: Db, policy: string, bucket: { tokens: number; refilledAt: string }): Promise<void> {
  await db.query(`UPDATE cleanup_admission SET tokens = $2, refilled_at = $3::timestamptz, updated_at = clock_timestamp() WHERE policy = $1`, [
    policy,
    bucket.tokens,
    bucket.refilledAt,
  ]);
}

/** A 429 from the remote applies to every worker: no calls for this policy until `delayMs` from now. */
export async function admissionBlockFor(db: Db, policy: string, delayMs: number): Promise<void> {
  await db.query(
    `UPDATE cleanup_admission SET blocked_until = greatest(coalesce(blocked_until, clock_timestamp()), clock_timestamp() + $2 * interval '1 millisecond'),
       tokens = 0, refilled_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE policy = $1`,
    [policy, Math.max(0, Math.round(delayMs))],
  );
}

/** The pause switch. Pausing touches no ledger row: work waits, and resume continues where it stopped. */
export async function admissionSetPaused(db: Db, policies: readonly string[], paused: boolean, burstByPolicy: ReadonlyMap<string, number>): Promise<string[]> {
  const changed: string[] = [];
  for (const policy of policies) {
    const result = await db.query(
      `INSERT INTO cleanup_admission (policy, tokens, refilled_at, paused, paused_at) VALUES ($1, $3, clock_timestamp(), $2, CASE WHEN $2 THEN clock_timestamp() END)
       ON CONFLICT (policy) DO UPDATE SET paused = $2, paused_at = CASE WHEN $2 THEN clock_timestamp() END, updated_at = clock_timestamp()
       WHERE cleanup_admission.paused IS DISTINCT FROM $2`,
      [policy, paused, burstByPolicy.get(policy) ?? 1],
    );
    if ((result.rowCount ?? 0) > 0) changed.push(policy);
  }
  return changed;
}

export async function admissionList(db: Db): Promise<Array<{ policy: string; paused: boolean; tokens: number; blockedForMs: number }>> {
  const result = await db.query<{ policy: string; paused: boolean; tokens: number; blocked_for_ms: number }>(
    `SELECT policy, paused, tokens, greatest(0, coalesce(extract(epoch FROM blocked_until - clock_timestamp()) * 1000, 0))::float8 AS blocked_for_ms
     FROM cleanup_admission ORDER BY policy`,
  );
  return result.rows.map((row) => ({ policy: row.policy, paused: row.paused, tokens: row.tokens, blockedForMs: row.blocked_for_ms }));
}
