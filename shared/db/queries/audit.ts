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
  const result = await db.query(
    `DELETE FROM cleanup_audit WHERE audit_id IN (
       SELECT audit_id FROM cleanup_audit WHERE policy = $1 AND deleted_at < clock_timestamp() - $2 * interval '1 day'
       ORDER BY deleted_at LIMIT $3)`,
    [policy, retainDays, limit],
  );
  return result.rowCount ?? 0;
}

/**
 * remote-delete: the audit row of a confirmed operation, written in the transaction that records
 * the confirmation (so it exists exactly when that outcome committed).
 */
export async function auditRecordConfirmed(db: Db, operationKey: string, policyVersion: string): Promise<void> {
  await db.query(
    `INSERT INTO cleanup_audit (policy, key, observed_expiry, run_id, batch_id, policy_version, operation_key, outcome)
     SELECT policy, asset_id, observed_expiry, run_id, claim_batch_id, $2, operation_key, 'confirmed'
     FROM cleanup_ledger WHERE operation_key = $1 AND outcome = 'confirmed'`,
    [operationKey, policyVersion],
  );
}
