import type { Db } from '../pool';
import pg from 'pg';
import { quoteIdentifier } from '../pool';
import { expiredWithinGuardSql, expiringRowsExpiredSql, guardSql } from './expiring-rows';
import { holdActiveSql, noActiveHold } from './holds';
import { outboxInsertPartitionRetired } from './outbox';
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
 * The proof that lets the scheduler classify a partition retirable without reading its rows
 * (issue 44): for a partition whose upper bound is at or before the cutoff, every row's expiry is
 * below the cutoff by the bound alone (partitions never overlap; a range partition holds no NULL
 * key). What the bound cannot prove is read with bounded queries, each answered by its first row:
 *  - expiredByBound: the bound checked in SQL against the exact cutoff (never later than now);
 *    false only within a millisecond of the cutoff, where the caller falls back to partitionRowsCheck;
 *  - nonFinite: a row expiring at '-infinity' (only a partition from MINVALUE can hold one: an
 *    index probe on the (expiresAt, key) index);
 *  - outsideGuard: a row failing the guard (only when the policy has one: EXISTS, stops at the first);
 *  - held: a row under one of the policy's active holds, found by looking each hold's key up in the
 *    partition (an index probe per hold; holds are few) instead of a probe per row.
 * Read through the parent with the partition's range, like partitionRowsCheck. A hold whose key
 * does not cast to the key's type (a row edited by hand) raises 22xxx: the caller falls back.
 * Parameters: $1 cutoff, $2 policy, $3.. guard values, then the range.
 */
export interface PartitionRetirableProof {
  expiredByBound: boolean;
  nonFinite: boolean;
  outsideGuard: boolean;
  held: boolean;
}

export async function partitionRetirableProof(db: Db, target: ResolvedTarget, range: { lower: string | null; upper: string }, cutoff: string): Promise<PartitionRetirableProof> {
  const parameters: unknown[] = [cutoff, target.policy, ...target.guardValues];
  const upper = `$${parameters.push(range.upper)}::timestamptz`;
  const lowerFinite = range.lower !== null && Number.isFinite(Date.parse(range.lower));
  const inRange = `t.${target.expiresAt} < ${upper}${range.lower === null ? '' : ` AND t.${target.expiresAt} >= $${parameters.push(range.lower)}::timestamptz`}`;
  const guard = target.guardColumns.length === 0 ? 'false' : `EXISTS (SELECT 1 FROM ${target.table} t WHERE ${inRange} AND (true${guardSql(target, 3)}) IS NOT TRUE)`;
  const nonFinite = lowerFinite ? 'false' : `EXISTS (SELECT 1 FROM ${target.table} t WHERE ${inRange} AND t.${target.expiresAt} = '-infinity'::timestamptz)`;
  const result = await db.query<{ by_bound: boolean; non_finite: boolean; outside_guard: boolean; held: boolean }>(
    `SELECT ${upper} <= least($1::timestamptz, statement_timestamp()) AS by_bound, ${nonFinite} AS non_finite, ${guard} AS outside_guard,
            EXISTS (SELECT 1 FROM ${target.table} t WHERE ${inRange} AND t.${target.key} = ANY (${activeHoldKeysSql(target, '$2')})) AS held`,
    parameters,
  );
  const row = result.rows[0]!;
  return { expiredByBound: row.by_bound, nonFinite: row.non_finite, outsideGuard: row.outside_guard, held: row.held };
}

/** The policy's (in `policyParameter`) active holds' keys as an array of the key's type: an initplan, so `t.key = ANY (...)` probes the key's index once per hold. */
function activeHoldKeysSql(target: Pick<ResolvedTarget, 'keyType'>, policyParameter: string): string {
  return `ARRAY(SELECT h.key::${target.keyType} FROM cleanup_holds h WHERE h.policy = ${policyParameter} AND ${holdActiveSql('h')})`;
}

/** 22xxx data exception: a hold key that does not cast to the key's type (see partitionRetirableProof). */
export const isDataException = (error: unknown): boolean => error instanceof pg.DatabaseError && (error.code ?? '').startsWith('22');

/**
 * What the transaction that retires a partition reads after it took the partition's lock, as
 * cheaply as the proof allows: ONE read of the rows (a sequential or index-only scan of the
 * partition alone) for their count, the rows failing expiry or guard (a per-row comparison, no
 * probe) and a checksum of the row identities; the holds apart, by the policy's active holds'
 * keys (an index probe each), only when the policy has any. A hold or a guard change committed
 * before these statements wins.
 * Checksum: order-independent, the sum of 60 bits of a 64-bit hash of each identity (the key's
 * text, seeded with the hash of its exact expiry), modulo 2^63-1, as hex; hashtextextended and
 * timestamp_hash_extended are the functions hash partitioning relies on (stable across versions).
 * `partition` is where the table is now (it may already be detached). In a transaction: the hold
 * look-up runs under a savepoint, and a hold key that does not cast (22xxx) falls back to a probe per row.
 */
export async function partitionRowsRecheck(db: Db, target: ResolvedTarget, partition: string, cutoff: string): Promise<PartitionRowCheck & { held: number; checksum: string }> {
  const failing = expiredWithinGuardSql(target, { cutoff: 'least($1::timestamptz, statement_timestamp())', guard: target.guardValues.map((_, index) => `$${3 + index}`) });
  // One pass of cheap expressions over the partition: compiling it (JIT, past jit_above_cost on a large partition) costs more than it saves.
  await db.query(`SELECT set_config('jit', 'off', true)`);
  const result = await db.query<{ rows: string; failing: string; checksum: string; any_hold: boolean }>(
    `SELECT count(*) AS rows, count(*) FILTER (WHERE (${failing}) IS NOT TRUE) AS failing,
            to_hex((coalesce(sum(hashtextextended(t.${target.key}::text, timestamp_hash_extended(t.${target.expiresAt} AT TIME ZONE 'UTC', 0)) & 1152921504606846975), 0)
                    % 9223372036854775807)::bigint) AS checksum,
            EXISTS (SELECT 1 FROM cleanup_holds h WHERE h.policy = $2 AND ${holdActiveSql('h')}) AS any_hold
     FROM ONLY ${partition} t`,
    [cutoff, target.policy, ...target.guardValues],
  );
  const row = result.rows[0]!;
  const held = row.any_hold ? await heldRowsIn(db, target, partition) : 0;
  return { rows: Number(row.rows), failing: Number(row.failing), held, checksum: row.checksum };
}

/** Rows of `partition` (ONLY it) under an active hold of the policy: an index probe per hold; a hold key that does not cast falls back to a probe per row. */
async function heldRowsIn(db: Db, target: ResolvedTarget, partition: string): Promise<number> {
  await db.query('SAVEPOINT reaper_partition_holds');
  try {
    const probed = await db.query<{ n: string }>(`SELECT count(*) AS n FROM ONLY ${partition} t WHERE t.${target.key} = ANY (${activeHoldKeysSql(target, '$1')})`, [target.policy]);
    await db.query('RELEASE SAVEPOINT reaper_partition_holds');
    return Number(probed.rows[0]!.n);
  } catch (error) {
    if (!isDataException(error)) throw error;
    await db.query('ROLLBACK TO SAVEPOINT reaper_partition_holds');
    const scanned = await db.query<{ n: string }>(`SELECT count(*) AS n FROM ONLY ${partition} t WHERE NOT ${noActiveHold('$1', `t.${target.key}`)}`, [target.policy]);
    return Number(scanned.rows[0]!.n);
  }
}

/** A row of cleanup_partitions: one retirement of one partition, at one state. */
export interface PartitionRetirement {
  retirementId: string;
  policy: string;
  runId: string | null;
  parentTable: string;
  sourceSchema: string;
  sourceName: string;
  retiredName: string;
  bound: string;
  lowerBound: string | null;
  upperBound: string;
  concurrent: boolean;
  state: 'detaching' | 'quarantined' | 'kept' | 'dropped' | 'restored' | 'released';
  rowCount: number | null;
  keyChecksum: string | null;
  reason: string | null;
  quarantineUntil: string | null;
}

const RETIREMENT_COLUMNS = `retirement_id::text, policy, run_id::text, parent_table, source_schema, source_name, retired_name, bound,
  reaper_iso(lower_bound) AS lower_bound, reaper_iso(upper_bound) AS upper_bound, concurrent, state, row_count::text, key_checksum, reason,
  reaper_iso(quarantine_until) AS quarantine_until`;

interface RetirementRow {
  retirement_id: string;
  policy: string;
  run_id: string | null;
  parent_table: string;
  source_schema: string;
  source_name: string;
  retired_name: string;
  bound: string;
  lower_bound: string | null;
  upper_bound: string;
  concurrent: boolean;
  state: PartitionRetirement['state'];
  row_count: string | null;
  key_checksum: string | null;
  reason: string | null;
  quarantine_until: string | null;
}

function toRetirement(row: RetirementRow): PartitionRetirement {
  return {
    retirementId: row.retirement_id,
    policy: row.policy,
    runId: row.run_id,
    parentTable: row.parent_table,
    sourceSchema: row.source_schema,
    sourceName: row.source_name,
    retiredName: row.retired_name,
    bound: row.bound,
    lowerBound: row.lower_bound,
    upperBound: row.upper_bound,
    concurrent: row.concurrent,
    state: row.state,
    rowCount: row.row_count === null ? null : Number(row.row_count),
    keyChecksum: row.key_checksum,
    reason: row.reason,
    quarantineUntil: row.quarantine_until,
  };
}

/**
 * Step 1 of a retirement: the intent, committed before anything changes, so a crash at any later
 * point is found by the next run (partitionRetirementsOpen). Null when the partition already has
 * an open retirement (another scheduler's), or its name is taken in reaper_retired.
 */
export async function partitionRetirementBegin(
  db: Db,
  retirement: { policy: string; runId: string; parentTable: string; schema: string; name: string; bound: string; lower: string | null; upper: string; concurrent: boolean },
): Promise<PartitionRetirement | null> {
  const result = await db.query<RetirementRow>(
    `INSERT INTO cleanup_partitions (policy, run_id, parent_table, source_schema, source_name, retired_name, bound, lower_bound, upper_bound, concurrent, state)
     SELECT $1, $2, $3, $4, $5, $5, $6, $7, $8, $9, 'detaching'
     WHERE to_regclass(format('%I.%I', $10::text, $5::text)) IS NULL
       -- Conditional on the state it expects, like every step: a partition an operator restored
       -- (and did not release) is never begun again, even by a run that classified it before the
       -- restore committed.
       AND NOT EXISTS (SELECT 1 FROM cleanup_partitions r WHERE r.parent_table = $3 AND r.source_schema = $4 AND r.source_name = $5 AND r.state = 'restored')
     ON CONFLICT DO NOTHING
     RETURNING ${RETIREMENT_COLUMNS}`,
    [retirement.policy, retirement.runId, retirement.parentTable, retirement.schema, retirement.name, retirement.bound, retirement.lower, retirement.upper, retirement.concurrent, RETIRED_SCHEMA],
  );
  return result.rows[0] ? toRetirement(result.rows[0]) : null;
}

/** The policy's retirements still 'detaching' (interrupted, or in progress elsewhere), oldest first. */
export async function partitionRetirementsOpen(db: Db, policy: string): Promise<PartitionRetirement[]> {
  const result = await db.query<RetirementRow>(`SELECT ${RETIREMENT_COLUMNS} FROM cleanup_partitions WHERE policy = $1 AND state = 'detaching' ORDER BY retirement_id`, [policy]);
  return result.rows.map(toRetirement);
}

/** Retirements of a policy (all states), newest first; or the one whose retired name is `retiredName`. */
export async function partitionRetirementsList(db: Db, filter: { policy?: string; retiredName?: string; states?: readonly string[] }): Promise<PartitionRetirement[]> {
  const result = await db.query<RetirementRow>(
    `SELECT ${RETIREMENT_COLUMNS} FROM cleanup_partitions
     WHERE ($1::text IS NULL OR policy = $1) AND ($2::text IS NULL OR retired_name = $2) AND ($3::text[] IS NULL OR state = ANY ($3))
     ORDER BY retirement_id DESC`,
    [filter.policy ?? null, filter.retiredName ?? null, filter.states ?? null],
  );
  return result.rows.map(toRetirement);
}

/** Rows this run retired (they count toward its allowance like published rows). */
export async function partitionRetiredRowsOfRun(db: Db, runId: string): Promise<number> {
  const result = await db.query<{ n: string }>(
    `SELECT coalesce(sum(row_count), 0) AS n FROM cleanup_partitions WHERE run_id = $1 AND state IN ('quarantined', 'dropped', 'restored')`,
    [runId],
  );
  return Number(result.rows[0]!.n);
}

/**
 * Where a retirement's partition is now, read from the catalog:
 *  - attached / detach-pending: a partition of the retirement's parent (inhdetachpending);
 *  - detached: the table exists, the parent exists, and the table is nobody's partition (what
 *    reaper's detach leaves; the catalog cannot tell it from someone else's detach: the re-check decides);
 *  - attached-elsewhere: the table is now a partition of another table (not reaper's to move);
 *  - parent-missing: the table exists but the retirement's parent does not (dropped, renamed);
 *  - retired: in reaper_retired; missing: neither.
 * A parent lookup that finds nothing (no pg_inherits row, no parent) is never read as "detached".
 */
export type PartitionWhereabouts = 'attached' | 'detach-pending' | 'detached' | 'attached-elsewhere' | 'parent-missing' | 'retired' | 'missing';

export async function partitionWhereabouts(db: Db, retirement: Pick<PartitionRetirement, 'parentTable' | 'sourceSchema' | 'sourceName' | 'retiredName'>): Promise<PartitionWhereabouts> {
  const result = await db.query<{ source: string | null; retired: string | null; parent: string | null; pending: boolean | null; elsewhere: boolean }>(
    `WITH s AS (SELECT to_regclass(format('%I.%I', $1::text, $2::text)) AS source, to_regclass($5) AS parent)
     SELECT s.source::text AS source, to_regclass(format('%I.%I', $3::text, $4::text))::text AS retired, s.parent::text AS parent,
            (SELECT i.inhdetachpending FROM pg_inherits i WHERE i.inhrelid = s.source AND i.inhparent = s.parent) AS pending,
            EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = s.source AND i.inhparent IS DISTINCT FROM s.parent) AS elsewhere
     FROM s`,
    [retirement.sourceSchema, retirement.sourceName, RETIRED_SCHEMA, retirement.retiredName, retirement.parentTable],
  );
  const row = result.rows[0]!;
  if (row.source === null) return row.retired !== null ? 'retired' : 'missing';
  if (row.pending !== null) return row.pending ? 'detach-pending' : 'attached';
  if (row.elsewhere) return 'attached-elsewhere';
  if (row.parent === null) return 'parent-missing';
  return 'detached';
}

/**
 * Schema and name quoted each as ONE identifier (pg.escapeIdentifier): a partition's name may hold
 * dots or hyphens ("ev.2026.01.01"), which quoteIdentifier would split into a qualified name.
 */
const name = (identifier: string) => pg.escapeIdentifier(identifier);
const sourceOf = (retirement: Pick<PartitionRetirement, 'sourceSchema' | 'sourceName'>) => `${name(retirement.sourceSchema)}.${name(retirement.sourceName)}`;
const retiredOf = (retirement: Pick<PartitionRetirement, 'retiredName'>) => `${name(RETIRED_SCHEMA)}.${name(retirement.retiredName)}`;

/**
 * DETACH PARTITION ... CONCURRENTLY: never inside a transaction block (PostgreSQL runs it as two
 * transactions of its own) and refused while the table has a default partition. Interrupted
 * between its two transactions, the partition stays attached with inhdetachpending: FINALIZE.
 */
export async function partitionDetachConcurrently(db: Db, retirement: PartitionRetirement): Promise<void> {
  await db.query(`ALTER TABLE ${retirement.parentTable} DETACH PARTITION ${sourceOf(retirement)} CONCURRENTLY`);
}

/** Finishes a DETACH ... CONCURRENTLY that was interrupted half-way. */
export async function partitionDetachFinalize(db: Db, retirement: PartitionRetirement): Promise<void> {
  await db.query(`ALTER TABLE ${retirement.parentTable} DETACH PARTITION ${sourceOf(retirement)} FINALIZE`);
}

/**
 * First step of the plain DETACH's transaction: SHARE on the partition alone (ONLY it: reads of the
 * table go on, writes into this partition wait), waiting at most `lockTimeoutMs` for it and, as the
 * setting stays for the transaction, for the DETACH's locks after it: a reader holding the table
 * makes them fail fast (55P03) instead of queueing every later query of the table behind them.
 */
export async function partitionLockForPlainDetach(db: Db, retirement: PartitionRetirement, lockTimeoutMs: number): Promise<void> {
  await db.query(`SELECT set_config('lock_timeout', $1, true)`, [`${Math.max(1, Math.round(lockTimeoutMs))}ms`]);
  await db.query(`LOCK TABLE ONLY ${sourceOf(retirement)} IN SHARE MODE`);
}

/**
 * Plain DETACH (ACCESS EXCLUSIVE on the parent) inside the caller's transaction, taken after the
 * re-check so that the parent's lock is held only for the DDL and the COMMIT.
 */
export async function partitionDetachInTransaction(db: Db, retirement: PartitionRetirement): Promise<void> {
  await db.query(`ALTER TABLE ${retirement.parentTable} DETACH PARTITION ${sourceOf(retirement)}`);
}

/** The re-check of the partition (ONLY it, by its own name, attached or not), with the checksum of its identities (partitionRowsRecheck). */
export function partitionRecheckPartition(db: Db, target: ResolvedTarget, retirement: PartitionRetirement, cutoff: string): Promise<PartitionRowCheck & { held: number; checksum: string }> {
  return partitionRowsRecheck(db, target, sourceOf(retirement), cutoff);
}

/** Takes the detached table's lock for the re-check (inside the transaction that moves it). */
export async function partitionLockDetached(db: Db, retirement: PartitionRetirement): Promise<void> {
  await db.query(`LOCK TABLE ${sourceOf(retirement)} IN ACCESS EXCLUSIVE MODE`);
}

/**
 * The step that makes a retirement final, in the caller's transaction (after the detach and the
 * re-check): the table moves into reaper_retired, the state goes detaching -> quarantined (only
 * from detaching: false when another scheduler got there first, and the caller rolls back), and
 * the audit row (audit on) and the event's outbox row (events on) are written. One transaction:
 * moved, recorded, audited and announced together.
 */
export async function partitionQuarantine(
  db: Db,
  retirement: PartitionRetirement,
  outcome: { rows: number; checksum: string; quarantineDays: number; audit: { policyVersion: string } | null; events: { policyVersion: string } | null },
): Promise<boolean> {
  const updated = await db.query(
    `UPDATE cleanup_partitions SET state = 'quarantined', row_count = $2, key_checksum = $3,
       quarantine_until = clock_timestamp() + $4 * interval '1 day', updated_at = clock_timestamp()
     WHERE retirement_id = $1 AND state = 'detaching'`,
    [retirement.retirementId, outcome.rows, outcome.checksum, outcome.quarantineDays],
  );
  if (updated.rowCount !== 1) return false;
  await db.query(`ALTER TABLE ${sourceOf(retirement)} SET SCHEMA ${name(RETIRED_SCHEMA)}`);
  if (outcome.audit) {
    await db.query(
      `INSERT INTO cleanup_audit (policy, key, observed_expiry, run_id, policy_version, outcome, row_count, partition_bound, key_checksum)
       VALUES ($1, $2, $3, $4, $5, 'partition-retired', $6, $7, $8)`,
      [retirement.policy, `partition:${RETIRED_SCHEMA}.${retirement.retiredName}`, retirement.upperBound, retirement.runId, outcome.audit.policyVersion, outcome.rows, retirement.bound, outcome.checksum],
    );
  }
  if (outcome.events) {
    await outboxInsertPartitionRetired(db, {
      policy: retirement.policy,
      partition: `${RETIRED_SCHEMA}.${retirement.retiredName}`,
      upperBound: retirement.upperBound,
      runId: retirement.runId,
      policyVersion: outcome.events.policyVersion,
      rowCount: outcome.rows,
      bound: retirement.bound,
      keyChecksum: outcome.checksum,
    });
  }
  return true;
}

/**
 * A retirement that will not happen (a row failed the re-check, the lock was not granted, the
 * detach never started): detaching -> kept, with the reason. The partition stays (or is attached
 * again by the caller first) and its rows are the row path's.
 */
export async function partitionKeep(db: Db, retirement: PartitionRetirement, reason: string): Promise<boolean> {
  const result = await db.query(`UPDATE cleanup_partitions SET state = 'kept', reason = $2, updated_at = clock_timestamp() WHERE retirement_id = $1 AND state = 'detaching'`, [
    retirement.retirementId,
    reason,
  ]);
  return result.rowCount === 1;
}

/** Attaches a detached (not yet moved) partition back where it was, with its bound (the re-check failed). */
/**
 * A range bound as pg_get_expr prints it (quoted literals, MINVALUE/MAXVALUE, nothing else): the
 * stored `bound` is pasted into ATTACH, so text of any other shape (a row edited by hand) is refused.
 */
const RANGE_BOUND = /^FOR VALUES FROM \((?:'(?:[^']|'')*'|MINVALUE)\) TO \((?:'(?:[^']|'')*'|MAXVALUE)\)$/;

/** Why a stored retirement's DDL text may not be used for `table` (the policy's resolved table), or null. */
export function partitionStoredTextRefused(retirement: Pick<PartitionRetirement, 'parentTable' | 'bound'>, table: string): string | null {
  if (retirement.parentTable !== table) return `parent_table ${JSON.stringify(retirement.parentTable)} is not the policy's table ${table}`;
  if (!RANGE_BOUND.test(retirement.bound)) return `bound ${JSON.stringify(retirement.bound)} is not a range bound as PostgreSQL prints it`;
  return null;
}

export async function partitionAttachBack(db: Db, retirement: PartitionRetirement): Promise<void> {
  if (!RANGE_BOUND.test(retirement.bound)) throw new Error(`cleanup_partitions.bound ${JSON.stringify(retirement.bound)} of ${retirement.retiredName} is not a range bound as PostgreSQL prints it: not attached`);
  await db.query(`ALTER TABLE ${retirement.parentTable} ATTACH PARTITION ${sourceOf(retirement)} ${retirement.bound}`);
}

/**
 * The scheduler's drop, one retirement per transaction: quarantined -> dropped for the oldest one
 * whose quarantine is over (FOR UPDATE SKIP LOCKED: two schedulers never take the same one), and
 * its table dropped in the same transaction. A crash before COMMIT drops nothing and changes no
 * state; after it, the state says dropped. Null when none is due.
 */
export type PartitionDropOutcome = { kind: 'dropped'; retirement: PartitionRetirement } | { kind: 'not-dropped'; retirement: PartitionRetirement; reason: string };

/**
 * Drops the oldest quarantined retirement of `policy` whose quarantine is over, leaving out the
 * ids in `skip` (the ones this run could not drop). A DROP the database refuses (2BP01: a view
 * depends on the table; 42501; a lock timeout) is rolled back to a savepoint taken before the
 * state change: the retirement stays quarantined and the refusal is returned, never thrown, so one
 * undroppable table cannot fail every run of its policy. Null when none is due.
 */
export async function partitionDropOneDue(db: Db, policy: string, skip: readonly string[] = []): Promise<PartitionDropOutcome | null> {
  await db.query('SAVEPOINT reaper_partition_drop');
  const due = await db.query<RetirementRow>(
    `UPDATE cleanup_partitions SET state = 'dropped', updated_at = clock_timestamp()
     WHERE retirement_id = (SELECT retirement_id FROM cleanup_partitions WHERE policy = $1 AND state = 'quarantined' AND quarantine_until <= clock_timestamp()
                              AND NOT (retirement_id::text = ANY ($2::text[]))
                            ORDER BY retirement_id LIMIT 1 FOR UPDATE SKIP LOCKED)
       AND state = 'quarantined'
     RETURNING ${RETIREMENT_COLUMNS}`,
    [policy, skip],
  );
  const row = due.rows[0];
  if (!row) return null;
  const retirement = toRetirement(row);
  try {
    await db.query(`DROP TABLE IF EXISTS ${retiredOf(retirement)}`);
  } catch (error) {
    if (!(error instanceof pg.DatabaseError)) throw error;
    await db.query('ROLLBACK TO SAVEPOINT reaper_partition_drop');
    return { kind: 'not-dropped', retirement, reason: `database error ${error.code ?? ''}: ${error.message}` };
  }
  return { kind: 'dropped', retirement };
}

/**
 * `reaper restore --partition`, in the caller's transaction: the quarantined retirement locked
 * (FOR UPDATE), checked, moved back into its schema and attached with its bound, marked restored
 * and logged in cleanup_restores (the operator, the bound, the rows it brought back). Refusals are
 * returned, not thrown: 'not-found' (no retirement of that name, or no such table in
 * reaper_retired), 'not-quarantined' (with its state), 'quarantine-ended', 'refused' (its stored
 * parent_table is not the policy's table, or its bound is not a range bound), 'overlaps' (the
 * attached partitions whose range meets its bound).
 *
 * Before the ATTACH, a CHECK constraint matching the bound is added to the table (validated by a
 * scan of that table alone, under its own lock: nobody else uses a retired table): PostgreSQL then
 * skips the ATTACH's scan of the partition, so the parent's lock is not held for it. The
 * constraint is dropped after the ATTACH (the partition constraint says the same). A default
 * partition is still scanned by the ATTACH (docs/guardrails.md "Retiring partitions", Undo).
 */
export type PartitionRestoreOutcome =
  | { kind: 'restored'; retirement: PartitionRetirement; rows: number; partition: string }
  | { kind: 'not-found' }
  | { kind: 'not-quarantined'; state: string }
  | { kind: 'quarantine-ended'; quarantineUntil: string }
  | { kind: 'refused'; reason: string }
  | { kind: 'overlaps'; partitions: string[] };

/** The retirement a retired table's name belongs to (the quarantined one, else the newest); null when none. */
export async function partitionRetirementByRetiredName(db: Db, retiredName: string): Promise<PartitionRetirement | null> {
  const result = await db.query<RetirementRow>(
    `SELECT ${RETIREMENT_COLUMNS} FROM cleanup_partitions WHERE retired_name = $1 ORDER BY (state = 'quarantined') DESC, retirement_id DESC LIMIT 1`,
    [retiredName],
  );
  return result.rows[0] ? toRetirement(result.rows[0]) : null;
}

/** The CHECK constraint restore adds before the ATTACH (and drops after it). */
const RESTORE_CHECK = 'reaper_restore_bound';

export async function partitionRestore(
  db: Db,
  restore: { retiredName: string; table: string; expiresAt: string; restoreId: string; operator: string },
): Promise<PartitionRestoreOutcome> {
  const locked = await db.query<RetirementRow & { ended: boolean; exists: boolean; qualified: string }>(
    `SELECT ${RETIREMENT_COLUMNS}, quarantine_until <= clock_timestamp() AS ended, format('%I.%I', source_schema, source_name) AS qualified,
            to_regclass(format('%I.%I', $2::text, retired_name)) IS NOT NULL AS exists
     FROM cleanup_partitions
     WHERE retired_name = $1 ORDER BY (state = 'quarantined') DESC, retirement_id DESC LIMIT 1 FOR UPDATE`,
    [restore.retiredName, RETIRED_SCHEMA],
  );
  const row = locked.rows[0];
  if (!row) return { kind: 'not-found' };
  const retirement = toRetirement(row);
  if (retirement.state !== 'quarantined') return { kind: 'not-quarantined', state: retirement.state };
  if (!row.exists) return { kind: 'not-found' };
  if (row.ended) return { kind: 'quarantine-ended', quarantineUntil: retirement.quarantineUntil! };
  // The stored text is pasted into DDL: only what the scheduler wrote for the policy's own table.
  const refused = partitionStoredTextRefused(retirement, restore.table);
  if (refused !== null) return { kind: 'refused', reason: refused };
  const overlapping = await db.query<{ name: string }>(
    `SELECT p.qualified AS name FROM (
       SELECT format('%I.%I', n.nspname, c.relname) AS qualified, regexp_match(pg_get_expr(c.relpartbound, c.oid), '^FOR VALUES FROM \\((.*)\\) TO \\((.*)\\)$') AS range
       FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
       WHERE i.inhparent = to_regclass($1)) p
     WHERE p.range IS NOT NULL
       AND (p.range[2] = 'MAXVALUE' OR $2::timestamptz IS NULL OR btrim(p.range[2], '''')::timestamptz > $2::timestamptz)
       AND (p.range[1] = 'MINVALUE' OR btrim(p.range[1], '''')::timestamptz < $3::timestamptz)
     ORDER BY 1`,
    [retirement.parentTable, retirement.lowerBound, retirement.upperBound],
  );
  if (overlapping.rows.length > 0) return { kind: 'overlaps', partitions: overlapping.rows.map((entry) => entry.name) };
  // The table's own lock first (for the count, the CHECK's scan and the DDL), then its rows counted for the log.
  await db.query(`LOCK TABLE ${retiredOf(retirement)} IN ACCESS EXCLUSIVE MODE`);
  const rows = Number((await db.query<{ n: string }>(`SELECT count(*) AS n FROM ${retiredOf(retirement)}`)).rows[0]!.n);
  const column = restore.expiresAt;
  const lower = retirement.lowerBound === null ? '' : ` AND ${column} >= ${pg.escapeLiteral(retirement.lowerBound)}::timestamptz`;
  await db.query(
    `ALTER TABLE ${retiredOf(retirement)} ADD CONSTRAINT ${name(RESTORE_CHECK)} CHECK (${column} IS NOT NULL${lower} AND ${column} < ${pg.escapeLiteral(retirement.upperBound)}::timestamptz)`,
  );
  await db.query(`ALTER TABLE ${retiredOf(retirement)} SET SCHEMA ${name(retirement.sourceSchema)}`);
  await partitionAttachBack(db, retirement);
  await db.query(`ALTER TABLE ${sourceOf(retirement)} DROP CONSTRAINT ${name(RESTORE_CHECK)}`);
  await db.query(`UPDATE cleanup_partitions SET state = 'restored', updated_at = clock_timestamp() WHERE retirement_id = $1 AND state = 'quarantined'`, [retirement.retirementId]);
  await db.query(
    `INSERT INTO cleanup_restores (restore_id, archive_id, run_id, policy, key, outcome, operator, retirement_id, row_count, partition_bound)
     VALUES ($1, NULL, $2, $3, $4, 'restored', $5, $6, $7, $8)`,
    [restore.restoreId, retirement.runId, retirement.policy, `partition:${RETIRED_SCHEMA}.${retirement.retiredName}`, restore.operator, retirement.retirementId, rows, retirement.bound],
  );
  return { kind: 'restored', retirement, rows, partition: row.qualified };
}

/**
 * Partitions of `table` that `reaper restore --partition` attached back and no operator released
 * yet: classified blocked (partitionsClassify), so no run retires them again. Keyed by schema.name
 * quoted as partitionsList's `qualified`; the value is when it was restored.
 */
export async function partitionsRestored(db: Db, table: string): Promise<Map<string, string>> {
  const result = await db.query<{ qualified: string; at: string }>(
    `SELECT format('%I.%I', source_schema, source_name) AS qualified, reaper_iso(updated_at) AS at FROM cleanup_partitions WHERE parent_table = $1 AND state = 'restored'`,
    [table],
  );
  return new Map(result.rows.map((entry) => [entry.qualified, entry.at]));
}

/**
 * `reaper partitions <policy> --release <schema.name>`: restored -> released, so a later run may
 * retire the partition again (a new retirement). How many were released (0: none restored by that name).
 */
export async function partitionRelease(db: Db, policy: string, qualified: string, operator: string): Promise<number> {
  const result = await db.query(
    `UPDATE cleanup_partitions SET state = 'released', reason = 'released by ' || $3, updated_at = clock_timestamp()
     WHERE policy = $1 AND state = 'restored' AND (format('%I.%I', source_schema, source_name) = $2 OR source_schema || '.' || source_name = $2)`,
    [policy, qualified, operator],
  );
  return result.rowCount ?? 0;
}

/**
 * What the current role lacks to retire the target's partitions (docs/design.md invariant 21: a
 * service that lacks what its policies need refuses to start and names the grant): membership in
 * the table's owner role (DETACH, SET SCHEMA, DROP need the owner) and CREATE on reaper_retired.
 * Empty when it has both.
 */
export async function partitionRetirePrivilegesMissing(db: Db, target: Pick<ResolvedTarget, 'table'>): Promise<string[]> {
  const result = await db.query<{ owner: string; member: boolean; can_create: boolean | null }>(
    `SELECT pg_get_userbyid(c.relowner) AS owner, pg_has_role(current_user, c.relowner, 'USAGE') AS member,
            (SELECT has_schema_privilege(current_user, n.oid, 'CREATE') FROM pg_namespace n WHERE n.nspname = $2) AS can_create
     FROM pg_class c WHERE c.oid = to_regclass($1)`,
    [target.table, RETIRED_SCHEMA],
  );
  const row = result.rows[0];
  if (!row) return [];
  const missing: string[] = [];
  if (!row.member) missing.push(`GRANT ${quoteIdentifier(row.owner)} TO current role (the owner of ${target.table}: DETACH, SET SCHEMA and DROP need it; \`reaper roles --print\` grants it)`);
  if (row.can_create === null) missing.push(`schema ${RETIRED_SCHEMA} (run \`reaper migrate\`)`);
  else if (!row.can_create) missing.push(`GRANT USAGE, CREATE ON SCHEMA ${RETIRED_SCHEMA} TO current role`);
  return missing;
}

/**
 * The session advisory lock that lets one scheduler at a time retire a policy's partitions (held on
 * the connection that runs the DDL: a killed scheduler's backend keeps it until its statement ends).
 */
export async function partitionsPolicyLockTry(db: Db, policy: string): Promise<boolean> {
  return (await db.query<{ locked: boolean }>(`SELECT pg_try_advisory_lock(hashtext('reaper-partitions'), hashtext($1)) AS locked`, [policy])).rows[0]!.locked;
}

export async function partitionsPolicyUnlock(db: Db, policy: string): Promise<void> {
  await db.query(`SELECT pg_advisory_unlock(hashtext('reaper-partitions'), hashtext($1))`, [policy]);
}

/**
 * The backlog gauge's side of the same lock (issue 44: a gauge read of the table, in flight when a
 * DETACH ... CONCURRENTLY starts, holds the detach up until it ends): SHARED, for the caller's
 * transaction, never waiting. False while a scheduler retires the policy's partitions (or waits
 * to): the gauge then leaves the policy's table alone this pass.
 */
export async function partitionsPolicyReadLockTry(db: Db, policy: string): Promise<boolean> {
  return (await db.query<{ locked: boolean }>(`SELECT pg_try_advisory_xact_lock_shared(hashtext('reaper-partitions'), hashtext($1)) AS locked`, [policy])).rows[0]!.locked;
}

/**
 * When partitionsPolicyLockTry was refused: true when only readers (gauge reads, shared) hold the
 * lock, no scheduler (exclusive): a shared try is granted only then (it is refused as well while
 * another scheduler waits for it exclusively). Released at once.
 */
export async function partitionsPolicyOnlyReadersHold(db: Db, policy: string): Promise<boolean> {
  const { locked } = (await db.query<{ locked: boolean }>(`SELECT pg_try_advisory_lock_shared(hashtext('reaper-partitions'), hashtext($1)) AS locked`, [policy])).rows[0]!;
  if (locked) await db.query(`SELECT pg_advisory_unlock_shared(hashtext('reaper-partitions'), hashtext($1))`, [policy]);
  return locked;
}

/**
 * The session lock, waited for at most `waitMs` (the readers in flight end; new ones stay out
 * while this waits). In the caller's transaction (lock_timeout is set for it alone); the lock,
 * session-level, outlives it. False on the lock timeout (55P03): the caller rolls back.
 */
export async function partitionsPolicyLockWait(db: Db, policy: string, waitMs: number): Promise<void> {
  await db.query(`SELECT set_config('lock_timeout', $1, true)`, [`${Math.max(1, Math.round(waitMs))}ms`]);
  await db.query(`SELECT pg_advisory_lock(hashtext('reaper-partitions'), hashtext($1))`, [policy]);
}
