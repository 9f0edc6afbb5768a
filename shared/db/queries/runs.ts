import { randomUUID } from 'node:crypto';
import type { Db } from '../pool';
import { prepared } from './prepared';

/**
 * NOTIFY channel: every new run is announced on commit, so schedulers start it at once instead of
 * at their next poll (the poll stays, for a lost notification or a scheduler that was reconnecting).
 */
export const RUNS_CHANNEL = 'reaper_runs';

/** Run triggers (docs/design.md). Only cron and catch-up runs take part in the one-run-per-tick rule. */
export type RunTrigger = 'cron' | 'catch-up' | 'replay' | 'manual';
/**
 * `failed`: a permanent error stopped the scan (reason in `error`). `incomplete`: published, but
 * some batches never got a receipt and nothing happened for a while (counts in `error`).
 */
export type RunState = 'pending' | 'scanning' | 'published' | 'completed' | 'failed' | 'incomplete' | 'awaiting-approval' | 'rejected';

/**
 * What a scheduler holds while it executes a run: the owner name AND the claim number. Every
 * conditional change of a run checks both, so two processes started with the same
 * REAPER_WORKER_ID never checkpoint or finish each other's claims.
 */
export interface RunClaim {
  runId: string;
  owner: string;
  claim: number;
}

/** A run as the services use it; timestamps that matter for eligibility stay microsecond strings. */
export interface Run {
  runId: string;
  policy: string;
  trigger: RunTrigger;
  scheduledFor: string;
  cutoff: string;
  state: RunState;
  replayOf: string | null;
  cursor: { expiry: string; key: string } | null;
  /** Times a scheduler claimed the run (more than 1 after a takeover). */
  claimCount: number;
  candidates: number;
  /** Rows read by the scan but not published (keys longer than a message may carry). */
  skipped: number;
  batchesConfirmed: number;
  error: string | null;
  createdAt: string;
  finishedAt: string | null;
  /** Set by `reaper approve`: the brake lets this run through. */
  approvedAt: string | null;
  /** Who approved or rejected it. */
  decidedBy: string | null;
  /** The hash of the policy definition the run was executed under. */
  policyVersion: string | null;
  /**
   * The brake's latest count for the run: published so far plus still to publish, counted up to a
   * bound (plan.ts BRAKE_COUNT_CAP). What an operator approves. Null: never counted.
   */
  countedCandidates: number | null;
  /** What the operator approved: the count, and the policy version it was counted under. */
  approvedCandidates: number | null;
  approvedPolicyVersion: string | null;
  /**
   * Candidates earlier claims may have published past their last checkpoint (a takeover folds the
   * window the lost claim was publishing in here): counted against the brake's allowance.
   */
  unconfirmedCandidates: number;
  /** How many times the brake held the run: the current hold's number while it awaits approval. */
  holdCount: number;
}

/** A run with the workers' receipts summed in. */
export interface RunSummary extends Run {
  batchesDone: number;
  deleted: number;
  noop: number;
}

interface RunRow {
  run_id: string;
  policy: string;
  trigger: RunTrigger;
  scheduled_for: string;
  cutoff: string;
  state: RunState;
  replay_of: string | null;
  cursor_expiry: string | null;
  cursor_key: string | null;
  claim_count: number;
  candidates: string;
  skipped: string;
  batches_confirmed: number;
  error: string | null;
  created_at: string;
  finished_at: string | null;
  approved_at: string | null;
  decided_by: string | null;
  policy_version: string | null;
  counted_candidates: string | null;
  approved_candidates: string | null;
  approved_policy_version: string | null;
  unconfirmed_candidates: string;
  hold_count: number;
}

const RUN_COLUMNS = `run_id, policy, trigger, reaper_iso(scheduled_for) AS scheduled_for, reaper_iso(cutoff) AS cutoff,
  state, replay_of, reaper_iso(cursor_expiry) AS cursor_expiry, cursor_key, claim_count, candidates, skipped, batches_confirmed, error,
  reaper_iso(created_at) AS created_at, reaper_iso(finished_at) AS finished_at, reaper_iso(approved_at) AS approved_at, decided_by, policy_version,
  counted_candidates, approved_candidates, approved_policy_version, unconfirmed_candidates, hold_count`;

function toRun(row: RunRow): Run {
  return {
    runId: row.run_id,
    policy: row.policy,
    trigger: row.trigger,
    scheduledFor: row.scheduled_for,
    cutoff: row.cutoff,
    state: row.state,
    replayOf: row.replay_of,
    cursor: row.cursor_expiry !== null && row.cursor_key !== null ? { expiry: row.cursor_expiry, key: row.cursor_key } : null,
    claimCount: row.claim_count,
    candidates: Number(row.candidates),
    skipped: Number(row.skipped),
    batchesConfirmed: row.batches_confirmed,
    error: row.error,
    createdAt: row.created_at,
    finishedAt: row.finished_at,
    approvedAt: row.approved_at,
    decidedBy: row.decided_by,
    policyVersion: row.policy_version,
    countedCandidates: row.counted_candidates === null ? null : Number(row.counted_candidates),
    approvedCandidates: row.approved_candidates === null ? null : Number(row.approved_candidates),
    approvedPolicyVersion: row.approved_policy_version,
    unconfirmedCandidates: Number(row.unconfirmed_candidates),
    holdCount: row.hold_count,
  };
}

/**
 * Records a run. `scheduledFor` null means "now" (manual and replay runs); `cutoff` null means the
 * database clock now. Returns null when a run for this (policy, scheduled_for) already exists: a
 * second replica seeing the same tick is a normal outcome, not an error.
 */
export async function runsInsertIfAbsent(
  db: Db,
  run: { policy: string; trigger: RunTrigger; scheduledFor: Date | null; cutoff: string | null; replayOf?: string | null },
): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `WITH inserted AS (
       INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, replay_of)
       VALUES ($1, $2, $3, coalesce($4::timestamptz, clock_timestamp()), coalesce($5::timestamptz, statement_timestamp()), $6)
       ON CONFLICT (policy, scheduled_for) DO NOTHING
       RETURNING *)
     SELECT ${RUN_COLUMNS}, pg_notify('${RUNS_CHANNEL}', policy) FROM inserted`,
    [randomUUID(), run.policy, run.trigger, run.scheduledFor?.toISOString() ?? null, run.cutoff, run.replayOf ?? null],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}

/**
 * A manual run for `policy` unless one is already waiting to start (pending): many webhooks in a
 * burst propose one run, not one each. Returns null when one was waiting.
 */
export async function runsInsertManualUnlessOneWaits(db: Db, policy: string): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `WITH inserted AS (
       INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff)
       SELECT $1, $2, 'manual', clock_timestamp(), statement_timestamp()
       WHERE NOT EXISTS (SELECT 1 FROM cleanup_runs WHERE policy = $2 AND state = 'pending')
       ON CONFLICT (policy, scheduled_for) DO NOTHING
       RETURNING *)
     SELECT ${RUN_COLUMNS}, pg_notify('${RUNS_CHANNEL}', policy) FROM inserted`,
    [randomUUID(), policy],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}

/**
 * Claims the oldest run that is waiting (pending) or was abandoned mid-scan (its owner's lease
 * expired), for `owner`, with a fresh lease. SKIP LOCKED keeps replicas from blocking each other.
 */
export async function runsClaimNext(db: Db, owner: string, leaseMs: number, policies: readonly string[]): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `UPDATE cleanup_runs SET owner = $1, lease_expires_at = clock_timestamp() + $2 * interval '1 millisecond',
       state = 'scanning', started_at = coalesce(started_at, clock_timestamp()), claim_count = claim_count + 1,
       unconfirmed_candidates = unconfirmed_candidates + window_candidates, window_candidates = 0
     WHERE run_id = (
       SELECT run_id FROM cleanup_runs
       WHERE state IN ('pending', 'scanning') AND policy = ANY($3::text[])
         AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
       ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED)
     RETURNING ${RUN_COLUMNS}`,
    [owner, leaseMs, policies],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}

/** The claim a scheduler holds after runsClaimNext returned `run` to `owner`. */
export function runClaimOf(run: Run, owner: string): RunClaim {
  return { runId: run.runId, owner, claim: run.claimCount };
}

/** Conditions every change by the executing scheduler carries ($1 run, $2 owner, $3 claim). */
const HELD_BY_CLAIM = `run_id = $1 AND owner = $2 AND claim_count = $3 AND state = 'scanning'`;

/**
 * Stores scan progress after the broker confirmed every batch up to `cursor`: the cursor, the
 * run's TOTALS (not increments), the ids of those batches (what completion waits for), and a
 * longer lease. Conditional on holding the claim, and on the run still being at `from` (the
 * cursor this window started at) or already at `cursor` with these totals: a retry after a commit
 * whose answer was lost writes the same values again and counts nothing twice.
 * false means the claim is lost (another scheduler took the run over): this one must stop.
 */
export async function runsRecordProgress(
  db: Db,
  progress: {
    claim: RunClaim;
    from: { expiry: string; key: string } | null;
    cursor: { expiry: string; key: string };
    totals: { candidates: number; skipped: number; batchesConfirmed: number };
    batchIds: readonly string[];
    leaseMs: number;
  },
): Promise<boolean> {
  const { claim, totals } = progress;
  const result = await db.query<{ updated: number }>(
    `WITH progress AS (
       UPDATE cleanup_runs SET cursor_expiry = $4::timestamptz, cursor_key = $5, candidates = $6, skipped = $7,
         batches_confirmed = $8, window_candidates = 0, lease_expires_at = clock_timestamp() + $9 * interval '1 millisecond'
       WHERE ${HELD_BY_CLAIM}
         AND ((cursor_expiry IS NOT DISTINCT FROM $11::timestamptz AND cursor_key IS NOT DISTINCT FROM $12::text)
           OR (cursor_expiry = $4::timestamptz AND cursor_key = $5 AND candidates = $6 AND skipped = $7 AND batches_confirmed = $8))
       RETURNING run_id
     ), expected AS (
       INSERT INTO cleanup_run_batches (batch_id, run_id)
       SELECT id, progress.run_id FROM progress CROSS JOIN unnest($10::text[]) AS id
       ON CONFLICT (batch_id) DO NOTHING
       RETURNING 1
     )
     SELECT (SELECT count(*) FROM progress)::int AS updated, (SELECT count(*) FROM expected) AS expected`,
    [
      claim.runId,
      claim.owner,
      claim.claim,
      progress.cursor.expiry,
      progress.cursor.key,
      totals.candidates,
      totals.skipped,
      totals.batchesConfirmed,
      progress.leaseMs,
      progress.batchIds,
      progress.from?.expiry ?? null,
      progress.from?.key ?? null,
    ],
  );
  return result.rows[0]!.updated === 1;
}

/**
 * Extends the lease while the holder backs off from a retryable error. false: the claim is lost
 * (the lease had expired and another scheduler took the run over, or it finished).
 */
export async function runsExtendLease(db: Db, claim: RunClaim, leaseMs: number): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET lease_expires_at = clock_timestamp() + $4 * interval '1 millisecond' WHERE ${HELD_BY_CLAIM}`,
    [claim.runId, claim.owner, claim.claim, leaseMs],
  );
  return result.rowCount === 1;
}

/** Records the brake's count on a run that goes on (within its allowance): what `status` and `run` show. */
export async function runsRecordCount(db: Db, claim: RunClaim, counted: number): Promise<boolean> {
  const result = await db.query(`UPDATE cleanup_runs SET counted_candidates = $4 WHERE ${HELD_BY_CLAIM}`, [claim.runId, claim.owner, claim.claim, counted]);
  return result.rowCount === 1;
}

/**
 * The claim check before a window is published: extends the lease and records how many
 * candidates the window carries (until its checkpoint; a takeover before it counts them against
 * the allowance). false: the claim is lost, publish nothing.
 */
export async function runsBeginWindow(db: Db, claim: RunClaim, candidates: number, leaseMs: number): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET lease_expires_at = clock_timestamp() + $4 * interval '1 millisecond', window_candidates = $5 WHERE ${HELD_BY_CLAIM}`,
    [claim.runId, claim.owner, claim.claim, leaseMs, candidates],
  );
  return result.rowCount === 1;
}

/**
 * The scan reached the end: every batch is confirmed by the broker. Conditional on the claim.
 * `note` (a run that published nothing on purpose says why) is kept in the run's reason.
 */
export async function runsMarkPublished(db: Db, claim: RunClaim, note: string | null = null): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET state = 'published', published_at = clock_timestamp(), lease_expires_at = NULL, error = coalesce($4, error) WHERE ${HELD_BY_CLAIM}`,
    [claim.runId, claim.owner, claim.claim, note],
  );
  return result.rowCount === 1;
}

/** Undelivered batches counted per earlier run, at most (the answer only needs "some", and a size for the log). */
export const UNDELIVERED_COUNT_CAP = 1_000;

/**
 * remote-delete: an earlier run of the policy, published within `withinMs`, some of whose batches
 * no worker has received yet — no receipt, and not kept (a worker keeps a batch in
 * cleanup_remote_batches at its first delivery, in the transaction that records its operations,
 * and writes the receipt when it is done). Those batches still sit in the broker and carry their
 * items; a new scan would find the same items unrecorded in the ledger and publish them again.
 * Null when there is none. Only batches after the run's completion cursor are looked at (those
 * before it have receipts), at most UNDELIVERED_COUNT_CAP per run.
 */
export async function runsEarlierWithUndeliveredBatches(
  db: Db,
  query: { policy: string; runId: string; withinMs: number },
): Promise<{ runId: string; undelivered: number } | null> {
  const result = await db.query<{ run_id: string; undelivered: number }>(
    `SELECT r.run_id, u.undelivered
     FROM cleanup_runs r
     CROSS JOIN LATERAL (
       SELECT count(*)::int AS undelivered FROM (
         SELECT 1 FROM cleanup_run_batches rb
         WHERE rb.run_id = r.run_id AND rb.batch_id > coalesce(r.completion_cursor, '')
           AND NOT EXISTS (SELECT 1 FROM cleanup_batches b WHERE b.batch_id = rb.batch_id)
           AND NOT EXISTS (SELECT 1 FROM cleanup_remote_batches k WHERE k.batch_id = rb.batch_id)
         LIMIT $4) x
     ) u
     WHERE r.policy = $1 AND r.run_id <> $2 AND r.state = 'published'
       AND r.published_at > clock_timestamp() - $3 * interval '1 millisecond' AND u.undelivered > 0
     ORDER BY r.published_at DESC LIMIT 1`,
    [query.policy, query.runId, query.withinMs, UNDELIVERED_COUNT_CAP],
  );
  const row = result.rows[0];
  return row ? { runId: row.run_id, undelivered: row.undelivered } : null;
}

/** Gives the lease up at shutdown so another replica resumes the run at once, from the cursor. */
export async function runsReleaseLease(db: Db, claim: RunClaim): Promise<void> {
  await db.query(`UPDATE cleanup_runs SET lease_expires_at = clock_timestamp() WHERE ${HELD_BY_CLAIM}`, [claim.runId, claim.owner, claim.claim]);
}

/** A permanent error ends the run with its reason. Conditional on the claim. */
export async function runsMarkFailed(db: Db, claim: RunClaim, error: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET state = 'failed', error = $4, finished_at = clock_timestamp(), lease_expires_at = NULL WHERE ${HELD_BY_CLAIM}`,
    [claim.runId, claim.owner, claim.claim, error],
  );
  return result.rowCount === 1;
}

/**
 * Published runs every one of whose confirmed batches has a receipt become completed. Batches up
 * to the run's completion cursor are known to have one (runsSettlePublished): only those after it are looked at.
 */
const COMPLETE_WHERE_ALL_RECEIPTS = `r.state = 'published' AND NOT EXISTS (
    SELECT 1 FROM cleanup_run_batches rb
    WHERE rb.run_id = r.run_id AND rb.batch_id > coalesce(r.completion_cursor, '')
      AND NOT EXISTS (SELECT 1 FROM cleanup_batches b WHERE b.batch_id = rb.batch_id))`;

export async function runsCompleteIfAllBatchesDone(db: Db, runId: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs r SET state = 'completed', finished_at = clock_timestamp() WHERE r.run_id = $1 AND ${COMPLETE_WHERE_ALL_RECEIPTS}`,
    [runId],
  );
  return result.rowCount === 1;
}

/** What one pass of runsSettlePublished decided for a run it looked at. */
export interface PublishedRunCheck {
  runId: string;
  policy: string;
  state: 'published' | 'completed' | 'incomplete';
  batchesConfirmed: number;
  /** Batches without a receipt: exact when the run became `incomplete`, 0 when completed, null while it stays published (not counted). */
  batchesMissing: number | null;
  /**
   * Every batch this pass walked had its receipt and the walk stopped at its bound, not at the
   * run's end: another pass right away moves the cursor further (a run published with all its
   * receipts in took one pass per `walk` batches, a completion-poll interval apart).
   */
  moreToWalk: boolean;
}

/**
 * Batches of one run a completion pass looks at, at most: with COMPLETION_BATCH runs per pass,
 * a pass's work is bounded whatever the size of the runs (issue 18).
 */
export const COMPLETION_WALK_BATCHES = 2_000;

/**
 * The scheduler's completion pass, bounded and incremental: it looks at no more than `limit`
 * published runs, the ones checked longest ago first (round robin over the partial index), never
 * at all of them; and for each, at no more than `walk` of its batches. Each run keeps a completion
 * cursor (migration 0023): every batch up to it, in batch id order, has a receipt. A pass walks
 * the batches after the cursor, moves the cursor over the ones with a receipt up to the first
 * without, and completes the run when its walk finds every batch left settled. A run's batches are
 * fixed once it is published, so the cursor never passes a batch that could still be added.
 *
 * A run still missing receipts with none written for `incompleteAfterMs` (counted from
 * publication or the run's latest receipt, one index probe) becomes `incomplete`, its counts in
 * `error` (counted then, once): a batch dead-lettered or a delay copy lost would otherwise keep it
 * `published`, and in this pass, forever. Receipts that arrive later still count in the run's
 * totals (deleted, no-op); its state stays `incomplete`.
 */
export async function runsSettlePublished(db: Db, options: { limit: number; incompleteAfterMs: number; walk?: number }): Promise<PublishedRunCheck[]> {
  // Named: four passes a second per scheduler, planned once per connection.
  const result = await db.query<{ run_id: string; policy: string; state: PublishedRunCheck['state']; batches_confirmed: number; missing: number | null; more_to_walk: boolean }>(prepared(
    'runs_settle_published',
    `WITH picked AS (
       SELECT run_id, completion_cursor FROM cleanup_runs WHERE state = 'published'
       ORDER BY completion_checked_at NULLS FIRST, run_id LIMIT $1 FOR UPDATE SKIP LOCKED
     ), walked AS MATERIALIZED (
       -- After the cursor, in batch id order (cleanup_run_batches_by_run_batch; every id is > ''),
       -- at most $3 batches: the first without a receipt. Rows are pulled one at a time and the walk
       -- stops there, so a pass probes the batches settled since the last pass plus one, not every
       -- batch still open. The receipt probe is a scalar subquery (one primary-key probe per row):
       -- an EXISTS here may be planned as a hash of the whole receipts table.
       SELECT p.run_id, p.completion_cursor, (
           SELECT w.batch_id FROM (
             SELECT rb.batch_id, (SELECT 1 FROM cleanup_batches b WHERE b.batch_id = rb.batch_id) IS NOT NULL AS done
             FROM cleanup_run_batches rb
             WHERE rb.run_id = p.run_id AND rb.batch_id > coalesce(p.completion_cursor, '')
             ORDER BY rb.batch_id LIMIT $3) w
           WHERE NOT w.done LIMIT 1) AS first_missing
       FROM picked p
     ), measured AS (
       SELECT k.run_id, k.first_missing, tail.last_walked, tail.walked,
         -- The settled prefix ends right before the first batch without a receipt, or, with none
         -- in the walk, at its last batch.
         CASE WHEN k.first_missing IS NOT NULL
              THEN coalesce((SELECT max(rb.batch_id) FROM cleanup_run_batches rb WHERE rb.run_id = k.run_id
                               AND rb.batch_id > coalesce(k.completion_cursor, '') AND rb.batch_id < k.first_missing), k.completion_cursor)
              ELSE coalesce(tail.last_walked, k.completion_cursor) END AS cursor,
         greatest(r.published_at, (SELECT max(b.completed_at) FROM cleanup_batches b WHERE b.run_id = k.run_id)) AS progress_at
       FROM walked k JOIN cleanup_runs r USING (run_id)
       -- Only when the walk found every batch settled (a one-time filter otherwise): where it
       -- ended, and whether anything is left after it.
       CROSS JOIN LATERAL (
         SELECT max(x.batch_id) AS last_walked, count(*) AS walked FROM (
           SELECT rb.batch_id FROM cleanup_run_batches rb
           WHERE k.first_missing IS NULL AND rb.run_id = k.run_id AND rb.batch_id > coalesce(k.completion_cursor, '')
           ORDER BY rb.batch_id LIMIT $3) x
       ) tail
     ), decided AS (
       SELECT run_id, cursor, progress_at, first_missing IS NULL AND walked >= $3 AS more_to_walk,
         CASE WHEN first_missing IS NULL AND walked < $3 THEN 'completed'
              WHEN progress_at < clock_timestamp() - $2 * interval '1 millisecond' THEN 'incomplete'
              ELSE 'published' END AS next_state
       FROM measured
     )
     UPDATE cleanup_runs r SET state = d.next_state, completion_cursor = d.cursor,
       finished_at = CASE WHEN d.next_state <> 'published' THEN clock_timestamp() END,
       error = CASE WHEN d.next_state = 'incomplete'
         THEN format('%s of %s batches have no receipt (dead-lettered or lost); nothing completed since %s',
                     m.missing, r.batches_confirmed, reaper_iso(d.progress_at))
         ELSE r.error END,
       completion_checked_at = clock_timestamp()
     FROM decided d CROSS JOIN LATERAL (
       -- Counted only for the message of a run that becomes incomplete (once per run).
       SELECT CASE WHEN d.next_state = 'incomplete' THEN (
                SELECT count(*) FROM cleanup_run_batches rb WHERE rb.run_id = d.run_id
                  AND NOT EXISTS (SELECT 1 FROM cleanup_batches b WHERE b.batch_id = rb.batch_id))::int
              WHEN d.next_state = 'completed' THEN 0 END AS missing
     ) m
     WHERE r.run_id = d.run_id
     RETURNING r.run_id, r.policy, r.state, r.batches_confirmed, m.missing, d.next_state = 'published' AND d.more_to_walk AS more_to_walk`,
    [options.limit, options.incompleteAfterMs, options.walk ?? COMPLETION_WALK_BATCHES],
  ));
  return result.rows.map((row) => ({
    runId: row.run_id,
    policy: row.policy,
    state: row.state,
    batchesConfirmed: row.batches_confirmed,
    batchesMissing: row.missing,
    moreToWalk: row.more_to_walk,
  }));
}

/** The latest tick a cron or catch-up run was made for: where catch-up starts counting. */
export async function runsLatestScheduledTick(db: Db, policy: string): Promise<Date | null> {
  const result = await db.query<{ latest: Date | null }>(
    `SELECT max(scheduled_for) AS latest FROM cleanup_runs WHERE policy = $1 AND trigger IN ('cron', 'catch-up')`,
    [policy],
  );
  return result.rows[0]?.latest ?? null;
}

export async function runsDatabaseNow(db: Db): Promise<Date> {
  const result = await db.query<{ now: Date }>('SELECT clock_timestamp() AS now');
  return result.rows[0]!.now;
}

// batches_done: confirmed batches with a receipt; deleted/noop: every receipt of the run (a batch a
// dead scheduler published after its last checkpoint still deleted what it deleted).
const SUMMARY_SELECT = `SELECT ${RUN_COLUMNS},
    (SELECT count(*) FROM cleanup_run_batches rb JOIN cleanup_batches b USING (batch_id) WHERE rb.run_id = r.run_id) AS batches_done,
    coalesce(b.deleted, 0) AS deleted, coalesce(b.noop, 0) AS noop
  FROM cleanup_runs r
  LEFT JOIN LATERAL (SELECT sum(deleted) AS deleted, sum(noop) AS noop FROM cleanup_batches WHERE run_id = r.run_id) b ON true`;

interface SummaryRow extends RunRow {
  batches_done: string;
  deleted: string;
  noop: string;
}

function toSummary(row: SummaryRow): RunSummary {
  return { ...toRun(row), batchesDone: Number(row.batches_done), deleted: Number(row.deleted), noop: Number(row.noop) };
}

export async function runsGetSummary(db: Db, runId: string): Promise<RunSummary | null> {
  const result = await db.query<SummaryRow>(`${SUMMARY_SELECT} WHERE r.run_id = $1`, [runId]);
  return result.rows[0] ? toSummary(result.rows[0]) : null;
}

/**
 * The ids of the runs whose id starts with `hex` (1 to 32 lowercase hex digits, the uuid's hyphens
 * left out), in id order, at most `limit`: what lets the CLI take a unique prefix of a run id. A
 * range over the primary key (uuids compare byte by byte, i.e. as their hex reads), so it is an
 * index range scan however many runs there are.
 */
export async function runsFindByIdPrefix(db: Db, hex: string, limit: number): Promise<string[]> {
  if (!/^[0-9a-f]{1,32}$/.test(hex)) throw new Error(`runsFindByIdPrefix: "${hex}" is not lowercase hex of 1 to 32 digits`);
  const result = await db.query<{ run_id: string }>('SELECT run_id FROM cleanup_runs WHERE run_id BETWEEN $1::uuid AND $2::uuid ORDER BY run_id LIMIT $3', [
    hex.padEnd(32, '0'),
    hex.padEnd(32, 'f'),
    limit,
  ]);
  return result.rows.map((row) => row.run_id);
}

/**
 * For each of `runIds`, the run ids just before and just after it in id order (null at either
 * end): the longest prefix it shares with any other run is the longer of the two it shares with
 * them, so the CLI can show each id as short as is still unique. Two index probes per id.
 */
export async function runsIdNeighbours(db: Db, runIds: readonly string[]): Promise<Array<{ runId: string; before: string | null; after: string | null }>> {
  const result = await db.query<{ run_id: string; before: string | null; after: string | null }>(
    `SELECT r.id AS run_id,
       (SELECT run_id FROM cleanup_runs WHERE run_id < r.id ORDER BY run_id DESC LIMIT 1) AS before,
       (SELECT run_id FROM cleanup_runs WHERE run_id > r.id ORDER BY run_id LIMIT 1) AS after
     FROM unnest($1::uuid[]) AS r(id)`,
    [runIds],
  );
  return result.rows.map((row) => ({ runId: row.run_id, before: row.before, after: row.after }));
}

export async function runsListSummaries(db: Db, filter: { policy?: string | undefined; limit: number }): Promise<RunSummary[]> {
  const result = await db.query<SummaryRow>(
    `${SUMMARY_SELECT} WHERE ($1::text IS NULL OR r.policy = $1) ORDER BY r.created_at DESC LIMIT $2`,
    [filter.policy ?? null, filter.limit],
  );
  return result.rows.map(toSummary);
}

/**
 * The brake: the run (claimed by `claim`) publishes nothing more and waits for an operator, with
 * the count (published so far + still to publish), the reason, and the policy version it was
 * counted under, for `runs`, `run`, `status` and the approval. Its cursor and published totals
 * stay: an approval resumes it from there.
 */
export async function runsHoldForApproval(db: Db, claim: RunClaim, hold: { counted: number; reason: string; policyVersion: string }): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET state = 'awaiting-approval', counted_candidates = $4, error = $5, policy_version = $6, lease_expires_at = NULL, hold_count = hold_count + 1
     WHERE ${HELD_BY_CLAIM}`,
    [claim.runId, claim.owner, claim.claim, hold.counted, hold.reason, hold.policyVersion],
  );
  return result.rowCount === 1;
}

/** Records the policy version a run executes under (the first claim's; a takeover keeps it). */
export async function runsSetPolicyVersion(db: Db, claim: RunClaim, version: string): Promise<void> {
  await db.query(`UPDATE cleanup_runs SET policy_version = coalesce(policy_version, $4) WHERE ${HELD_BY_CLAIM}`, [
    claim.runId,
    claim.owner,
    claim.claim,
    version,
  ]);
}

/**
 * `reaper approve`: a run awaiting approval goes back to pending with its cutoff unchanged, and
 * the approval records WHAT was approved: the brake's count and the policy version it was counted
 * under (docs/design.md invariant 16). The executor publishes at most that count plus the
 * tolerance, under that version. `expected`, when given, is the count the operator saw: another
 * count in the row (a newer hold) is not approved. Null when the run is not awaiting approval
 * (or not with that count).
 */
export async function runsApprove(db: Db, runId: string, by: string, expected: number | null = null, expectedHold: number | null = null): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `WITH approved AS (
       UPDATE cleanup_runs SET state = 'pending', approved_at = clock_timestamp(), decided_by = $2,
         approved_candidates = counted_candidates, approved_policy_version = policy_version,
         error = format('approved %s over the brake: %s', counted_candidates, coalesce(error, ''))
       WHERE run_id = $1 AND state = 'awaiting-approval' AND ($3::bigint IS NULL OR counted_candidates = $3)
         AND ($4::int IS NULL OR hold_count = $4)
       RETURNING *)
     SELECT ${RUN_COLUMNS}, pg_notify('${RUNS_CHANNEL}', policy) FROM approved`,
    [runId, by, expected, expectedHold],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}

/**
 * The open run of `policy` an operator decides about: awaiting approval, or approved and not
 * finished; the latest one. For `reaper plan` (the approved and the current count side by side).
 */
export async function runsLatestDecided(db: Db, policy: string): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `SELECT ${RUN_COLUMNS} FROM cleanup_runs
     WHERE policy = $1 AND (state = 'awaiting-approval' OR (approved_at IS NOT NULL AND state IN ('pending', 'scanning')))
     ORDER BY created_at DESC LIMIT 1`,
    [policy],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}

/** `reaper reject`: a run awaiting approval ends 'rejected'; nothing of it was ever published. */
export async function runsReject(db: Db, runId: string, by: string): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `UPDATE cleanup_runs SET state = 'rejected', decided_by = $2, finished_at = clock_timestamp()
     WHERE run_id = $1 AND state = 'awaiting-approval'
     RETURNING ${RUN_COLUMNS}`,
    [runId, by],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}

/**
 * `--execute`: claims ONE given run for `owner`, under exactly the conditions runsClaimNext uses
 * (waiting, or abandoned mid-scan with its lease expired), so a scheduler and the CLI never hold
 * it at once. Null when someone else holds it or it is no longer claimable (finished, awaiting
 * approval); the caller reads the run to say which.
 */
export async function runsClaimById(db: Db, runId: string, owner: string, leaseMs: number): Promise<Run | null> {
  const result = await db.query<RunRow>(
    `UPDATE cleanup_runs SET owner = $2, lease_expires_at = clock_timestamp() + $3 * interval '1 millisecond',
       state = 'scanning', started_at = coalesce(started_at, clock_timestamp()), claim_count = claim_count + 1,
       unconfirmed_candidates = unconfirmed_candidates + window_candidates, window_candidates = 0
     WHERE run_id = $1 AND state IN ('pending', 'scanning')
       AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
     RETURNING ${RUN_COLUMNS}`,
    [runId, owner, leaseMs],
  );
  return result.rows[0] ? toRun(result.rows[0]) : null;
}
