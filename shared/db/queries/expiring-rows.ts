import pg from 'pg';
import type { Db } from '../pool';
import { archivedCte } from './archive';
import { noActiveHold } from './holds';
import { outboxInsertForRemovedSql } from './outbox';
import { prepared } from './prepared';
import type { ResolvedTarget } from './target';

/**
 * SQL over a policy's own table ("the target"): the keyset scan the scheduler runs and the
 * conditional DELETE the row-delete worker runs. Table and column names come from a validated
 * policy and pass through quoteIdentifier; every value is a parameter.
 */

export interface ExpiringItem {
  id: string;
  observedExpiry: string; // ISO 8601 UTC with microseconds
}

/** ` AND t.<guard column> = $n ...` for the target's guard, its values bound from `$firstParameter` on. */
export function guardSql(target: ResolvedTarget, firstParameter: number): string {
  return target.guardColumns.map((column, index) => ` AND t.${column} = $${firstParameter + index}`).join('');
}

/**
 * ` AND t.<guard column> = '<value>' ...`: the guard as literals, for a named statement. Its
 * generic plan can then use an index whose predicate is the guard (a partial index such as
 * `WHERE status = 'held'`), which `= $n` never proves. The text stays fixed per policy.
 */
export function guardLiteralSql(target: ResolvedTarget): string {
  return target.guardColumns.map((column, index) => ` AND t.${column} = ${pg.escapeLiteral(target.guardValues[index]!)}`).join('');
}

/** What expiringRowsExpiredSql needs of a target: its quoted names (no catalog look-up). */
export type ExpiredPredicateTarget = Pick<ResolvedTarget, 'key' | 'expiresAt' | 'guardColumns'>;

/**
 * THE condition "reaper would delete this row (alias `t`) now": expired at or before `cutoff`
 * (finite), the guard holds, no active hold of `policy`. The scan binds it to parameters, the live
 * view (shared/db/queries/live-views.ts) to literals and statement_timestamp(): one definition, so
 * the view hides exactly what the scan finds. Arguments are SQL expressions; `guard` in the order
 * of target.guardColumns.
 */
export function expiringRowsExpiredSql(target: ExpiredPredicateTarget, at: { cutoff: string; policy: string; guard: readonly string[] }): string {
  return `${expiredWithinGuardSql(target, at)}
       AND ${noActiveHoldProbedOnlyIfAny(at.policy, `t.${target.key}`)}`;
}

/**
 * expiringRowsExpiredSql without its hold clause: expired at or before `cutoff`, finite, the guard.
 * Partition retirement checks the holds apart, by the policy's holds' keys (few) rather than a probe per row.
 */
export function expiredWithinGuardSql(target: Pick<ResolvedTarget, 'expiresAt' | 'guardColumns'>, at: { cutoff: string; guard: readonly string[] }): string {
  const guard = target.guardColumns.map((column, index) => ` AND t.${column} = ${at.guard[index]}`).join('');
  return `t.${target.expiresAt} <= ${at.cutoff} AND t.${target.expiresAt} > '-infinity'::timestamptz${guard}`;
}

/**
 * noActiveHold (shared/db/queries/holds.ts), with the per-row probe skipped when the policy has no
 * hold row at all (issue 18): the uncorrelated "any hold of this policy?" is evaluated once per
 * statement (an initplan), in the same statement and snapshot as the rows it guards, so a hold
 * placed before the statement still wins (docs/design.md invariant 13) and one placed after it
 * could not have been seen by the per-row probe either. Same answer, without an index probe per
 * row for the policies that use no holds (nearly all of them, nearly always).
 */
export function noActiveHoldProbedOnlyIfAny(policyParameter: string, keyExpression: string): string {
  return `(NOT EXISTS (SELECT 1 FROM cleanup_holds any_hold WHERE any_hold.policy = ${policyParameter})
            OR ${noActiveHold(policyParameter, keyExpression)})`;
}

/**
 * remote-delete, the one definition of "the ledger already carries this row's retention decision"
 * (docs/design.md): an operation with the row's key exists, open or done, except one that ended
 * `held` or `superseded` (its row holds the decision again: the worker re-opens it). The scan
 * leaves such rows out, and the brake's count and `reaper plan` count exactly what the scan would
 * publish, so they use the same SQL (issue 40: a count of `held` only made an approval that could
 * never be satisfied). `policyParameter` is the policy name's parameter; `t` is the target's alias.
 */
export function ledgerCarriesDecisionSql(policyParameter: string, target: Pick<ResolvedTarget, 'key' | 'expiresAt'>): string {
  return `EXISTS (SELECT 1 FROM cleanup_ledger l WHERE l.operation_key = ${policyParameter} || ':' || t.${target.key}::text || ':' || reaper_iso(t.${target.expiresAt})
      AND (l.outcome IS NULL OR l.outcome NOT IN ('held', 'superseded')))`;
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
  const policyParameter = page.after ? 5 : 3;
  const guardFrom = policyParameter + 1;
  const params: unknown[] = [page.cutoff, page.limit];
  if (page.after) params.push(page.after.expiry, page.after.key);
  params.push(target.policy, ...target.guardValues);
  // The ledger is the record of remote work: an item whose operation exists is not published again
  // (the ledger sweeper carries it while it is open; once done it stays done), except one that
  // ended 'held' or 'superseded': its row is eligible again here, and the worker re-opens it.
  let unrecordedClause = '';
  if (page.unrecordedFor !== undefined) {
    params.push(page.unrecordedFor);
    unrecordedClause = ` AND NOT ${ledgerCarriesDecisionSql(`$${params.length}`, target)}`;
  }
  // Not a named statement: the guard is a parameter, and only a plan made for its value can use a
  // partial index on the guard (a generic plan would scan and sort).
  const result = await db.query<{ id: string; observed_expiry: string }>(
    `SELECT t.${key}::text AS id, reaper_iso(t.${expiresAt}) AS observed_expiry
     FROM ${table} t
     WHERE ${expiringRowsExpiredSql(target, { cutoff: '$1::timestamptz', policy: `$${policyParameter}`, guard: target.guardValues.map((_, index) => `$${guardFrom + index}`) })}${afterClause}${unrecordedClause}
     ORDER BY t.${expiresAt}, t.${key}
     LIMIT $2`,
    params,
  );
  return result.rows.map((row) => ({ id: row.id, observedExpiry: row.observed_expiry }));
}

/**
 * Rows satisfying the guard whose expiry is '-infinity': they have no instant a batch could carry,
 * so the scan leaves them out (they would otherwise hold their whole batch back on every run);
 * the scheduler counts them once per run and says so. ('infinity' never passes a cutoff.)
 */
export async function expiringRowsCountNonFinite(db: Db, target: ResolvedTarget): Promise<number> {
  const result = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM ${target.table} t WHERE t.${target.expiresAt} = '-infinity'::timestamptz${guardSql(target, 1)}`,
    [...target.guardValues],
  );
  return result.rows[0]!.n;
}

/**
 * The row-delete statement is a named (prepared) statement whose name starts
 * `reaper_row_delete_`: after a connection's first execution only that name travels, not the text.
 */
export const ROW_DELETE_STATEMENT_LABEL = 'row_delete';

/** One batch of a coalesced group (expiringRowsDeleteGroupIfStillExpired). */
export interface GroupBatch {
  batchId: string;
  runId: string;
  cutoff: string;
  items: readonly ExpiringItem[];
}

/** Per batch of a group, in the order given: what its receipt says and whether this statement wrote it. */
export interface GroupBatchOutcome {
  batchId: string;
  receiptWritten: boolean;
  deleted: number;
}

/**
 * The row-delete step, ONE statement for one batch or several batches of one policy (a worker's
 * deliveries in hand): a conditional DELETE over all their items (each item checked against ITS batch's cutoff: key, exact observed expiry, expiry <=
 * least(cutoff, now), guard, no active hold, no receipt for its batch yet), one receipt per batch
 * counting the rows deleted for it, the audit rows (with each row's own run and batch id), the
 * archived rows (archivedCte, shared/db/queries/archive.ts) and the expiry-event outbox rows (one per
 * batch, with every deleted row's event: shared/db/queries/outbox.ts) when those are on.
 * Batch ids must be distinct (the caller counts a repeated one as a duplicate no-op). A row named
 * by two batches of the group is deleted once and counted once, for one of them, as two statements
 * in a row would. The statement commits or fails as a whole.
 */
export async function expiringRowsDeleteGroupIfStillExpired(
  db: Db,
  target: ResolvedTarget,
  group: {
    policy: string;
    batches: readonly GroupBatch[];
    workerId: string;
    audit?: { policyVersion: string } | null;
    /** Copy each deleted row into cleanup_archive (archive.enabled), with this policy version. */
    archive?: { policyVersion: string } | null;
    /** Expiry events on: one cleanup_outbox row per batch that deleted rows, holding their events, in this statement. */
    events?: { policyVersion: string } | null;
  },
): Promise<{ batches: GroupBatchOutcome[]; lagSeconds: number[] }> {
  const { table, key, expiresAt, keyType } = target;
  const audited = group.audit
    ? `, audited AS (
       INSERT INTO cleanup_audit (policy, key, observed_expiry, run_id, batch_id, policy_version)
       SELECT $9, r.key, r.expiry, r.run_id, r.batch_id, $11 FROM removed r
     )`
    : '';
  const archived = archivedCte(!!group.archive);
  const outboxed = group.events ? outboxInsertForRemovedSql({ policy: '$9', policyVersion: '$11' }) : '';
  // Each deleted row's key, run and batch travel on only where audit, archive or events copy them.
  const copied = !!(group.audit || group.archive || group.events);
  const ids: string[] = [];
  const expiries: string[] = [];
  const ordinals: number[] = [];
  group.batches.forEach((batch, index) => {
    for (const item of batch.items) {
      ids.push(item.id);
      expiries.push(item.observedExpiry);
      ordinals.push(index + 1);
    }
  });
  // Named: parsed once per connection (its text is fixed per policy and settings); the worker's
  // transaction runs its generic plan (shared/db/pool.ts ROW_DELETE_PLAN_CACHE_MODE).
  const result = await db.query<{ batch_id: string; receipt_written: boolean; deleted: number; lag_seconds: number[] | null }>(prepared(
    ROW_DELETE_STATEMENT_LABEL,
    `WITH b AS (
       SELECT * FROM unnest($1::text[], $2::uuid[], $3::timestamptz[], $4::int[]) WITH ORDINALITY AS b(batch_id, run_id, cutoff, items, ord)
     ), fresh AS (
       -- A batch whose receipt exists was committed before: it deletes nothing now, so every
       -- deletion is counted by exactly one receipt (a row re-inserted with the same key and
       -- expiry after the first delivery is left for the next run to find).
       -- OFFSET 0 keeps this a per-batch primary-key probe in the statement's generic plan: pulled
       -- up into an anti-join, a generic plan made while the receipts table was small hashes all
       -- of it at every execution as it grows (the likeliest cause of the 2.4-3x CPU per row a
       -- generic plan cost at 2M before; issue 18).
       SELECT b.* FROM b WHERE NOT EXISTS (SELECT 1 FROM cleanup_batches done WHERE done.batch_id = b.batch_id OFFSET 0)
     ), removed AS (
       DELETE FROM ${table} t
       USING unnest($5::${keyType}[], $6::timestamptz[], $7::int[]) AS item(id, observed_expiry, ord)
         JOIN fresh f ON f.ord = item.ord
       WHERE t.${key} = item.id AND t.${expiresAt} = item.observed_expiry
         -- Each batch's own cutoff, never later than now: a future cutoff makes nothing eligible.
         -- The guard as literals: at 2M rows the generic plan then probed the (expiry, key) index
         -- whose predicate is the guard, in expiry order, instead of the random primary key that no
         -- longer fitted in shared buffers (0.28 buffer reads per row; bench, issue 18).
         AND t.${expiresAt} <= least(f.cutoff, statement_timestamp())${guardLiteralSql(target)}
         AND ${noActiveHoldProbedOnlyIfAny('$9', `t.${key}`)}
       RETURNING f.ord, t.${expiresAt} AS expiry${copied ? `, f.batch_id, f.run_id, t.${key}::text AS key` : ''}${archived.returning}
     ), counted AS (
       SELECT b.ord, b.batch_id, b.run_id, b.items, coalesce(n.deleted, 0)::int AS deleted, n.lag_seconds
       FROM b LEFT JOIN (
         SELECT ord, count(*) AS deleted, array_agg(extract(epoch FROM clock_timestamp() - expiry)::float8) AS lag_seconds FROM removed GROUP BY ord
       ) n ON n.ord = b.ord
     ), receipt AS (
       INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id)
       SELECT c.batch_id, c.run_id, $9, c.items, c.deleted, c.items - c.deleted, $8 FROM counted c ORDER BY c.ord
       ON CONFLICT (batch_id) DO NOTHING
       RETURNING batch_id
     )${audited}${archived.cte}${outboxed}
     SELECT c.batch_id, EXISTS (SELECT 1 FROM receipt r WHERE r.batch_id = c.batch_id) AS receipt_written, c.deleted, c.lag_seconds,
       -- $10 and $11 are named here so their types are known whichever CTEs are left out
       $10::int AS batches, $11::text AS policy_version
     FROM counted c ORDER BY c.ord`,
    [
      group.batches.map((batch) => batch.batchId),
      group.batches.map((batch) => batch.runId),
      group.batches.map((batch) => batch.cutoff),
      group.batches.map((batch) => batch.items.length),
      ids,
      expiries,
      ordinals,
      group.workerId,
      group.policy,
      group.batches.length,
      (group.audit ?? group.archive ?? group.events)?.policyVersion ?? null,
    ],
  ));
  return {
    batches: result.rows.map((row) => ({ batchId: row.batch_id, receiptWritten: row.receipt_written, deleted: row.deleted })),
    lagSeconds: result.rows.flatMap((row) => row.lag_seconds ?? []),
  };
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
     WHERE t.${key} = $1::${keyType} AND t.${expiresAt} <= statement_timestamp() AND t.${expiresAt} > '-infinity'::timestamptz${guardSql(target, 2)}`,
    [id, ...target.guardValues],
  );
  const row = result.rows[0];
  return row ? { id: row.id, observedExpiry: row.observed_expiry, now: row.now } : null;
}
