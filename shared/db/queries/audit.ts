import type { Db } from '../pool';

/** The audit trail (cleanup_audit): written by the deleting statements, read by `reaper audit`. */

export interface AuditEntry {
  policy: string;
  key: string;
  observedExpiry: string;
  runId: string | null;
  batchId: string | null;
  policyVersion: string;
  operationKey: string | null;
  outcome: string;
  deletedAt: string;
}

interface AuditRow {
  policy: string;
  key: string;
  observed_expiry: string;
  run_id: string | null;
  batch_id: string | null;
  policy_version: string;
  operation_key: string | null;
  outcome: string;
  deleted_at: string;
}

const AUDIT_COLUMNS = `policy, key, reaper_iso(observed_expiry) AS observed_expiry, run_id, batch_id, policy_version, operation_key,
  outcome, reaper_iso(deleted_at) AS deleted_at`;

function toEntry(row: AuditRow): AuditEntry {
  return {
    policy: row.policy,
    key: row.key,
    observedExpiry: row.observed_expiry,
    runId: row.run_id,
    batchId: row.batch_id,
    policyVersion: row.policy_version,
    operationKey: row.operation_key,
    outcome: row.outcome,
    deletedAt: row.deleted_at,
  };
}

/** "Was this deleted, when, by which run and which version of the rule?" */
export async function auditFindByKey(db: Db, policy: string, key: string, limit: number): Promise<AuditEntry[]> {
  const result = await db.query<AuditRow>(
    `SELECT ${AUDIT_COLUMNS} FROM cleanup_audit WHERE policy = $1 AND key = $2 ORDER BY deleted_at DESC LIMIT $3`,
    [policy, key, limit],
  );
  return result.rows.map(toEntry);
}

export async function auditFindByRun(db: Db, runId: string, limit: number): Promise<{ total: number; entries: AuditEntry[] }> {
  const total = await db.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_audit WHERE run_id = $1', [runId]);
  const result = await db.query<AuditRow>(`SELECT ${AUDIT_COLUMNS} FROM cleanup_audit WHERE run_id = $1 ORDER BY deleted_at, key LIMIT $2`, [runId, limit]);
  return { total: total.rows[0]!.n, entries: result.rows.map(toEntry) };
}

/**
 * Keeps the audit of `policy` to `retainDays`: deletes at most `limit` older rows per call (the
 * scheduler calls it again while it returns `limit`), so one pass never holds a long lock.
 */
export async function auditPrune(db: Db, policy: string, retainDays: number, limit: number): Promise<number> {
  return trailPrune(db, { table: 'cleanup_audit', id: 'audit_id' }, policy, retainDays, limit);
}

/**
 * One bounded prune of a kept trail (cleanup_audit, cleanup_archive): the `limit` oldest rows of
 * `policy` deleted more than `retainDays` ago. Table and id column are constants of the callers.
 */
export async function trailPrune(
  db: Db,
  trail: { table: 'cleanup_audit' | 'cleanup_archive'; id: 'audit_id' | 'archive_id' },
  policy: string,
  retainDays: number,
  limit: number,
): Promise<number> {
  const result = await db.query(
    `DELETE FROM ${trail.table} WHERE ${trail.id} IN (
       SELECT ${trail.id} FROM ${trail.table} WHERE policy = $1 AND deleted_at < clock_timestamp() - $2 * interval '1 day'
       ORDER BY deleted_at LIMIT $3)`,
    [policy, retainDays, limit],
  );
  return result.rowCount ?? 0;
}

/**
 * remote-delete: the audit row of a remote deletion, written in the transaction that records the
 * confirmed call. Every call the remote confirmed deleted the object, also one made under a claim
 * that is no longer current (its lease expired; the operation may since be superseded, held or
 * claimed again): so this is written whether or not the caller's outcome was recorded, and once
 * per operation key. The ledger row's lock serialises the two writers a stale and a current
 * confirmation can be; the existence check is a statement of its own, so it sees what the other
 * committed while this one waited. Keys are the ledger's asset id (the row's canonical key text).
 * Returns whether a row was written.
 */
export async function auditRecordConfirmed(db: Db, operationKey: string, policyVersion: string): Promise<boolean> {
  await db.query(`SELECT 1 FROM cleanup_ledger WHERE operation_key = $1 FOR UPDATE`, [operationKey]);
  const result = await db.query(
    `INSERT INTO cleanup_audit (policy, key, observed_expiry, run_id, batch_id, policy_version, operation_key, outcome)
     SELECT l.policy, l.asset_id, l.observed_expiry, l.run_id, l.claim_batch_id, $2, l.operation_key, 'confirmed'
     FROM cleanup_ledger l WHERE l.operation_key = $1
       AND NOT EXISTS (SELECT 1 FROM cleanup_audit a WHERE a.policy = l.policy AND a.key = l.asset_id AND a.operation_key = l.operation_key)`,
    [operationKey, policyVersion],
  );
  return (result.rowCount ?? 0) > 0;
}
