import type { Db } from '../pool';
import { guardSql, noActiveHoldProbedOnlyIfAny } from './expiring-rows';
import type { ResolvedTarget } from './target';

/**
 * What is waiting, read from PostgreSQL (the source of truth) for the backlog gauges and for
 * `reaper status`. Every statement here is bounded: the target read walks the policy's
 * (expiresAt, key) index from its oldest end and stops at ELIGIBLE_ROWS_CAP; the ledger and run
 * reads go through partial indexes over the states that are small (pending, in flight, not
 * completed). Ages are computed with the database clock, never a process clock.
 */

/** `reaper_eligible_rows` counts waiting rows up to this many (the gauge then means "at least"). */
export const ELIGIBLE_ROWS_CAP = 10_000;

export interface TargetBacklog {
  /** Now minus the expiry of the oldest row reaper may delete now (the scan's predicate); 0 when none. */
  oldestEligibleAgeSeconds: number;
  /** Expired rows reaper may delete now (guard true, no active hold, not in review), counted up to ELIGIBLE_ROWS_CAP. */
  eligibleRows: number;
  /** Expired rows with the guard true that a legal hold keeps (counted up to the cap): reaper must not delete them. */
  heldRows: number;
  /** remote-delete: expired rows whose operation ended rejected or gave-up, waiting for a person (up to the cap); 0 for row-delete. */
  reviewRows: number;
}

/**
 * One statement per policy. Each subquery is an `ORDER BY expiry LIMIT n` shape over the keyset
 * scan's predicate, so the planner takes the (expiresAt, key) index (partial on the guard where
 * the migration made it so) and reads at most `cap` index entries. "Eligible" is what reaper may
 * delete now, the scan's predicate (expiringRowsExpiredSql: no active hold) and, for remote-delete,
 * no operation that ended in review (rejected, gave-up): a held row or a refused asset is not a
 * backlog and must not page (issue 40), so each has a gauge of its own.
 */
export async function targetBacklogRead(db: Db, target: ResolvedTarget, cap: number = ELIGIBLE_ROWS_CAP, options: { remotePolicy?: boolean } = {}): Promise<TargetBacklog> {
  const { table, expiresAt, key } = target;
  // $1 cap, $2 policy, $3.. guard values.
  const expired = `t.${expiresAt} <= clock_timestamp() AND t.${expiresAt} > '-infinity'::timestamptz${guardSql(target, 3)}`;
  const inReview = options.remotePolicy
    ? `EXISTS (SELECT 1 FROM cleanup_ledger l WHERE l.operation_key = $2 || ':' || t.${key}::text || ':' || reaper_iso(t.${expiresAt})
         AND l.state = 'done' AND l.outcome IN ('rejected', 'gave-up'))`
    : 'false';
  const notHeld = noActiveHoldProbedOnlyIfAny('$2', `t.${key}`);
  const eligible = `${expired} AND ${notHeld} AND NOT ${inReview}`;
  const result = await db.query<{ oldest_age: number | null; waiting: number; held: number; review: number }>(
    `SELECT greatest(0, extract(epoch FROM clock_timestamp() - (SELECT t.${expiresAt} FROM ${table} t WHERE ${eligible} ORDER BY t.${expiresAt} LIMIT 1)))::float8 AS oldest_age,
            (SELECT count(*) FROM (SELECT 1 FROM ${table} t WHERE ${eligible} ORDER BY t.${expiresAt} LIMIT $1) capped)::int AS waiting,
            (SELECT count(*) FROM (SELECT 1 FROM ${table} t WHERE ${expired} AND NOT ${notHeld} ORDER BY t.${expiresAt} LIMIT $1) capped)::int AS held,
            (SELECT count(*) FROM (SELECT 1 FROM ${table} t WHERE ${expired} AND ${notHeld} AND ${inReview} ORDER BY t.${expiresAt} LIMIT $1) capped)::int AS review`,
    [cap, target.policy, ...target.guardValues],
  );
  const row = result.rows[0]!;
  return { oldestEligibleAgeSeconds: row.oldest_age ?? 0, eligibleRows: row.waiting, heldRows: row.held, reviewRows: row.review };
}

/**
 * For the caller's transaction: no JIT compilation. The backlog statement's subqueries are
 * LIMIT-bounded index reads, but on a table of a few hundred thousand rows their estimated cost
 * passes jit_above_cost: compiling took 0.5 s on an idle 2-core machine and 2-5 s on a loaded one
 * for a statement that runs in 1 ms (issue 44: a DETACH ... CONCURRENTLY waited for it).
 */
export async function backlogReadWithoutJit(db: Db): Promise<void> {
  await db.query(`SELECT set_config('jit', 'off', true)`);
}

export interface LedgerBacklog {
  /** Now minus `not_before` of the oldest pending operation that is due; 0 when none. */
  oldestRunnableAgeSeconds: number;
  /**
   * Age of the oldest in-flight lease: now minus (its lease_expires_at - the policy's lease), i.e.
   * since it was claimed; 0 when none. Keeps rising past the lease while nobody reclaims it.
   */
  oldestLeasedAgeSeconds: number;
}

/** Both from the ledger's partial indexes (pending by not_before, in flight by lease_expires_at). */
export async function ledgerBacklogRead(db: Db, policy: string, leaseMs: number): Promise<LedgerBacklog> {
  const result = await db.query<{ runnable: number | null; leased: number | null }>(
    `SELECT greatest(0, extract(epoch FROM clock_timestamp() - (
              SELECT not_before FROM cleanup_ledger WHERE policy = $1 AND state = 'pending' AND not_before <= clock_timestamp()
              ORDER BY not_before LIMIT 1)))::float8 AS runnable,
            greatest(0, extract(epoch FROM clock_timestamp() - (
              SELECT lease_expires_at FROM cleanup_ledger WHERE policy = $1 AND state = 'in_flight'
              ORDER BY lease_expires_at LIMIT 1)) + $2::float8 / 1000)::float8 AS leased`,
    [policy, leaseMs],
  );
  const row = result.rows[0]!;
  return { oldestRunnableAgeSeconds: row.runnable ?? 0, oldestLeasedAgeSeconds: row.leased ?? 0 };
}

export interface LedgerStateCount {
  policy: string;
  state: string;
  /** '' for operations not finished (pending, in_flight). */
  outcome: string;
  count: number;
}

/**
 * Operations by (policy, state, outcome). Pending and in-flight come from their partial indexes;
 * finished ones from cleanup_ledger_done_by_outcome (migration 0008), an index-only count that
 * grows with the ledger: its cost is the reason finished operations are worth pruning.
 */
export async function ledgerStateCounts(db: Db, policies: readonly string[]): Promise<LedgerStateCount[]> {
  const result = await db.query<{ policy: string; state: string; outcome: string; n: number }>(
    `SELECT policy, state, '' AS outcome, count(*)::int AS n FROM cleanup_ledger
       WHERE policy = ANY($1::text[]) AND state IN ('pending', 'in_flight') GROUP BY policy, state
     UNION ALL
     SELECT policy, 'done', outcome, count(*)::int FROM cleanup_ledger
       WHERE policy = ANY($1::text[]) AND state = 'done' GROUP BY policy, outcome`,
    [policies],
  );
  return result.rows.map((row) => ({ policy: row.policy, state: row.state, outcome: row.outcome, count: row.n }));
}

export interface RunStateCount {
  policy: string;
  state: string;
  count: number;
}

/**
 * Runs by state, every state except 'completed' (the long tail; its health is the last completed
 * run's timestamp). Served by cleanup_runs_not_completed (migration 0008).
 */
export async function runStateCounts(db: Db, policies: readonly string[]): Promise<RunStateCount[]> {
  const result = await db.query<{ policy: string; state: string; n: number }>(
    `SELECT policy, state, count(*)::int AS n FROM cleanup_runs WHERE policy = ANY($1::text[]) AND state <> 'completed' GROUP BY policy, state`,
    [policies],
  );
  return result.rows.map((row) => ({ policy: row.policy, state: row.state, count: row.n }));
}

export interface LastCompletedRun {
  policy: string;
  runId: string;
  finishedAt: string;
  finishedAtSeconds: number;
  /** Finished minus cutoff: how long after the instant it expired up to the run had it all done. */
  lagSeconds: number;
}

/** The latest completed run of each policy (cleanup_runs_completed_by_finish, migration 0008). */
export async function runsLastCompleted(db: Db, policies: readonly string[]): Promise<LastCompletedRun[]> {
  const result = await db.query<{ policy: string; run_id: string; finished_at: string; finished_s: number; lag_s: number }>(
    `SELECT p.policy, r.run_id, reaper_iso(r.finished_at) AS finished_at, extract(epoch FROM r.finished_at)::float8 AS finished_s,
            extract(epoch FROM r.finished_at - r.cutoff)::float8 AS lag_s
     FROM unnest($1::text[]) AS p(policy)
     CROSS JOIN LATERAL (SELECT run_id, finished_at, cutoff FROM cleanup_runs
                         WHERE policy = p.policy AND state = 'completed' ORDER BY finished_at DESC LIMIT 1) r`,
    [policies],
  );
  return result.rows.map((row) => ({
    policy: row.policy,
    runId: row.run_id,
    finishedAt: row.finished_at,
    finishedAtSeconds: row.finished_s,
    lagSeconds: row.lag_s,
  }));
}

export interface CompletedRun {
  runId: string;
  policy: string;
  /** Created (proposed) to completed: includes waiting to be claimed and the workers' share. */
  seconds: number;
  finishedAtSeconds: number;
}

/**
 * Runs `owner` (a scheduler's id) executed that completed after `sinceSeconds` (epoch), and the
 * database clock now. A run has one owner at the end (the last scheduler that claimed it), so each
 * completed run is reported to exactly one replica however many run. `sinceSeconds` null: none.
 */
export async function runsCompletedSince(
  db: Db,
  owner: string,
  policies: readonly string[],
  sinceSeconds: number | null,
): Promise<{ nowSeconds: number; runs: CompletedRun[] }> {
  const result = await db.query<{ now_s: number; runs: CompletedRun[] }>(
    `SELECT extract(epoch FROM clock_timestamp())::float8 AS now_s,
            coalesce((SELECT json_agg(json_build_object('runId', run_id, 'policy', policy,
                        'seconds', greatest(0, extract(epoch FROM finished_at - created_at))::float8,
                        'finishedAtSeconds', extract(epoch FROM finished_at)::float8))
                      FROM cleanup_runs
                      WHERE policy = ANY($2::text[]) AND state = 'completed' AND finished_at > to_timestamp($3::float8) AND owner = $1), '[]') AS runs`,
    [owner, policies, sinceSeconds],
  );
  const row = result.rows[0]!;
  return { nowSeconds: row.now_s, runs: row.runs };
}

export interface AdmissionGaugeRow {
  policy: string;
  paused: boolean;
  /** Epoch seconds the current 429 block lasts until; 0 when not blocked (or it has passed). */
  blockedUntilSeconds: number;
}

export async function admissionGaugeRead(db: Db, policies: readonly string[]): Promise<AdmissionGaugeRow[]> {
  const result = await db.query<{ policy: string; paused: boolean; blocked_until_s: number }>(
    `SELECT policy, paused,
            CASE WHEN blocked_until > clock_timestamp() THEN extract(epoch FROM blocked_until) ELSE 0 END::float8 AS blocked_until_s
     FROM cleanup_admission WHERE policy = ANY($1::text[])`,
    [policies],
  );
  return result.rows.map((row) => ({ policy: row.policy, paused: row.paused, blockedUntilSeconds: row.blocked_until_s }));
}
