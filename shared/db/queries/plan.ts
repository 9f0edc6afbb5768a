import type { Db } from '../pool';
import { guardSql, ledgerCarriesDecisionSql } from './expiring-rows';
import type { ResolvedTarget } from './target';
import { noActiveHold } from './holds';

/**
 * What a run would do at a cutoff, read without writing anything: the same predicate as the scan
 * (guard, finite expiry <= cutoff, no active hold), counted, plus what the brake compares with.
 */
export interface PlanCounts {
  candidates: number;
  /** Expired rows left out by an active legal hold. */
  held: number;
  /** Rows satisfying the guard, expired or not: the base of maxFractionPerRun. */
  guarded: number;
  /** Rows whose expiry is '-infinity' (never published; see expiringRowsCountNonFinite). */
  nonFinite: number;
  oldestExpiry: string | null;
  newestExpiry: string | null;
}

export async function planCount(db: Db, target: ResolvedTarget, cutoff: string, options: { unrecordedFor?: string } = {}): Promise<PlanCounts> {
  const guard = guardSql(target, 4);
  // remote-delete: what the scan publishes leaves out decisions the ledger already carries.
  const recorded = options.unrecordedFor ? ledgerCarriesDecisionSql('$3', target) : 'false AND $3::text IS NULL';
  const result = await db.query<{
    candidates: string;
    held: string;
    guarded: string;
    non_finite: string;
    oldest: string | null;
    newest: string | null;
  }>(
    `SELECT count(*) FILTER (WHERE expired AND NOT held) AS candidates, count(*) FILTER (WHERE expired AND held) AS held,
            count(*) AS guarded, count(*) FILTER (WHERE non_finite) AS non_finite,
            reaper_iso(min(expiry) FILTER (WHERE expired AND NOT held)) AS oldest,
            reaper_iso(max(expiry) FILTER (WHERE expired AND NOT held)) AS newest
     FROM (SELECT t.${target.expiresAt} AS expiry,
                  t.${target.expiresAt} <= $1::timestamptz AND t.${target.expiresAt} > '-infinity'::timestamptz AND NOT (${recorded}) AS expired,
                  t.${target.expiresAt} = '-infinity'::timestamptz AS non_finite,
                  NOT ${noActiveHold('$2', `t.${target.key}`)} AS held
           FROM ${target.table} t WHERE true${guard}) x`,
    [cutoff, target.policy, options.unrecordedFor ?? null, ...target.guardValues],
  );
  const row = result.rows[0]!;
  return {
    candidates: Number(row.candidates),
    held: Number(row.held),
    guarded: Number(row.guarded),
    nonFinite: Number(row.non_finite),
    oldestExpiry: row.oldest,
    newestExpiry: row.newest,
  };
}

/**
 * The first `limit` candidate keys in scan order: planCount's candidates (guard, finite expiry <=
 * cutoff, no active hold, and with `unrecordedFor` no decision the ledger already carries).
 */
export async function planSample(db: Db, target: ResolvedTarget, cutoff: string, limit: number, options: { unrecordedFor?: string } = {}): Promise<string[]> {
  const guard = guardSql(target, 5);
  const recorded = options.unrecordedFor ? ledgerCarriesDecisionSql('$4', target) : 'false AND $4::text IS NULL';
  const result = await db.query<{ id: string }>(
    `SELECT t.${target.key}::text AS id FROM ${target.table} t
     WHERE t.${target.expiresAt} <= $1::timestamptz AND t.${target.expiresAt} > '-infinity'::timestamptz${guard}
       AND NOT (${recorded}) AND ${noActiveHold('$2', `t.${target.key}`)}
     ORDER BY t.${target.expiresAt}, t.${target.key} LIMIT $3`,
    [cutoff, target.policy, limit, options.unrecordedFor ?? null, ...target.guardValues],
  );
  return result.rows.map((row) => row.id);
}

/** Rows per second of the policy's recent completed runs (trigger to finish); null without history. */
export async function planRecentRowsPerSecond(db: Db, policy: string): Promise<number | null> {
  const result = await db.query<{ rate: number | null }>(
    `SELECT sum(b.deleted + b.noop) / nullif(sum(extract(epoch FROM r.finished_at - r.started_at)), 0) AS rate
     FROM (SELECT run_id, started_at, finished_at FROM cleanup_runs
           WHERE policy = $1 AND state = 'completed' AND started_at IS NOT NULL AND finished_at > started_at
           ORDER BY finished_at DESC LIMIT 5) r
     CROSS JOIN LATERAL (SELECT coalesce(sum(deleted), 0) AS deleted, coalesce(sum(noop), 0) AS noop FROM cleanup_batches WHERE run_id = r.run_id) b`,
    [policy],
  );
  const rate = result.rows[0]?.rate;
  return rate === null || rate === undefined ? null : Number(rate);
}

/**
 * The most rows one statement of the brake's count reads. The brake only needs "over the limit or
 * not" and a count an operator can approve; a bound keeps the count inside the statement timeout
 * (REAPER_STATEMENT_TIMEOUT_MS, 60 s) on any table size: about a million index entries, each with
 * its hold probe, take a second or two. Beyond it the count says "at least" (docs/guardrails.md "Guardrails").
 */
export const BRAKE_COUNT_CAP = 1_000_000;

/** What the brake counted, each part bounded. */
export interface BrakeCount {
  /** Candidates after the cursor (the scan's own predicate), counted up to the cap. */
  candidates: number;
  /** The candidate count stopped at the cap: there are at least that many. */
  candidatesCapped: boolean;
  /**
   * Rows satisfying the guard (expired or not), the base of maxFractionPerRun: exact below the cap;
   * from the cap on, the planner's row estimate for the guard (never less than the cap). Null when
   * not asked for.
   */
  guarded: number | null;
  guardedEstimated: boolean;
}

/**
 * The brake's count: the rows the scan would still publish after `after` (guard, finite expiry
 * <= cutoff, no active hold, remote-delete: no ledger operation yet), walking the scan's
 * (expiresAt, key) order and stopping at `cap`; and, for maxFractionPerRun, the guarded rows up to
 * `cap`, then the planner's estimate. Two bounded statements, never a count of the whole table.
 */
export async function planBrakeCount(
  db: Db,
  target: ResolvedTarget,
  options: { cutoff: string; after: { expiry: string; key: string } | null; unrecordedFor?: string; guarded: boolean; cap?: number },
): Promise<BrakeCount> {
  const cap = options.cap ?? BRAKE_COUNT_CAP;
  const { table, key, expiresAt, keyType } = target;
  const params: unknown[] = [options.cutoff, cap, target.policy];
  let after = '';
  if (options.after) {
    params.push(options.after.expiry, options.after.key);
    after = ` AND (t.${expiresAt}, t.${key}) > ($4::timestamptz, $5::${keyType})`;
  }
  let unrecorded = '';
  if (options.unrecordedFor !== undefined) {
    params.push(options.unrecordedFor);
    unrecorded = ` AND NOT ${ledgerCarriesDecisionSql(`$${params.length}`, target)}`;
  }
  const guardFrom = params.length + 1;
  params.push(...target.guardValues);
  const counted = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM (
       SELECT 1 FROM ${table} t
       WHERE t.${expiresAt} <= $1::timestamptz AND t.${expiresAt} > '-infinity'::timestamptz${after}${guardSql(target, guardFrom)}${unrecorded}
         AND ${noActiveHold('$3', `t.${key}`)}
       ORDER BY t.${expiresAt}, t.${key} LIMIT $2) capped`,
    params,
  );
  const candidates = counted.rows[0]!.n;
  const result: BrakeCount = { candidates, candidatesCapped: candidates >= cap, guarded: null, guardedEstimated: false };
  if (!options.guarded) return result;
  const guard = guardSql(target, 2);
  const guarded = await db.query<{ n: number }>(`SELECT count(*)::int AS n FROM (SELECT 1 FROM ${table} t WHERE true${guard} LIMIT $1) capped`, [
    cap,
    ...target.guardValues,
  ]);
  result.guarded = guarded.rows[0]!.n;
  if (result.guarded >= cap) {
    // More guarded rows than one bounded statement counts: the planner's estimate (its statistics,
    // current after ANALYZE) stands in for the rest, at no cost that grows with the table.
    const plan = await db.query<{ 'QUERY PLAN': Array<{ Plan: { 'Plan Rows': number } }> }>(
      `EXPLAIN (FORMAT JSON) SELECT 1 FROM ${table} t WHERE true${guardSql(target, 1)}`,
      [...target.guardValues],
    );
    result.guarded = Math.max(cap, Math.round(plan.rows[0]!['QUERY PLAN'][0]!.Plan['Plan Rows']));
    result.guardedEstimated = true;
  }
  return result;
}
