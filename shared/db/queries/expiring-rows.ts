import type { Db } from '../pool';
import { quoteIdentifier } from '../pool';

/**
 * SQL over a policy's own table ("the target"): the keyset scan the scheduler runs and the
 * conditional DELETE the row-delete worker runs. Table and column names come from a validated
 * policy and pass through quoteIdentifier; every value is a parameter.
 */

export interface TargetSpec {
  table: string;
  key: string;
  expiresAt: string;
  guard: Readonly<Record<string, string | number | boolean>>;
}

/** A target whose names were checked against the catalog. */
export interface ResolvedTarget {
  readonly table: string; // quoted
  readonly key: string; // quoted
  readonly expiresAt: string; // quoted
  readonly keyType: string; // from format_type(), e.g. "uuid", "text", "bigint"
  readonly guardColumns: readonly string[]; // quoted, in the order of guardValues
  readonly guardValues: readonly string[];
}

export interface ExpiringItem {
  id: string;
  observedExpiry: string; // ISO 8601 UTC with microseconds
}

/**
 * Checks that the table and columns exist and reads the key's type, so ids (always strings in a
 * message) are cast to it and the primary-key index is used. Throws a message naming what is missing.
 */
export async function targetResolve(db: Db, spec: TargetSpec): Promise<ResolvedTarget> {
  const guardNames = Object.keys(spec.guard);
  const wanted = [spec.key, spec.expiresAt, ...guardNames];
  const result = await db.query<{ attname: string; type: string }>(
    `SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type
     FROM pg_attribute a
     WHERE a.attrelid = to_regclass($1) AND a.attname = ANY($2::text[]) AND a.attnum > 0 AND NOT a.attisdropped`,
    [quoteIdentifier(spec.table), wanted],
  );
  if (result.rowCount === 0) {
    const exists = await db.query<{ found: string | null }>('SELECT to_regclass($1)::text AS found', [quoteIdentifier(spec.table)]);
    if (exists.rows[0]?.found === null) throw new Error(`table "${spec.table}" does not exist`);
  }
  const types = new Map(result.rows.map((row) => [row.attname, row.type]));
  const missing = wanted.filter((name) => !types.has(name));
  if (missing.length > 0) throw new Error(`table "${spec.table}" has no column ${missing.map((m) => `"${m}"`).join(', ')}`);
  const keyType = types.get(spec.key)!;
  if (!/^[a-z][a-z0-9 ]*(\(\d+\))?$/.test(keyType)) throw new Error(`key column "${spec.key}" has unsupported type ${keyType}`);
  const expiryType = types.get(spec.expiresAt)!;
  if (expiryType !== 'timestamp with time zone') {
    throw new Error(`column "${spec.expiresAt}" must be timestamptz, it is ${expiryType}`);
  }
  return {
    table: quoteIdentifier(spec.table),
    key: quoteIdentifier(spec.key),
    expiresAt: quoteIdentifier(spec.expiresAt),
    keyType,
    guardColumns: guardNames.map(quoteIdentifier),
    guardValues: guardNames.map((name) => String(spec.guard[name])),
  };
}

function guardSql(target: ResolvedTarget, firstParameter: number): string {
  return target.guardColumns.map((column, index) => ` AND t.${column} = $${firstParameter + index}`).join('');
}

/**
 * One page of the keyset scan (the caller cuts it into batches): rows that satisfy the guard and expired at or before the cutoff,
 * strictly after `after`, in (expiry, key) order. Memory stays bounded by `limit` whatever the backlog.
 */
export async function expiringRowsScanPage(
  db: Db,
  target: ResolvedTarget,
  page: {
    cutoff: string;
    after: { expiry: string; key: string } | null;
    limit: number;
    /** remote-delete: leave out rows whose retention decision already has a ledger operation (open or done) of this policy. */
    unrecordedFor?: string;
  },
): Promise<ExpiringItem[]> {
  const { table, key, expiresAt, keyType } = target;
  const afterClause = page.after ? ` AND (t.${expiresAt}, t.${key}) > ($3::timestamptz, $4::${keyType})` : '';
  const guardFrom = page.after ? 5 : 3;
  const params: unknown[] = [page.cutoff, page.limit];
  if (page.after) params.push(page.after.expiry, page.after.key);
  params.push(...target.guardValues);
  // The ledger is the record of remote work: an item whose operation exists is not published again
  // (the ledger sweeper carries it while it is open; once done it stays done).
  let unrecordedClause = '';
  if (page.unrecordedFor !== undefined) {
    params.push(page.unrecordedFor);
    unrecordedClause = ` AND NOT EXISTS (SELECT 1 FROM cleanup_ledger l WHERE l.operation_key = $${params.length} || ':' || t.${key}::text || ':' || reaper_iso(t.${expiresAt}))`;
  }
  const result = await db.query<{ id: string; observed_expiry: string }>(
    `SELECT t.${key}::text AS id, reaper_iso(t.${expiresAt}) AS observed_expiry
     FROM ${table} t
     WHERE t.${expiresAt} <= $1::timestamptz${afterClause}${guardSql(target, guardFrom)}${unrecordedClause}
     ORDER BY t.${expiresAt}, t.${key}
     LIMIT $2`,
    params,
  );
  return result.rows.map((row) => ({ id: row.id, observedExpiry: row.observed_expiry }));
}

/**
 * The row-delete step, one statement: deletes the listed rows that are STILL expired and unchanged
 * (same key, the exact observed expiry to the microsecond, expiry <= cutoff, guard still true) and
 * writes the batch receipt. A receipt that already exists means this batch was committed before:
 * the caller reports it as a duplicate delivery. Rows renewed or confirmed since the scan do not
 * match and are counted as no-ops.
 */
export async function expiringRowsDeleteIfStillExpired(
  db: Db,
  target: ResolvedTarget,
  batch: { batchId: string; runId: string; policy: string; cutoff: string; items: readonly ExpiringItem[]; workerId: string },
): Promise<{ receiptWritten: boolean; deleted: number }> {
  const { table, key, expiresAt, keyType } = target;
  const result = await db.query<{ receipt_written: boolean; deleted: number }>(
    `WITH removed AS (
       DELETE FROM ${table} t
       USING unnest($1::${keyType}[], $2::timestamptz[]) AS item(id, observed_expiry)
       WHERE t.${key} = item.id AND t.${expiresAt} = item.observed_expiry AND t.${expiresAt} <= $3::timestamptz${guardSql(target, 9)}
       RETURNING 1
     ), receipt AS (
       INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id)
       SELECT $4, $5, $6, $7, n.deleted, $7 - n.deleted, $8 FROM (SELECT count(*)::int AS deleted FROM removed) n
       ON CONFLICT (batch_id) DO NOTHING
       RETURNING 1
     )
     SELECT EXISTS (SELECT 1 FROM receipt) AS receipt_written, (SELECT count(*)::int FROM removed) AS deleted`,
    [
      batch.items.map((item) => item.id),
      batch.items.map((item) => item.observedExpiry),
      batch.cutoff,
      batch.batchId,
      batch.runId,
      batch.policy,
      batch.items.length,
      batch.workerId,
      ...target.guardValues,
    ],
  );
  const row = result.rows[0]!;
  return { receiptWritten: row.receipt_written, deleted: row.deleted };
}

/**
 * One row by key if it is expired now (database clock) and its guard holds, with that "now".
 * An id that cannot be a key of this type raises a 22xxx error for the caller to report.
 */
export async function expiringRowGetIfExpired(
  db: Db,
  target: ResolvedTarget,
  id: string,
): Promise<(ExpiringItem & { now: string }) | null> {
  const { table, key, expiresAt, keyType } = target;
  const result = await db.query<{ id: string; observed_expiry: string; now: string }>(
    `SELECT t.${key}::text AS id, reaper_iso(t.${expiresAt}) AS observed_expiry, reaper_iso(statement_timestamp()) AS now
     FROM ${table} t
     WHERE t.${key} = $1::${keyType} AND t.${expiresAt} <= statement_timestamp()${guardSql(target, 2)}`,
    [id, ...target.guardValues],
  );
  const row = result.rows[0];
  return row ? { id: row.id, observedExpiry: row.observed_expiry, now: row.now } : null;
}
