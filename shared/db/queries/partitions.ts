import type { Db } from '../pool';
import { expiringRowsExpiredSql } from './expiring-rows';
import type { ResolvedTarget } from './target';

/**
 * Partition retirement (issue 44, docs/design.md "Retiring a partition"): the catalog reads, the
 * classification under a run's frozen cutoff, and the state machine's conditional steps
 * (cleanup_partitions, migration 0029). Partition and schema names come from the catalog and are
 * quoted with quote_ident/format('%I') in SQL or quoteIdentifier; every value is a parameter.
 */

/** Where retired partitions are kept for `quarantineDays` (created by migration 0029). */
export const RETIRED_SCHEMA = 'reaper_retired';

/** One partition of a policy's table as the catalog describes it. */
export interface PartitionInfo {
  /** schema.name, each part quoted where needed (usable in SQL as is). */
  qualified: string;
  schema: string;
  name: string;
  /** The bound as PostgreSQL prints it (`FOR VALUES FROM (...) TO (...)`, `DEFAULT`). */
  bound: string;
  isDefault: boolean;
  /** Range bounds as ISO timestamps; null for MINVALUE / MAXVALUE (and for the default partition). */
  lower: string | null;
  upper: string | null;
  /** pg_inherits.inhdetachpending: a DETACH ... CONCURRENTLY that did not finish. */
  detachPending: boolean;
  /** The partition is itself partitioned, or a foreign table: reaper does not retire those. */
  kind: 'table' | 'partitioned' | 'foreign';
  /** Foreign keys that reference this partition (or its parent): "constraint on table". */
  referencedBy: string[];
}

export async function partitionsList(db: Db, target: Pick<ResolvedTarget, 'table'>): Promise<PartitionInfo[]> {
  const result = await db.query<{
    schema: string;
    name: string;
    qualified: string;
    bound: string;
    detach_pending: boolean;
    relkind: string;
    lower: string | null;
    upper: string | null;
    lower_text: string | null;
    upper_text: string | null;
    referenced_by: string[] | null;
  }>(
    `SELECT n.nspname::text AS schema, c.relname::text AS name, format('%I.%I', n.nspname, c.relname) AS qualified,
            pg_get_expr(c.relpartbound, c.oid) AS bound, i.inhdetachpending AS detach_pending, c.relkind::text AS relkind,
            b.range[1] AS lower_text, b.range[2] AS upper_text,
            CASE WHEN b.range[1] = 'MINVALUE' THEN NULL ELSE reaper_iso(btrim(b.range[1], '''')::timestamptz) END AS lower,
            CASE WHEN b.range[2] = 'MAXVALUE' THEN NULL ELSE reaper_iso(btrim(b.range[2], '''')::timestamptz) END AS upper,
            (SELECT array_agg(format('%s on %s', f.conname, f.conrelid::regclass) ORDER BY f.conname)
             FROM pg_constraint f WHERE f.contype = 'f' AND f.confrelid IN (c.oid, i.inhparent)) AS referenced_by
     FROM pg_inherits i
     JOIN pg_class c ON c.oid = i.inhrelid
     JOIN pg_namespace n ON n.oid = c.relnamespace
     LEFT JOIN LATERAL (SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid), '^FOR VALUES FROM \\((.*)\\) TO \\((.*)\\)$') AS range) b ON true
     WHERE i.inhparent = to_regclass($1)
     ORDER BY b.range[1] = 'MINVALUE' DESC, (CASE WHEN b.range[1] = 'MINVALUE' THEN NULL ELSE btrim(b.range[1], '''')::timestamptz END) NULLS LAST, c.relname`,
    [target.table],
  );
  return result.rows.map((row) => ({
    qualified: row.qualified,
    schema: row.schema,
    name: row.name,
    bound: row.bound,
    isDefault: row.bound === 'DEFAULT',
    lower: row.lower,
    upper: row.upper,
    detachPending: row.detach_pending,
    kind: row.relkind === 'p' ? 'partitioned' : row.relkind === 'f' ? 'foreign' : 'table',
    referencedBy: row.referenced_by ?? [],
  }));
}

/**
 * THE condition "every row of this partition may be deleted under the cutoff": no row of it (ONLY
 * the partition, alias `t`) fails the scan's own predicate (expiringRowsExpiredSql: expired at or
 * before the cutoff, finite, the guard, no active hold). `IS NOT TRUE`: a NULL guard column fails.
 * Parameters: $1 the cutoff (never later than now), $2 the policy, $3.. the guard values.
 */
function failingRowSql(target: ResolvedTarget): string {
  const predicate = expiringRowsExpiredSql(target, {
    cutoff: 'least($1::timestamptz, statement_timestamp())',
    policy: '$2',
    guard: target.guardValues.map((_, index) => `$${3 + index}`),
  });
  return `(${predicate}) IS NOT TRUE`;
}

/** Rows of one partition, and how many of them fail the retire predicate (one scan). */
export interface PartitionRowCheck {
  rows: number;
  failing: number;
}

/**
 * The bounded query that proves a candidate retirable: one scan of the partition alone (its size,
 * never the table's), counting its rows and those that fail failingRowSql. Read through the
 * parent with the partition's own range (`lower <= expiry < upper`; partitions never overlap and
 * the default partition holds no row of a defined range), so partition pruning leaves exactly this
 * partition and the roles need no grant on each partition. Run only for a partition whose upper
 * bound is at or before the cutoff (every other one is decided by its bound).
 */
export async function partitionRowsCheck(db: Db, target: ResolvedTarget, range: { lower: string | null; upper: string }, cutoff: string): Promise<PartitionRowCheck> {
  const parameters = [cutoff, target.policy, ...target.guardValues];
  const upper = `$${parameters.push(range.upper)}`;
  const lower = range.lower === null ? '' : ` AND t.${target.expiresAt} >= $${parameters.push(range.lower)}::timestamptz`;
  const result = await db.query<{ rows: string; failing: string }>(
    `SELECT count(*) AS rows, count(*) FILTER (WHERE ${failingRowSql(target)}) AS failing
     FROM ${target.table} t WHERE t.${target.expiresAt} < ${upper}::timestamptz${lower}`,
    parameters,
  );
  return { rows: Number(result.rows[0]!.rows), failing: Number(result.rows[0]!.failing) };
}

/**
 * What the transaction that retires a partition reads after it took the partition's lock: its
 * rows, those failing the predicate (a hold placed or a guard changed since the classification),
 * and a checksum of the row identities (key and exact expiry; order-independent: the sum of the
 * first 60 bits of each identity's md5, as hex), for the audit row and the event.
 * `partition` is where the table is now (it may already be detached).
 */
export async function partitionRowsCheckWithChecksum(db: Db, target: ResolvedTarget, partition: string, cutoff: string): Promise<PartitionRowCheck & { checksum: string }> {
  const result = await db.query<{ rows: string; failing: string; checksum: string }>(
    `SELECT count(*) AS rows, count(*) FILTER (WHERE ${failingRowSql(target)}) AS failing,
            to_hex((coalesce(sum(('x' || left(md5(t.${target.key}::text || ':' || reaper_iso(t.${target.expiresAt})), 15))::bit(60)::bigint::numeric), 0)
                    % 9223372036854775807)::bigint) AS checksum
     FROM ONLY ${partition} t`,
    [cutoff, target.policy, ...target.guardValues],
  );
  const row = result.rows[0]!;
  return { rows: Number(row.rows), failing: Number(row.failing), checksum: row.checksum };
}
