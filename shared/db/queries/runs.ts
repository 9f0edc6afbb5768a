import { randomUUID } from 'node:crypto';
import type { Db } from '../pool';

/**
 * NOTIFY channel: every new run is announced on commit, so schedulers start it at once instead of
 * at their next poll (the poll stays, for a lost notification or a scheduler that was reconnecting).
 */
export const RUNS_CHANNEL = 'reaper_runs';

/** Run triggers (docs/design.md). Only cron and catch-up runs take part in the one-run-per-tick rule. */
export type RunTrigger = 'cron' | 'catch-up' | 'replay' | 'manual';
export type RunState = 'pending' | 'scanning' | 'published' | 'completed' | 'failed';

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
  batchesConfirmed: number;
  error: string | null;
  createdAt: string;
  finishedAt: string | null;
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
  batches_confirmed: number;
  error: string | null;
  created_at: string;
  finished_at: string | null;
}

const RUN_COLUMNS = `run_id, policy, trigger, reaper_iso(scheduled_for) AS scheduled_for, reaper_iso(cutoff) AS cutoff,
  state, replay_of, reaper_iso(cursor_expiry) AS cursor_expiry, cursor_key, claim_count, candidates, batches_confirmed, error,
  reaper_iso(created_at) AS created_at, reaper_iso(finished_at) AS finished_at`;

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
    batchesConfirmed: row.batches_confirmed,
    error: row.error,
    createdAt: row.created_at,
    finishedAt: row.finished_at,
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
       state = 'scanning', started_at = coalesce(started_at, clock_timestamp()), claim_count = claim_count + 1
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

/**
 * Stores scan progress after the broker confirmed every batch up to `cursor`: the cursor, the
 * counts, the ids of those batches (what completion waits for), and a longer lease. Conditional on
 * still owning the run: false means another replica took it over, and this one must stop.
 */
export async function runsRecordProgress(
  db: Db,
  progress: { runId: string; owner: string; cursor: { expiry: string; key: string }; candidates: number; batchIds: readonly string[]; leaseMs: number },
): Promise<boolean> {
  const result = await db.query<{ updated: number }>(
    `WITH progress AS (
       UPDATE cleanup_runs SET cursor_expiry = $3::timestamptz, cursor_key = $4, candidates = candidates + $5,
         batches_confirmed = batches_confirmed + cardinality($6::text[]),
         lease_expires_at = clock_timestamp() + $7 * interval '1 millisecond'
       WHERE run_id = $1 AND owner = $2 AND state = 'scanning'
       RETURNING run_id
     ), expected AS (
       INSERT INTO cleanup_run_batches (batch_id, run_id)
       SELECT id, progress.run_id FROM progress CROSS JOIN unnest($6::text[]) AS id
       ON CONFLICT (batch_id) DO NOTHING
       RETURNING 1
     )
     SELECT (SELECT count(*) FROM progress)::int AS updated, (SELECT count(*) FROM expected) AS expected`,
    [progress.runId, progress.owner, progress.cursor.expiry, progress.cursor.key, progress.candidates, progress.batchIds, progress.leaseMs],
  );
  return result.rows[0]!.updated === 1;
}

/** The scan reached the end: every batch is confirmed by the broker. Conditional on ownership. */
export async function runsMarkPublished(db: Db, runId: string, owner: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET state = 'published', published_at = clock_timestamp(), lease_expires_at = NULL
     WHERE run_id = $1 AND owner = $2 AND state = 'scanning'`,
    [runId, owner],
  );
  return result.rowCount === 1;
}

/** Gives the lease up at shutdown so another replica resumes the run at once, from the cursor. */
export async function runsReleaseLease(db: Db, runId: string, owner: string): Promise<void> {
  await db.query(
    `UPDATE cleanup_runs SET lease_expires_at = clock_timestamp() WHERE run_id = $1 AND owner = $2 AND state = 'scanning'`,
    [runId, owner],
  );
}

export async function runsMarkFailed(db: Db, runId: string, owner: string, error: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs SET state = 'failed', error = $3, finished_at = clock_timestamp(), lease_expires_at = NULL
     WHERE run_id = $1 AND owner = $2 AND state = 'scanning'`,
    [runId, owner, error],
  );
  return result.rowCount === 1;
}

/** Published runs every one of whose confirmed batches has a receipt become completed. */
const COMPLETE_WHERE_ALL_RECEIPTS = `r.state = 'published' AND NOT EXISTS (
    SELECT 1 FROM cleanup_run_batches rb
    WHERE rb.run_id = r.run_id AND NOT EXISTS (SELECT 1 FROM cleanup_batches b WHERE b.batch_id = rb.batch_id))`;

export async function runsCompleteIfAllBatchesDone(db: Db, runId: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_runs r SET state = 'completed', finished_at = clock_timestamp() WHERE r.run_id = $1 AND ${COMPLETE_WHERE_ALL_RECEIPTS}`,
    [runId],
  );
  return result.rowCount === 1;
}

/** The scheduler's completion pass over every published run; returns the ids it completed. */
export async function runsCompleteFinished(db: Db): Promise<string[]> {
  const result = await db.query<{ run_id: string }>(
    `UPDATE cleanup_runs r SET state = 'completed', finished_at = clock_timestamp() WHERE ${COMPLETE_WHERE_ALL_RECEIPTS} RETURNING r.run_id`,
  );
  return result.rows.map((row) => row.run_id);
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

export async function runsListSummaries(db: Db, filter: { policy?: string | undefined; limit: number }): Promise<RunSummary[]> {
  const result = await db.query<SummaryRow>(
    `${SUMMARY_SELECT} WHERE ($1::text IS NULL OR r.policy = $1) ORDER BY r.created_at DESC LIMIT $2`,
    [filter.policy ?? null, filter.limit],
  );
  return result.rows.map(toSummary);
}
