import { quoteIdentifier, type Db } from '../pool';
import type { ExpiringItem, ResolvedTarget } from './expiring-rows';

/**
 * The remote-delete ledger (cleanup_ledger). Every transition is conditional: on the state it
 * leaves and, for completion, on the current lease owner. Zero rows is an answer ('stale-lease',
 * 'not-due'), never an exception.
 */

export type LedgerOutcome = 'confirmed' | 'rejected' | 'gave-up' | 'superseded';

export interface ClaimedOperation {
  operationKey: string;
  assetId: string;
  attemptCount: number;
}

export function operationKey(policy: string, item: ExpiringItem): string {
  return `${policy}:${item.id}:${item.observedExpiry}`;
}

/**
 * Records one pending operation per item whose row is STILL eligible (same expiry to the
 * microsecond, expiry <= cutoff, guard true); existing operations only count the delivery.
 * Returns the keys of the batch that have an operation (new or old).
 */
export async function ledgerRecordCandidates(
  db: Db,
  target: ResolvedTarget,
  batch: { policy: string; runId: string | null; cutoff: string; items: readonly ExpiringItem[]; source: 'scan' | 'webhook' },
): Promise<{ inserted: number; known: string[] }> {
  const { table, key, expiresAt, keyType } = target;
  const guard = target.guardColumns.map((column, index) => ` AND t.${column} = $${7 + index}`).join('');
  const result = await db.query<{ operation_key: string; inserted: boolean }>(
    `WITH eligible AS (
       SELECT $1 || ':' || item.id || ':' || item.observed AS operation_key, item.id, item.observed::timestamptz AS observed_expiry,
              to_jsonb(t) AS payload
       FROM unnest($2::text[], $3::text[]) AS item(id, observed)
       JOIN ${table} t ON t.${key} = item.id::${keyType} AND t.${expiresAt} = item.observed::timestamptz
                      AND t.${expiresAt} <= $4::timestamptz${guard}
     ), recorded AS (
       INSERT INTO cleanup_ledger AS l (operation_key, policy, asset_id, observed_expiry, run_id, source, payload, delivery_count)
       -- a webhook is not a broker delivery (transport and cleanup attempts are counted apart)
       SELECT operation_key, $1, id, observed_expiry, $5, $6, payload, CASE WHEN $6 = 'webhook' THEN 0 ELSE 1 END FROM eligible
       ORDER BY operation_key -- rows are locked in key order by every writer: no deadlock between duplicate deliveries
       ON CONFLICT (operation_key) DO UPDATE SET delivery_count = l.delivery_count + 1, updated_at = now()
       RETURNING l.operation_key, (xmax = 0) AS inserted
     ), known AS (
       -- operations of this batch recorded earlier whose row has since changed (e.g. confirmed and marked)
       SELECT l.operation_key, false AS inserted FROM cleanup_ledger l
       WHERE l.operation_key = ANY (SELECT $1 || ':' || i || ':' || o FROM unnest($2::text[], $3::text[]) AS x(i, o))
         AND l.operation_key NOT IN (SELECT operation_key FROM eligible)
     )
     SELECT operation_key, inserted FROM recorded UNION ALL SELECT operation_key, inserted FROM known`,
    [
      batch.policy,
      batch.items.map((item) => item.id),
      batch.items.map((item) => item.observedExpiry),
      batch.cutoff,
      batch.runId,
      batch.source,
      ...target.guardValues,
    ],
  );
  return { inserted: result.rows.filter((row) => row.inserted).length, known: result.rows.map((row) => row.operation_key) };
}

/**
 * Pending operations whose row changed since they were recorded (renewed, restored with a new
 * expiry, status changed) are finished as 'superseded': the retention decision they carry no
 * longer holds, so no call is made for them.
 */
export async function ledgerSupersedeChanged(db: Db, target: ResolvedTarget, keys: readonly string[]): Promise<number> {
  const { table, key, expiresAt, keyType } = target;
  const guard = target.guardColumns.map((column, index) => ` AND t.${column} = $${2 + index}`).join('');
  const result = await db.query(
    `UPDATE cleanup_ledger l SET state = 'done', outcome = 'superseded', completed_at = clock_timestamp(), updated_at = clock_timestamp(),
       lease_owner = NULL, lease_expires_at = NULL
     WHERE l.operation_key IN (SELECT operation_key FROM cleanup_ledger WHERE operation_key = ANY($1::text[]) AND state = 'pending'
                               ORDER BY operation_key FOR UPDATE SKIP LOCKED)
       AND NOT EXISTS (SELECT 1 FROM ${table} t WHERE t.${key} = l.asset_id::${keyType} AND t.${expiresAt} = l.observed_expiry${guard})`,
    [keys, ...target.guardValues],
  );
  return result.rowCount ?? 0;
}

/** Of `keys`: how many are due now, open, confirmed, and when the earliest not-yet-due or leased one will be. */
export async function ledgerDueSummary(
  db: Db,
  keys: readonly string[],
): Promise<{ due: number; open: number; confirmed: number; nextInMs: number | null }> {
  const result = await db.query<{ due: number; open: number; confirmed: number; next_in_ms: number | null }>(
    `SELECT count(*) FILTER (WHERE outcome = 'confirmed')::int AS confirmed, count(*) FILTER (WHERE (state = 'pending' AND not_before <= clock_timestamp())
                              OR (state = 'in_flight' AND lease_expires_at < clock_timestamp()))::int AS due,
            count(*) FILTER (WHERE state <> 'done')::int AS open,
            greatest(0, ceil(extract(epoch FROM min(CASE WHEN state = 'pending' THEN not_before
                                                     WHEN state = 'in_flight' THEN lease_expires_at END) - clock_timestamp()) * 1000))::float8 AS next_in_ms
     FROM cleanup_ledger WHERE operation_key = ANY($1::text[])`,
    [keys],
  );
  const row = result.rows[0]!;
  return { due: row.due, open: row.open, confirmed: row.confirmed, nextInMs: row.next_in_ms };
}

/**
 * Finishes an operation. Conditional on the caller still holding the lease: a worker that was
 * frozen past its lease finds 0 rows and changes nothing (the newer claim wins). A confirmed
 * operation drops its payload (only ids, timestamps, counts and outcome stay).
 */
export async function ledgerFinish(
  db: Db,
  finish: { operationKey: string; owner: string; outcome: LedgerOutcome; lastResult: string; error?: string | null },
): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET state = 'done', outcome = $3, last_result = $4, last_error = $5,
       payload = CASE WHEN $3 = 'confirmed' THEN NULL ELSE payload END,
       completed_at = clock_timestamp(), updated_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL
     WHERE operation_key = $1 AND lease_owner = $2 AND state = 'in_flight'`,
    [finish.operationKey, finish.owner, finish.outcome, finish.lastResult, finish.error ?? null],
  );
  return result.rowCount === 1;
}

/**
 * Puts an operation back to pending until `delayMs` from now (rate limited, uncertain, no token,
 * circuit open). `uncountAttempt` when no call was made after all. Conditional on the lease.
 */
export async function ledgerReschedule(
  db: Db,
  reschedule: { operationKey: string; owner: string; delayMs: number; lastResult: string; error?: string | null; uncountAttempt?: boolean },
): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET state = 'pending', not_before = clock_timestamp() + $3 * interval '1 millisecond',
       last_result = $4, last_error = $5, attempt_count = attempt_count - CASE WHEN $6 THEN 1 ELSE 0 END,
       lease_owner = NULL, lease_expires_at = NULL, updated_at = clock_timestamp()
     WHERE operation_key = $1 AND lease_owner = $2 AND state = 'in_flight'`,
    [reschedule.operationKey, reschedule.owner, Math.max(0, Math.round(reschedule.delayMs)), reschedule.lastResult, reschedule.error ?? null, !!reschedule.uncountAttempt],
  );
  return result.rowCount === 1;
}

/**
 * Pending operations of `keys` not admitted now wait until `delayMs` from now (no call, no
 * attempt). SKIP LOCKED: called under the admission lock, it must never wait for a row.
 */
export async function ledgerDeferPending(db: Db, keys: readonly string[], delayMs: number): Promise<number> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET not_before = greatest(not_before, clock_timestamp() + $2 * interval '1 millisecond'), updated_at = clock_timestamp()
     WHERE operation_key IN (SELECT operation_key FROM cleanup_ledger
                             WHERE operation_key = ANY($1::text[]) AND state = 'pending' AND not_before <= clock_timestamp()
                             ORDER BY operation_key FOR UPDATE SKIP LOCKED)`,
    [keys, Math.max(0, Math.round(delayMs))],
  );
  return result.rowCount ?? 0;
}

/** The reclaimer: in-flight operations whose lease expired go back to pending, due now. */
export async function ledgerReturnExpiredLeases(db: Db): Promise<number> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET state = 'pending', not_before = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL,
       last_result = 'lease-expired', updated_at = clock_timestamp()
     WHERE state = 'in_flight' AND lease_expires_at < clock_timestamp()`,
  );
  return result.rowCount ?? 0;
}

/** After a confirmed call: the policy's own row is marked (markConfirmed) or deleted, if it still holds the same decision. */
export async function targetSettleConfirmed(
  db: Db,
  target: ResolvedTarget,
  settle: { assetId: string; observedExpiry: string; markConfirmed: Readonly<Record<string, string | number | boolean>> | undefined },
): Promise<number> {
  const { table, key, expiresAt, keyType } = target;
  const guard = target.guardColumns.map((column, index) => ` AND t.${column} = $${3 + index}`).join('');
  const params: unknown[] = [settle.assetId, settle.observedExpiry, ...target.guardValues];
  let statement: string;
  if (settle.markConfirmed && Object.keys(settle.markConfirmed).length > 0) {
    const first = params.length + 1;
    const assignments = Object.keys(settle.markConfirmed).map((column, index) => `${quoteIdentifier(column)} = $${first + index}`);
    params.push(...Object.values(settle.markConfirmed).map(String));
    statement = `UPDATE ${table} t SET ${assignments.join(', ')} WHERE t.${key} = $1::${keyType} AND t.${expiresAt} = $2::timestamptz${guard}`;
  } else {
    statement = `DELETE FROM ${table} t WHERE t.${key} = $1::${keyType} AND t.${expiresAt} = $2::timestamptz${guard}`;
  }
  const result = await db.query(statement, params);
  return result.rowCount ?? 0;
}

export interface LedgerCounts {
  policy: string;
  pending: number;
  pendingDue: number;
  inFlight: number;
  confirmed: number;
  rejected: number;
  gaveUp: number;
  superseded: number;
}

export async function ledgerCountsByPolicy(db: Db): Promise<LedgerCounts[]> {
  const result = await db.query<{
    policy: string;
    pending: number;
    pending_due: number;
    in_flight: number;
    confirmed: number;
    rejected: number;
    gave_up: number;
    superseded: number;
  }>(
    `SELECT policy,
       count(*) FILTER (WHERE state = 'pending')::int AS pending,
       count(*) FILTER (WHERE state = 'pending' AND not_before <= clock_timestamp())::int AS pending_due,
       count(*) FILTER (WHERE state = 'in_flight')::int AS in_flight,
       count(*) FILTER (WHERE outcome = 'confirmed')::int AS confirmed,
       count(*) FILTER (WHERE outcome = 'rejected')::int AS rejected,
       count(*) FILTER (WHERE outcome = 'gave-up')::int AS gave_up,
       count(*) FILTER (WHERE outcome = 'superseded')::int AS superseded
     FROM cleanup_ledger GROUP BY policy ORDER BY policy`,
  );
  return result.rows.map((row) => ({
    policy: row.policy,
    pending: row.pending,
    pendingDue: row.pending_due,
    inFlight: row.in_flight,
    confirmed: row.confirmed,
    rejected: row.rejected,
    gaveUp: row.gave_up,
    superseded: row.superseded,
  }));
}
