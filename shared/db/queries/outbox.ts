import type { ExpiryEventV1 } from '../../contracts/expiry-event';
import type { Db } from '../pool';

/**
 * The expiry-event outbox (cleanup_outbox, migration 0019): rows written by the deleting statements
 * in the same transaction as the deletion (so an event exists exactly when its deletion committed),
 * published and then deleted by `reaper relay` (services/relay). The CTE builders below are
 * fragments of those statements; they interpolate only parameter numbers and CTE names.
 */

/**
 * row-delete: the outbox CTE of expiringRowsDeleteGroupIfStillExpired, one row per row its
 * `removed` CTE deleted (a no-op, a held row or a renewed row is not in `removed`, so it gets
 * none), with its batch's cutoff from the statement's `b` CTE.
 */
export function outboxInsertForRemovedSql(parameters: { policy: string; policyVersion: string }): string {
  return `, outboxed AS (
       INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
       SELECT ${parameters.policy}, r.key, r.expiry, b.cutoff, r.run_id, r.batch_id, ${parameters.policyVersion}
       FROM removed r JOIN b ON b.ord = r.ord
     )`;
}

/**
 * remote-delete: the outbox CTE of targetSettleConfirmed, one row when its `settled` CTE deleted
 * (or marked) the policy's row after the remote confirmed; run and batch id come from the ledger
 * operation (the row's canonical key makes its operation key). A held or changed row is not in
 * `settled`, so it gets none.
 */
export function outboxInsertForSettledSql(parameters: { policy: string; policyVersion: string }): string {
  return `, outboxed AS (
       INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
       SELECT ${parameters.policy}, s.key, s.expiry, NULL, l.run_id, l.claim_batch_id, ${parameters.policyVersion}
       FROM settled s LEFT JOIN cleanup_ledger l ON l.operation_key = ${parameters.policy} || ':' || s.key || ':' || reaper_iso(s.expiry)
     )`;
}

export interface OutboxEntry {
  outboxId: string;
  event: ExpiryEventV1;
}

/**
 * The relay's batch: the oldest `limit` rows after `afterId` no other relay holds, locked until the
 * caller's transaction ends (SKIP LOCKED: several relays share the work instead of publishing the
 * same rows). Must run inside a transaction that lives until the published rows are deleted.
 * `afterId` lets a draining relay start where its last pass ended: from the start, the index scan
 * walks every entry its earlier passes deleted until vacuum removes them (slower with each pass
 * while a long transaction elsewhere holds the cluster's xmin back). '0' = from the oldest.
 */
export async function outboxTakeOldest(db: Db, limit: number, afterId = '0'): Promise<OutboxEntry[]> {
  const result = await db.query<{
    outbox_id: string;
    policy: string;
    key: string;
    observed_expiry: string;
    cutoff: string | null;
    run_id: string | null;
    batch_id: string | null;
    deleted_at: string;
    policy_version: string;
  }>(
    `SELECT outbox_id::text, policy, key, reaper_iso(observed_expiry) AS observed_expiry, reaper_iso(cutoff) AS cutoff,
       run_id::text, batch_id, reaper_iso(deleted_at) AS deleted_at, policy_version
     FROM cleanup_outbox WHERE outbox_id > $2::bigint ORDER BY outbox_id LIMIT $1 FOR UPDATE SKIP LOCKED`,
    [limit, afterId],
  );
  return result.rows.map((row) => ({
    outboxId: row.outbox_id,
    event: {
      version: 1,
      policy: row.policy,
      key: row.key,
      observedExpiry: row.observed_expiry,
      cutoff: row.cutoff,
      runId: row.run_id,
      batchId: row.batch_id,
      deletedAt: row.deleted_at,
      policyVersion: row.policy_version,
    },
  }));
}

/** Deletes rows whose events the broker confirmed. Returns how many were deleted. */
export async function outboxDeletePublished(db: Db, outboxIds: readonly string[]): Promise<number> {
  const result = await db.query('DELETE FROM cleanup_outbox WHERE outbox_id = ANY($1::bigint[])', [outboxIds]);
  return result.rowCount ?? 0;
}

/**
 * Per policy, the age in seconds of its oldest unpublished event (0 when none): one index probe
 * per policy, whatever the outbox's size (insertion order stands in for age).
 */
export async function outboxOldestAges(db: Db, policies: readonly string[]): Promise<Array<{ policy: string; oldestAgeSeconds: number }>> {
  const result = await db.query<{ policy: string; age: number | null }>(
    `SELECT p.policy, extract(epoch FROM clock_timestamp() - o.deleted_at)::float8 AS age
     FROM unnest($1::text[]) AS p(policy)
     LEFT JOIN LATERAL (SELECT deleted_at FROM cleanup_outbox WHERE policy = p.policy ORDER BY outbox_id LIMIT 1) o ON true`,
    [policies],
  );
  return result.rows.map((row) => ({ policy: row.policy, oldestAgeSeconds: Math.max(0, row.age ?? 0) }));
}

/**
 * The policy's unpublished events, counted up to `cap` (a bounded index-only walk: the worker's
 * limit check and `reaper status` must not get slower as the outbox grows past its limit).
 */
export async function outboxCountUpTo(db: Db, policy: string, cap: number): Promise<number> {
  const result = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM (SELECT 1 FROM cleanup_outbox WHERE policy = $1 ORDER BY outbox_id LIMIT $2) o`,
    [policy, cap],
  );
  return result.rows[0]!.n;
}

/** Connections of `reaper relay` processes to this database now (their pool's application_name): for `reaper events status`. */
export async function outboxRelayConnections(db: Db): Promise<number> {
  const result = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-relay'`,
  );
  return result.rows[0]!.n;
}
