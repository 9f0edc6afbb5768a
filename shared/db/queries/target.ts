import type { Db } from '../pool';
import { quoteIdentifier } from '../pool';

/**
 * A policy's own table ("the target") as the catalog knows it: its names checked and quoted, its
 * key's type read, once at start-up. Every statement over a policy's table (expiring-rows, the
 * ledger, holds, the archive, plans) takes a ResolvedTarget; this module imports no other query
 * module, so they can all import it without importing each other.
 */

export interface TargetSpec {
  /** The policy's name: holds and audit rows are per policy. Defaults to the table's name. */
  name?: string;
  table: string;
  key: string;
  expiresAt: string;
  guard: Readonly<Record<string, string | number | boolean>>;
  /** remote-delete: columns set on the row once the remote confirmed (checked at start-up too). */
  markConfirmed?: Readonly<Record<string, string | number | boolean>> | undefined;
  /** row-delete: retire whole partitions (checked here: the table must be range-partitioned by expiresAt alone). */
  partitions?: { retire: boolean } | undefined;
}

/** A target whose names were checked against the catalog. */
export interface ResolvedTarget {
  readonly policy: string;
  readonly table: string; // quoted
  readonly key: string; // quoted
  readonly expiresAt: string; // quoted
  readonly keyType: string; // from format_type(), e.g. "uuid", "text", "bigint"
  readonly guardColumns: readonly string[]; // quoted, in the order of guardValues
  readonly guardValues: readonly string[];
  /**
   * A declaratively partitioned table (relkind 'p'): its key may be unique only together with
   * expiresAt (PostgreSQL puts the partition key into every unique index). Every statement already
   * names a row by key AND observed expiry, so that pair is the row's identity.
   */
  readonly partitioned: boolean;
  /** The unique index that names one row: the key alone, or (key, expiresAt) on a partitioned table (quoted columns). */
  readonly identity: readonly string[];
}

/** Key types whose `::text` is one text per value, whatever the session: what a key may be. */
const CANONICAL_TEXT_KEY_TYPES = /^(smallint|integer|bigint|text|uuid|character varying(\(\d+\))?|character(\(\d+\))?|numeric\(\d+,\d+\))$/;

/**
 * Checks that the table and columns exist and reads the key's type, so ids (always strings in a
 * message) are cast to it and the primary-key index is used. Throws a message naming what is missing.
 */
export async function targetResolve(db: Db, spec: TargetSpec): Promise<ResolvedTarget> {
  const guardNames = Object.keys(spec.guard);
  const markNames = Object.keys(spec.markConfirmed ?? {});
  const wanted = [spec.key, spec.expiresAt, ...guardNames, ...markNames];
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
  if (!/^[a-z][a-z0-9 ]*(\(\d+(,\d+)?\))?$/.test(keyType)) throw new Error(`key column "${spec.key}" has unsupported type ${keyType}`);
  if (!CANONICAL_TEXT_KEY_TYPES.test(keyType)) {
    // The key's text is part of every operation key, audit row, hold and event id: one value must
    // always read the same (issue 40). numeric without a scale keeps what was typed (1.0 vs 1.00),
    // timestamps and dates print by the session's TimeZone and DateStyle, floats by extra_float_digits.
    throw new Error(
      `key column "${spec.key}" of table "${spec.table}" is ${keyType}, whose text is not one per value (the key's text names the row in the ledger, the audit, holds and events): use an integer, text, varchar, char, uuid or numeric(p,s) key`,
    );
  }
  const expiryType = types.get(spec.expiresAt)!;
  if (expiryType !== 'timestamp with time zone') {
    throw new Error(`column "${spec.expiresAt}" must be timestamptz, it is ${expiryType}`);
  }
  const partitioned = await requirePartitioning(db, spec);
  const identity = await requireUniqueKey(db, spec, partitioned);
  await requireCastableValues(db, spec, types);
  return {
    policy: spec.name ?? spec.table,
    table: quoteIdentifier(spec.table),
    key: quoteIdentifier(spec.key),
    expiresAt: quoteIdentifier(spec.expiresAt),
    keyType,
    guardColumns: guardNames.map(quoteIdentifier),
    guardValues: guardNames.map((name) => String(spec.guard[name])),
    partitioned,
    identity: identity.map(quoteIdentifier),
  };
}

/**
 * Whether the table is declaratively partitioned, and with `partitions.retire` that reaper can
 * prove a partition's rows all expired from its bound: only a RANGE partition key that is the
 * single column `expiresAt` bounds every row's expiry (a list or hash key, an expression, or more
 * columns bound nothing reaper could compare with a cutoff). Errors name the field and the value.
 */
async function requirePartitioning(db: Db, spec: TargetSpec): Promise<boolean> {
  const result = await db.query<{ relkind: string; strategy: string | null; key_columns: string[] | null; key_has_expression: boolean }>(
    `SELECT c.relkind::text AS relkind, p.partstrat::text AS strategy,
            (SELECT array_agg(coalesce(a.attname::text, '(expression)') ORDER BY k.ord)
             FROM unnest(p.partattrs::int2[]) WITH ORDINALITY AS k(attnum, ord)
             LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum AND k.attnum > 0) AS key_columns,
            coalesce(p.partexprs IS NOT NULL, false) AS key_has_expression
     FROM pg_class c LEFT JOIN pg_partitioned_table p ON p.partrelid = c.oid
     WHERE c.oid = to_regclass($1)`,
    [quoteIdentifier(spec.table)],
  );
  const row = result.rows[0];
  const partitioned = row?.relkind === 'p';
  if (!spec.partitions?.retire) return partitioned;
  const provable = `reaper proves a partition expired only from a RANGE partition key that is the single column expiresAt ("${spec.expiresAt}")`;
  if (!partitioned) {
    throw new Error(`partitions.retire: true, but table "${spec.table}" is not a partitioned table (PARTITION BY RANGE ("${spec.expiresAt}")): ${provable}`);
  }
  const strategy = { r: 'RANGE', l: 'LIST', h: 'HASH' }[row.strategy ?? ''] ?? String(row.strategy);
  const columns = row.key_columns ?? [];
  if (strategy !== 'RANGE' || row.key_has_expression || columns.length !== 1 || columns[0] !== spec.expiresAt) {
    throw new Error(
      `partitions.retire: true, but table "${spec.table}" is partitioned by ${strategy} (${columns.map((name) => `"${name}"`).join(', ')}), which does not bound expiresAt: ${provable}`,
    );
  }
  return true;
}

/**
 * One item must name one row: the DELETE deletes `key = id AND expiresAt = observed expiry`, the
 * receipt counts items, and the keyset scan orders by (expiry, key). A key that is not unique
 * would delete several rows per item and skip rows sharing (expiry, key), so a primary key or a
 * non-partial unique index on exactly this column is required; on a partitioned table, where
 * PostgreSQL makes every unique index include the partition key, one on exactly (key, expiresAt)
 * in either order is enough (that pair is what every statement names a row by).
 */
async function requireUniqueKey(db: Db, spec: TargetSpec, partitioned: boolean): Promise<string[]> {
  const wanted = partitioned ? [[spec.key], [spec.key, spec.expiresAt]] : [[spec.key]];
  const result = await db.query<{ unique: boolean; columns: string | null }>(
    `SELECT (array_agg(i.columns ORDER BY length(i.columns)))[1] IS NOT NULL AS unique, (array_agg(i.columns ORDER BY length(i.columns)))[1] AS columns FROM (
       SELECT (SELECT string_agg(a.attname::text, ',' ORDER BY a.attname) FROM pg_attribute a
               WHERE a.attrelid = i.indrelid AND a.attnum = ANY ((i.indkey::int2[])[0:i.indnkeyatts - 1])) AS columns
       FROM pg_index i
       WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL) i
     WHERE i.columns = ANY ($2::text[])`,
    [quoteIdentifier(spec.table), wanted.map((columns) => [...columns].sort().join(','))],
  );
  if (!result.rows[0]?.unique) {
    const accepted = partitioned ? `exactly "${spec.key}", or exactly ("${spec.key}", "${spec.expiresAt}") on this partitioned table` : `exactly "${spec.key}"`;
    throw new Error(`key column "${spec.key}" of table "${spec.table}" is not unique: reaper needs a primary key or a non-partial unique index on ${accepted}`);
  }
  // The key alone when it is unique by itself (the shorter column list comes first), else the pair.
  return result.rows[0]!.columns === spec.key ? [spec.key] : [spec.key, spec.expiresAt];
}

/**
 * Every guard and markConfirmed value must be a value of its column's type: a typo found only
 * after the remote confirmed would roll the ledger write back and call the remote again and again.
 */
async function requireCastableValues(db: Db, spec: TargetSpec, types: ReadonlyMap<string, string>): Promise<void> {
  const checks = [
    ...Object.entries(spec.guard).map(([column, value]) => ({ where: 'guard', column, value })),
    ...Object.entries(spec.markConfirmed ?? {}).map(([column, value]) => ({ where: 'markConfirmed', column, value })),
  ];
  for (const check of checks) {
    const type = types.get(check.column)!;
    try {
      await db.query(`SELECT $1::${type}`, [String(check.value)]);
    } catch (error) {
      throw new Error(`${check.where}.${check.column}: ${JSON.stringify(check.value)} is not a valid ${type} (${(error as Error).message})`);
    }
  }
}
