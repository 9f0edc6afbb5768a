import type { Db } from '../pool';
import { quoteIdentifier } from '../pool';
import { trailPrune } from './audit';
import type { ResolvedTarget } from './target';

/**
 * The archive (cleanup_archive): row-delete policies with `archive.enabled` copy each deleted row
 * into it in the deleting statement; `reaper restore` puts a run's rows back, never over a row
 * whose key exists again (docs/design.md invariant 20), and logs what it did in cleanup_restores.
 */

/**
 * The row-delete statement's archive part (expiringRowsDeleteGroupIfStillExpired): `returning`
 * adds the whole deleted row to the `removed` CTE's RETURNING, `cte` copies it into the archive.
 * Parameters it relies on: $9 the policy, $11 the policy version. Both empty when the archive is
 * off, so that statement is exactly what it was.
 */
/** The session writes (and reads) dates and intervals in the styles a record's text is exact in. */
const TEXT_STYLE_IS_PORTABLE = `current_setting('DateStyle') LIKE 'ISO%' AND current_setting('IntervalStyle') = 'postgres'`;

export function archivedCte(enabled: boolean): { returning: string; cte: string } {
  if (!enabled) return { returning: '', cte: '' };
  return {
    // The record's text only in the output style every PostgreSQL reads back unambiguously (the
    // default): a session set to another DateStyle or IntervalStyle archives the jsonb image alone.
    returning: `, to_jsonb(t) AS row_data, CASE WHEN ${TEXT_STYLE_IS_PORTABLE} THEN t::text END AS row_text`,
    cte: `, archived AS (
       INSERT INTO cleanup_archive (policy, key, row_data, row_text, run_id, batch_id, policy_version)
       SELECT $9, r.key, r.row_data, r.row_text, r.run_id, r.batch_id, $11 FROM removed r
     )`,
  };
}

/**
 * Keeps the archive of `policy` to `retainDays`: deletes at most `limit` older rows per call (the
 * scheduler calls it again while it returns `limit`, as for the audit), so no pass holds a long lock.
 */
export async function archivePrune(db: Db, policy: string, retainDays: number, limit: number): Promise<number> {
  return trailPrune(db, { table: 'cleanup_archive', id: 'archive_id' }, policy, retainDays, limit);
}

/** Which archived rows a restore is about: one run, optionally one key (as the operator typed it). */
export interface ArchiveSelection {
  runId: string;
  /** Cast through the key's type, so "ABC..." finds the uuid archived as "abc...". */
  key: string | null;
}

export interface ArchivedRun {
  policy: string;
  /** Days since the run was created, on the database clock. */
  ageDays: number;
  /** Rows the run's receipts say it deleted. */
  deleted: number;
}

/** The run a restore names (its policy, age and receipts' total); null when no such run exists. */
export async function archiveFindRun(db: Db, runId: string): Promise<ArchivedRun | null> {
  const result = await db.query<ArchivedRun>(
    `SELECT r.policy, extract(epoch FROM clock_timestamp() - r.created_at)::float8 / 86400 AS "ageDays",
       (SELECT coalesce(sum(b.deleted), 0)::int FROM cleanup_batches b WHERE b.run_id = r.run_id) AS deleted
     FROM cleanup_runs r WHERE r.run_id = $1`,
    [runId],
  );
  return result.rows[0] ?? null;
}

/** The selection's archived rows, and how many of them were restored already. */
export async function archiveCount(db: Db, target: ResolvedTarget, selection: ArchiveSelection): Promise<{ archived: number; restored: number }> {
  const result = await db.query<{ archived: number; restored: number }>(
    `SELECT count(*)::int AS archived, count(*) FILTER (WHERE a.restored_at IS NOT NULL)::int AS restored
     FROM cleanup_archive a WHERE a.run_id = $1 AND ($2::text IS NULL OR a.key = ($2::text::${target.keyType})::text)`,
    [selection.runId, selection.key],
  );
  return result.rows[0]!;
}

/** Why archived rows cannot go back into the table as it is now, naming the column; empty when they can. */
export interface ColumnMismatch {
  column: string;
  problem: 'missing' | 'required';
}

/**
 * Compares the columns of the selection's unrestored archived rows with the table's columns now.
 * An archived column the table no longer has (dropped or renamed) is `missing`: restoring without
 * it would silently lose data. A column the table gained since, NOT NULL with no default, is
 * `required`: the archived rows have no value for it. A generated column is never written.
 * Returns the columns a re-insert writes (archived and present, not generated), or the mismatches.
 */
export async function archiveCheckColumns(
  db: Db,
  target: ResolvedTarget,
  selection: ArchiveSelection,
): Promise<{ columns: string[]; mismatches: ColumnMismatch[]; sameColumns: boolean }> {
  const result = await db.query<{ column: string; archived: boolean; present: boolean; generated: boolean; required: boolean }>(
    `WITH archived AS (
       SELECT DISTINCT k AS column FROM cleanup_archive a CROSS JOIN LATERAL jsonb_object_keys(a.row_data) k
       WHERE a.run_id = $1 AND a.restored_at IS NULL AND ($2::text IS NULL OR a.key = ($2::text::${target.keyType})::text)
     ), present AS (
       SELECT attname::text AS column, attgenerated <> '' AS generated,
         attnotnull AND NOT atthasdef AND attidentity = '' AND attgenerated = '' AS required
       FROM pg_attribute WHERE attrelid = to_regclass($3) AND attnum > 0 AND NOT attisdropped
     )
     SELECT coalesce(a.column, p.column) AS column, a.column IS NOT NULL AS archived, p.column IS NOT NULL AS present,
       coalesce(p.generated, false) AS generated, coalesce(p.required, false) AS required
     FROM archived a FULL JOIN present p ON p.column = a.column
     ORDER BY 1`,
    [selection.runId, selection.key, target.table],
  );
  const mismatches: ColumnMismatch[] = [];
  const columns: string[] = [];
  // No archived row left: nothing to compare (and no column is "required" of nothing).
  if (!result.rows.some((row) => row.archived)) return { columns, mismatches, sameColumns: false };
  for (const row of result.rows) {
    if (row.archived && !row.present) mismatches.push({ column: row.column, problem: 'missing' });
    else if (!row.archived && row.required) mismatches.push({ column: row.column, problem: 'required' });
    else if (row.archived && !row.generated) columns.push(row.column);
  }
  // The record's text form is positional: it is read back only into the very columns it came from.
  return { columns, mismatches, sameColumns: result.rows.every((row) => row.archived && row.present) };
}

/** One archived row a restore step handled: put back, or left in the archive because its key exists again. */
export interface RestoredRow {
  archiveId: string;
  key: string;
  restored: boolean;
}

interface StepRow {
  archive_id: string;
  key: string;
  restored: boolean;
}

const toRestored = (row: StepRow): RestoredRow => ({ archiveId: row.archive_id, key: row.key, restored: row.restored });

/** `... AND` filter on the selection's unrestored rows after a cursor, as `a`; parameters $1 run, $2 key, $3 after, $4 limit. */
function pendingSql(target: ResolvedTarget, lock: boolean): string {
  return `SELECT a.archive_id, a.key, a.policy, a.row_data, a.row_text FROM cleanup_archive a
       WHERE a.run_id = $1 AND a.restored_at IS NULL AND ($2::text IS NULL OR a.key = ($2::text::${target.keyType})::text)
         AND a.archive_id > $3::bigint
       ORDER BY a.archive_id LIMIT $4${lock ? ' FOR UPDATE' : ''}`;
}

/**
 * One restore step, ONE statement: the next `limit` unrestored archived rows of the selection
 * after `after` (archive_id order, locked), re-inserted with `columns` from their archived images;
 * a key that exists again is skipped by ON CONFLICT on the key (never updated). The rows put back
 * are marked restored and every handled row is logged in cleanup_restores, in the same statement:
 * a restore killed after any step and run again restores each row once. A unique violation on
 * another column than the key is an error (the caller reports it), not a silent skip.
 */
export async function archiveRestoreStep(
  db: Db,
  target: ResolvedTarget,
  step: ArchiveSelection & { columns: readonly string[]; after: string; limit: number; restoreId: string; operator: string; sameColumns: boolean },
): Promise<RestoredRow[]> {
  const columns = step.columns.map(quoteIdentifier);
  const result = await db.query<StepRow>(
    `WITH pending AS (
       ${pendingSql(target, true)}
     ), earliest AS (
       -- A key the run deleted twice (re-created in between) is archived twice: the earlier row
       -- goes back, the later one is then a key that exists again (reported, never overwriting).
       SELECT DISTINCT ON (p.key) p.* FROM pending p ORDER BY p.key, p.archive_id
     ), inserted AS (
       INSERT INTO ${target.table} (${columns.join(', ')}) OVERRIDING SYSTEM VALUE
       SELECT ${columns.map((column) => `(x.r).${column}`).join(', ')}
       FROM earliest p CROSS JOIN LATERAL (
         -- Exact: the record's text through the table's row type, when the table has the columns it
         -- had (step.sameColumns); otherwise by column name from the jsonb image.
         SELECT CASE WHEN $7::boolean AND p.row_text IS NOT NULL AND ${TEXT_STYLE_IS_PORTABLE} THEN p.row_text::${target.table}
                     ELSE jsonb_populate_record(NULL::${target.table}, p.row_data) END AS r
       ) x
       -- A partitioned table names a row by (key, expiry) (target.identity): a key that exists
       -- again with another expiry is a conflict too, as archiveRestorePreview says.
       ${target.identity.length > 1 ? `WHERE NOT EXISTS (SELECT 1 FROM ${target.table} t WHERE t.${target.key} = (x.r).${target.key})` : ''}
       ON CONFLICT (${target.identity.join(', ')}) DO NOTHING
       RETURNING ${target.key}::text AS key
     ), outcome AS (
       SELECT p.archive_id, p.key, p.policy,
         EXISTS (SELECT 1 FROM earliest f JOIN inserted i ON i.key = f.key WHERE f.archive_id = p.archive_id) AS restored
       FROM pending p
     ), marked AS (
       UPDATE cleanup_archive a SET restored_at = clock_timestamp(), restore_id = $5
       FROM outcome o WHERE a.archive_id = o.archive_id AND o.restored
     ), logged AS (
       INSERT INTO cleanup_restores (restore_id, archive_id, run_id, policy, key, outcome, operator)
       SELECT $5, o.archive_id, $1, o.policy, o.key, CASE WHEN o.restored THEN 'restored' ELSE 'conflict' END, $6 FROM outcome o
     )
     -- Ordered by the number (o.archive_id), not by the text column of the same name: in text order
     -- '10' < '9', the caller's cursor went back, and a conflict row came round again in the same
     -- restore (a duplicate log row: a raw violation of the restore log's unique key, issue 40).
     SELECT o.archive_id::text AS archive_id, o.key, o.restored FROM outcome o ORDER BY o.archive_id`,
    [step.runId, step.key, step.after, step.limit, step.restoreId, step.operator, step.sameColumns],
  );
  return result.rows.map(toRestored);
}

/** What archiveRestoreStep would do for the same rows, changing nothing (`restored`: the key is free now). */
export async function archiveRestorePreview(
  db: Db,
  target: ResolvedTarget,
  step: ArchiveSelection & { after: string; limit: number },
): Promise<RestoredRow[]> {
  const result = await db.query<StepRow>(
    `SELECT p.archive_id::text AS archive_id, p.key, NOT EXISTS (SELECT 1 FROM ${target.table} t WHERE t.${target.key} = p.key::${target.keyType}) AS restored
     FROM (${pendingSql(target, false)}) p ORDER BY p.archive_id`,
    [step.runId, step.key, step.after, step.limit],
  );
  return result.rows.map(toRestored);
}
