import type { Db } from '../pool';
import type { ResolvedTarget } from './target';
import { rowHeldSql, stillEligibleSql, type ClaimedOperation } from './ledger';
import { SERVER_STANDBY_LAG_CTES } from './replication';
import { prepared } from './prepared';
import { ADAPTIVE } from '../../admission/adaptive-constants';
import { HARM } from '../../admission/adaptive-harm';

/**
 * Global admission per policy (cleanup_admission): one row, locked for the few milliseconds of a
 * grant, so the token bucket and the concurrency cap hold across every worker process together.
 */

export interface AdmissionState {
  /** Whole and fractional tokens available now (after refill). */
  tokens: number;
  /** The database instant the refill was computed for; stored back as refilled_at. */
  refilledAt: string;
  paused: boolean;
  /** Milliseconds until a remote 429 block ends; 0 when not blocked. */
  blockedForMs: number;
}

/** Locks the policy's admission row, creating it with a full bucket. Call first in a transaction. */
export async function admissionLock(db: Db, policy: string, burst: number): Promise<void> {
  await db.query(
    `INSERT INTO cleanup_admission (policy, tokens, refilled_at) VALUES ($1, $2, clock_timestamp()) ON CONFLICT (policy) DO NOTHING`,
    [policy, burst],
  );
  await db.query('SELECT 1 FROM cleanup_admission WHERE policy = $1 FOR UPDATE', [policy]);
}

export interface GrantOutcome extends AdmissionState {
  /** Operations now in_flight for the caller, each with one more attempt counted (the claim token). */
  claimed: ClaimedOperation[];
  /** Due operations of the batch whose row no longer holds their decision: finished 'superseded', never called. */
  superseded: number;
  /** Due operations of the batch whose asset is under a legal hold: finished 'held', never called. */
  held: number;
  /** Whole tokens and free concurrency slots there were, before claiming. */
  wholeTokens: number;
  freeSlots: number;
}

/**
 * The CTEs `due`, `superseded` and `held` of a claim (admissionGrantAndClaim, and the object
 * storage claim in ledger-s3.ts): the batch's due operations locked (SKIP LOCKED), each re-checked
 * against its row in the claiming statement; those whose row changed finish 'superseded', those
 * under a legal hold finish 'held'. `due` keeps still_eligible and held for the claim that follows.
 * Arguments are the statement's parameter names.
 */
export function dueRecheckCtes(target: ResolvedTarget, at: { policy: string; keys: string; cutoff: string; guardFrom: number }): string {
  const stillEligible = stillEligibleSql(target, { id: 'l.asset_id', observed: 'l.observed_expiry', cutoff: at.cutoff, guardFrom: at.guardFrom });
  return `due AS (
       -- the batch's due operations, each with the re-check of its row as of this statement
       SELECT l.operation_key, l.not_before, EXISTS (${stillEligible}) AS still_eligible,
              ${rowHeldSql(target, { id: 'l.asset_id', policy: at.policy })} AS held
       FROM cleanup_ledger l
       WHERE l.operation_key = ANY(${at.keys}::text[])
         AND ((l.state = 'pending' AND l.not_before <= clock_timestamp()) OR (l.state = 'in_flight' AND l.lease_expires_at < clock_timestamp()))
       ORDER BY l.not_before, l.operation_key
       FOR UPDATE OF l SKIP LOCKED
     ), superseded AS (
       UPDATE cleanup_ledger l SET state = 'done', outcome = 'superseded', completed_at = clock_timestamp(), updated_at = clock_timestamp(),
         lease_owner = NULL, lease_expires_at = NULL
       FROM due d WHERE l.operation_key = d.operation_key AND NOT d.still_eligible
       RETURNING l.operation_key
     ), held AS (
       -- under a legal hold now: no call; a scan or webhook after the hold is removed re-opens it
       UPDATE cleanup_ledger l SET state = 'done', outcome = 'held', last_result = 'legal hold', completed_at = clock_timestamp(),
         updated_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL
       FROM due d WHERE l.operation_key = d.operation_key AND d.still_eligible AND d.held
       RETURNING l.operation_key`;
}

/**
 * The grant, in ONE statement once the row is locked (admissionLock): refill the bucket from the
 * database clock read now (after the lock, so the refill never goes backwards), count the live
 * in-flight leases of the policy (the concurrency every worker uses), and take the batch's due
 * operations (pending and due, or in flight under an expired lease; SKIP LOCKED). Each is
 * re-checked against the policy's own row in this same statement (ledger.stillEligibleSql: key,
 * exact observed expiry, expiry <= least(cutoff, now), guard): those that no longer match are
 * finished 'superseded' here, whatever the bucket says; at most min(whole tokens, free slots) of
 * those that match are claimed (lease, attempt + 1, claimed by this batch). The bucket is stored as
 * of that same instant. Nothing decided earlier authorises a call (docs/design.md invariant 13).
 */
export async function admissionGrantAndClaim(
  db: Db,
  target: ResolvedTarget,
  grant: {
    policy: string;
    ratePerSecond: number;
    burst: number;
    concurrency: number;
    keys: readonly string[];
    owner: string;
    leaseMs: number;
    cutoff: string;
    batchId: string;
  },
): Promise<GrantOutcome> {
  const result = await db.query<{
    tokens: number;
    refilled_at: string;
    paused: boolean;
    blocked_for_ms: number;
    whole_tokens: number;
    free_slots: number;
    superseded: number;
    held: number;
    claimed: Array<{ operation_key: string; asset_id: string; attempt_count: number }> | null;
  }>(
    `WITH bucket AS (
       SELECT least($2::float8, a.tokens + greatest(0, extract(epoch FROM n.at - a.refilled_at)) * $3::float8) AS tokens,
              greatest(n.at, a.refilled_at) AS at, a.paused,
              greatest(0, coalesce(extract(epoch FROM a.blocked_until - n.at) * 1000, 0))::float8 AS blocked_for_ms
       FROM cleanup_admission a, (SELECT clock_timestamp() AS at) n
       WHERE a.policy = $1
     ), slots AS (
       SELECT $4::int - count(*)::int AS free FROM cleanup_ledger
       WHERE policy = $1 AND state = 'in_flight' AND lease_expires_at >= clock_timestamp()
     ), allowance AS (
       SELECT CASE WHEN b.paused OR b.blocked_for_ms > 0 THEN 0 ELSE greatest(0, least(floor(b.tokens)::int, s.free)) END AS n
       FROM bucket b, slots s
     ), ${dueRecheckCtes(target, { policy: '$1', keys: '$5', cutoff: '$8', guardFrom: 10 })}
     ), claimed AS (
       UPDATE cleanup_ledger l SET state = 'in_flight', lease_owner = $6, claim_batch_id = $9, last_delivered_at = clock_timestamp(),
         lease_expires_at = clock_timestamp() + $7 * interval '1 millisecond', attempt_count = l.attempt_count + 1, updated_at = clock_timestamp()
       WHERE l.operation_key IN (SELECT operation_key FROM due WHERE still_eligible AND NOT held ORDER BY not_before, operation_key LIMIT (SELECT n FROM allowance))
       RETURNING l.operation_key, l.asset_id, l.attempt_count
     ), stored AS (
       UPDATE cleanup_admission a SET tokens = b.tokens - (SELECT count(*) FROM claimed), refilled_at = b.at, updated_at = clock_timestamp()
       FROM bucket b
       WHERE a.policy = $1 AND EXISTS (SELECT 1 FROM claimed)
       RETURNING 1
     )
     SELECT b.tokens, reaper_iso(b.at) AS refilled_at, b.paused, b.blocked_for_ms,
            floor(b.tokens)::int AS whole_tokens, s.free AS free_slots,
            (SELECT count(*)::int FROM superseded) AS superseded, (SELECT count(*)::int FROM held) AS held,
            (SELECT json_agg(claimed) FROM claimed) AS claimed,
            (SELECT count(*) FROM stored) AS stored
     FROM bucket b, slots s`,
    [
      grant.policy,
      grant.burst,
      grant.ratePerSecond,
      grant.concurrency,
      grant.keys,
      grant.owner,
      grant.leaseMs,
      grant.cutoff,
      grant.batchId,
      ...target.guardValues,
    ],
  );
  const row = result.rows[0]!;
  return {
    tokens: row.tokens,
    refilledAt: row.refilled_at,
    paused: row.paused,
    blockedForMs: row.blocked_for_ms,
    wholeTokens: row.whole_tokens,
    freeSlots: row.free_slots,
    superseded: row.superseded,
    held: row.held,
    claimed: (row.claimed ?? []).map((c) => ({ operationKey: c.operation_key, assetId: c.asset_id, attemptCount: c.attempt_count })),
  };
}

/**
 * A fresh token taken now, for a claimed call that could not start within its grant's lifetime
 * (see controller.ts): refill, take one if there is one, store. One statement, row lock for its
 * duration only. Returns false when the bucket is empty, paused or blocked.
 */
export async function admissionTakeOne(db: Db, take: { policy: string; ratePerSecond: number; burst: number }): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_admission a SET tokens = b.tokens - 1, refilled_at = b.at, updated_at = clock_timestamp()
     FROM (SELECT least($2::float8, tokens + greatest(0, extract(epoch FROM clock_timestamp() - refilled_at)) * $3::float8) AS tokens,
                  greatest(clock_timestamp(), refilled_at) AS at
           FROM cleanup_admission WHERE policy = $1 FOR UPDATE) b
     WHERE a.policy = $1 AND b.tokens >= 1 AND NOT a.paused AND coalesce(a.blocked_until, '-infinity') <= clock_timestamp()`,
    [take.policy, take.burst, take.ratePerSecond],
  );
  return result.rowCount === 1;
}

/**
 * A 429 from the remote applies to every worker: no calls for this policy until `delayMs` from
 * now, and the bucket starts EMPTY when the block ends (refilled_at = blocked_until below), so the
 * end of a block is not a burst that trips the remote's limit again.
 */
export async function admissionBlockFor(db: Db, policy: string, delayMs: number): Promise<void> {
  await db.query(
    `UPDATE cleanup_admission a SET blocked_until = b.until, refilled_at = b.until, tokens = 0, updated_at = clock_timestamp()
     FROM (SELECT greatest(coalesce(blocked_until, clock_timestamp()), clock_timestamp() + $2 * interval '1 millisecond') AS until
           FROM cleanup_admission WHERE policy = $1) b
     WHERE a.policy = $1`,
    [policy, Math.max(0, Math.round(delayMs))],
  );
}

/** The pause switch. Pausing touches no ledger row: work waits, and resume continues where it stopped. */
export async function admissionSetPaused(db: Db, policies: readonly string[], paused: boolean, burstByPolicy: ReadonlyMap<string, number>): Promise<string[]> {
  const changed: string[] = [];
  for (const policy of policies) {
    const result = await db.query(
      `INSERT INTO cleanup_admission (policy, tokens, refilled_at, paused, paused_at) VALUES ($1, $3, clock_timestamp(), $2, CASE WHEN $2 THEN clock_timestamp() END)
       ON CONFLICT (policy) DO UPDATE SET paused = $2, paused_at = CASE WHEN $2 THEN clock_timestamp() END, updated_at = clock_timestamp()
       WHERE cleanup_admission.paused IS DISTINCT FROM $2`,
      [policy, paused, burstByPolicy.get(policy) ?? 1],
    );
    if ((result.rowCount ?? 0) > 0) changed.push(policy);
  }
  return changed;
}

/** The policies `reaper pause` holds now. */
export async function admissionPausedRead(db: Db): Promise<string[]> {
  const result = await db.query<{ policy: string }>('SELECT policy FROM cleanup_admission WHERE paused');
  return result.rows.map((row) => row.policy);
}

export async function admissionList(
  db: Db,
): Promise<Array<{ policy: string; paused: boolean; tokens: number; blockedForMs: number; adaptiveRate: number | null; adaptivePressure: number | null; adaptedAt: string | null }>> {
  const result = await db.query<{ policy: string; paused: boolean; tokens: number; blocked_for_ms: number; adaptive_rate: number | null; adaptive_pressure: number | null; adapted_at: string | null }>(
    `SELECT policy, paused, tokens, greatest(0, coalesce(extract(epoch FROM blocked_until - clock_timestamp()) * 1000, 0))::float8 AS blocked_for_ms,
            adaptive_rate, adaptive_pressure, reaper_iso(adapted_at) AS adapted_at
     FROM cleanup_admission ORDER BY policy`,
  );
  return result.rows.map((row) => ({
    policy: row.policy,
    paused: row.paused,
    tokens: row.tokens,
    blockedForMs: row.blocked_for_ms,
    adaptiveRate: row.adaptive_rate,
    adaptivePressure: row.adaptive_pressure,
    adaptedAt: row.adapted_at,
  }));
}

/*
 * Live admission control (`reaper admission set|show|reset`) and the row-delete throttle.
 * Added beside the remote-delete statements above, which they do not change: an override only
 * changes the numbers the controller passes to them.
 */

export interface AdmissionOverride {
  policy: string;
  /** remote-delete: calls per second; row-delete: rows per second. Null: the file's value. */
  rate: number | null;
  burst: number | null;
  concurrency: number | null;
  setBy: string;
  setAt: string;
}

/** Overrides in force, all of them or those of `policies`. */
export async function admissionOverridesRead(db: Db, policies?: readonly string[]): Promise<AdmissionOverride[]> {
  const result = await db.query<{ policy: string; rate: number | null; burst: number | null; concurrency: number | null; set_by: string; set_at: string }>(
    `SELECT policy, rate, burst, concurrency, set_by, reaper_iso(set_at) AS set_at
     FROM cleanup_admission_overrides WHERE $1::text[] IS NULL OR policy = ANY($1::text[]) ORDER BY policy`,
    [policies ?? null],
  );
  return result.rows.map((row) => ({ policy: row.policy, rate: row.rate, burst: row.burst, concurrency: row.concurrency, setBy: row.set_by, setAt: row.set_at }));
}

/**
 * Sets the given values (a value left out keeps what an earlier `set` gave, or the file's), with
 * who and when. Returns the override now stored.
 */
export async function admissionOverrideSet(
  db: Db,
  change: { policy: string; rate?: number | undefined; burst?: number | undefined; concurrency?: number | undefined; setBy: string },
): Promise<AdmissionOverride> {
  const result = await db.query<{ policy: string; rate: number | null; burst: number | null; concurrency: number | null; set_by: string; set_at: string }>(
    `INSERT INTO cleanup_admission_overrides AS o (policy, rate, burst, concurrency, set_by, set_at)
     VALUES ($1, $2, $3, $4, $5, clock_timestamp())
     ON CONFLICT (policy) DO UPDATE SET rate = coalesce($2, o.rate), burst = coalesce($3, o.burst),
       concurrency = coalesce($4, o.concurrency), set_by = $5, set_at = clock_timestamp()
     RETURNING policy, rate, burst, concurrency, set_by, reaper_iso(set_at) AS set_at`,
    [change.policy, change.rate ?? null, change.burst ?? null, change.concurrency ?? null, change.setBy],
  );
  const row = result.rows[0]!;
  return { policy: row.policy, rate: row.rate, burst: row.burst, concurrency: row.concurrency, setBy: row.set_by, setAt: row.set_at };
}

/** Back to the file's values. True when an override was removed. */
export async function admissionOverrideReset(db: Db, policy: string): Promise<boolean> {
  const result = await db.query('DELETE FROM cleanup_admission_overrides WHERE policy = $1', [policy]);
  return (result.rowCount ?? 0) > 0;
}

/** Creates a row-delete policy's bucket row (full) if it is missing: once per process and policy. */
export async function admissionRowsEnsure(db: Db, policy: string, capacity: number): Promise<void> {
  await db.query(`INSERT INTO cleanup_admission (policy, tokens, refilled_at) VALUES ($1, $2, clock_timestamp()) ON CONFLICT (policy) DO NOTHING`, [policy, capacity]);
}

export interface RowsTakeOutcome {
  admitted: boolean;
  /** Tokens (rows) in the bucket after this request (negative: the debt a large group left). */
  tokens: number;
  paused: boolean;
  /** Largest known replay lag of a physical standby now (shared/db/queries/replication.ts), seconds; 0 without one. */
  replicationLagSeconds: number;
  /** Standbys whose lag is unknown now (disconnected, not reporting, hidden). */
  unknownStandbys: string[];
  /** The replica-lag brake is on: the lag is over the policy's maximum, or unknown past the grace. */
  braked: boolean;
  /** Adaptive admission only (null otherwise): the shared rate as stored by this statement. */
  adaptive: AdaptiveRowsState | null;
}

/** The adaptive rate's shared state (cleanup_admission, migration 21), as one statement left it. */
export interface AdaptiveRowsState {
  /** rows/s the bucket refills at, before the ceiling. */
  rate: number;
  /** The step claim: a proposal is stored only by a take that names this value. */
  adaptedAt: string;
  /** Seconds since adaptedAt, on the database clock. */
  sinceStepSeconds: number;
  /** Rows admitted by every worker since adaptedAt. */
  admittedSinceStep: number;
  /** The signal the last step reacted to (null before the first). */
  pressure: number | null;
  /** Other client backends of this database waiting on a lock or on IO now (pg_stat_activity; 0 where not readable). */
  othersWaiting: number;
  /** Other client backends of this database running a statement now, waiting or not (not reaper's; 0 where not readable). */
  othersActive: number;
  /** Other client backends of this database in a statement or a transaction now (not reaper's; 0 where not readable). */
  othersPresent: number;
  /** Other client backends' state changes per second, counted over the last ADAPTIVE.changeWindowMs (0 where not readable). */
  othersChanges: number;
  /** Other client sessions that started or ended a statement within the last ADAPTIVE.lookRecentSeconds, or whose state this role may not read. */
  othersRecent: number;
  /** Durations (ms) of the other client backends' statements that ended after the take's `since` (idle again: state_change - query_start). */
  othersFinishedMs: number[];
  /** The database clock of the sample (epoch ms): the next sample's `since`. */
  sampledAt: number;
}

/** One sample of the other client backends (OTHER_CLIENTS_COUNTS). */
export interface OthersSample {
  waiting: number;
  active: number;
  present: number;
  changes: number;
  /** Sessions that started or ended a statement within the last ADAPTIVE.lookRecentSeconds (the start look's "somebody is there"). */
  recent: number;
  /** Durations (ms) of statements that ended after the sample's `since`: sessions idle (or idle in transaction) again, state_change - query_start, their last statement. */
  finishedMs: number[];
  /** The database clock of the sample (epoch ms). */
  at: number;
}

/**
 * Adaptive take (shared/admission/adaptive.ts decides, this stores): the rate starts at
 * `startRate`; a `proposal` replaces it only when the row's adapted_at is still `seenAdaptedAt`
 * (one step per observed state, the other workers' proposals for the same state are dropped).
 * `restart` (a worker's first take after a pause, when its look found the others busy): a rate no
 * worker has stepped for `staleSeconds` is from another moment, and is set to `startRate` (the
 * floor), counted as a step that reacted to `pressure`.
 */
export interface AdaptiveRowsTake {
  startRate: number;
  proposal: { rate: number; pressure: number | null; seenAdaptedAt: string } | null;
  restart?: { staleSeconds: number; pressure: number } | null;
  /**
   * The harm law only: the database clock (epoch ms) of this worker's previous sample of the others,
   * their statements that ended later are counted (othersFinishedMs); null: those of the last
   * HARM.aloneAfterSeconds. Absent (the load law): no durations are gathered.
   */
  since?: number | null;
}

/**
 * The other client backends of this database, as pg_stat_activity (alias `s`) shows them: not this
 * session, not reaper's own (application_name reaper...). The admission take and the start look
 * count the same sessions: waiting on a lock or IO, running a statement (active), in a statement or
 * a transaction now (present), and their state changes (a statement started or ended) within the
 * last ADAPTIVE.changeWindowMs, per second of that window (changes: about their statements per second).
 */
const OTHER_CLIENTS = `s.datname = current_database() AND s.pid <> pg_backend_pid()
         AND (s.backend_type = 'client backend' OR s.backend_type IS NULL)
         AND coalesce(s.application_name, '') NOT LIKE 'reaper%'`;
// A session whose state this role may not read (another role's, without pg_read_all_stats: state,
// backend type and wait event read NULL) counts as present and active, never as nobody: unknown
// is not "alone" (issue 40). The worker refuses to start without the grant (assertOthersReadable);
// this keeps a grant revoked later on the safe side.
const OTHER_CLIENTS_COUNTS = (since: string, asked: string): string => `count(*) FILTER (WHERE s.state = 'active' AND s.wait_event_type IN ('Lock', 'LWLock', 'IO', 'BufferPin'))::int AS waiting,
              count(*) FILTER (WHERE s.state = 'active' OR s.state IS NULL)::int AS active,
              count(*) FILTER (WHERE s.state IN ('active', 'idle in transaction', 'idle in transaction (aborted)') OR s.state IS NULL)::int AS present,
              count(*) FILTER (WHERE s.state_change > clock_timestamp() - interval '${ADAPTIVE.changeWindowMs} milliseconds')::float8
                * ${1000 / ADAPTIVE.changeWindowMs} AS changes,
              count(*) FILTER (WHERE s.state_change > clock_timestamp() - interval '${ADAPTIVE.lookRecentSeconds} seconds' OR s.state IS NULL)::int AS recent,
              ${OTHERS_FINISHED(since, asked)}`;

/**
 * Only when `asked` (the harm law; the load law reads no durations, so its samples do not gather
 * them): the durations (ms) of the other clients' statements that ended after `since` (epoch ms, the
 * database clock of the worker's previous sample; null: within the last HARM.aloneAfterSeconds, the
 * time without one after which the harm law calls reaper alone): a session idle (or idle in
 * transaction) again shows its last statement's start (query_start) and its end (state_change), so
 * each statement is counted once, the last of its session between two samples (the harm law,
 * shared/admission/adaptive-harm.ts). And the sample's own clock, the next `since`.
 */
const OTHERS_FINISHED = (since: string, asked: string): string => `coalesce(array_agg(extract(epoch FROM s.state_change - s.query_start)::float8 * 1000)
                FILTER (WHERE ${asked} AND s.state IN ('idle', 'idle in transaction') AND s.state_change >= s.query_start
                  AND s.state_change > coalesce(to_timestamp(${since}::float8 / 1000), clock_timestamp() - interval '${HARM.aloneAfterSeconds} seconds')), '{}') AS finished_ms,
              extract(epoch FROM clock_timestamp())::float8 * 1000 AS sampled_at`;

/** What the scheduler paces a run of an adaptive policy by (admissionAdaptivePaceRead). */
export interface AdaptivePaceReading {
  /**
   * The policy's adaptive rate (rows/s) while workers are stepping it: stepped within `freshSeconds`
   * with a pressure (they step it at most every ADAPTIVE.stepMs while other clients share the
   * database; alone, or between runs, nobody does). Null otherwise: no row, not lately, or only the
   * policy's very first take, which stores the start rate and its time with no pressure, alone too
   * (paced by that, two workers alone ran the cost figure's end to end at 0.56 of its speed).
   */
  rate: number | null;
  /**
   * When a worker last took (taken_at; null: never, or no row). A value other than one read before
   * means a worker has taken since (a run's first window waits for that: run-executor.ts
   * paceWindow). Only the take writes it: a worker creates a new policy's row (admissionRowsEnsure)
   * after its look and just before its first take, and with updated_at as the stamp the scheduler
   * read that row's creation as the take ("alone") one run in six beside an application
   * (run-pacing.test.ts); a pause or a resume changed updated_at too.
   */
  lastTakeAt: string | null;
  /** Whether that take's own sample saw another client (present, or a statement within the last second); null: no take, or not adaptive. */
  lastTakeSawOthers: boolean | null;
}

/** The policy's adaptive rate in force and its last take (AdaptivePaceReading); a primary-key read, no lock. */
export async function admissionAdaptivePaceRead(db: Db, policy: string, freshSeconds: number): Promise<AdaptivePaceReading> {
  const result = await db.query<AdaptivePaceReading>(
    prepared(
      'admission_pace_read',
      `SELECT CASE WHEN adaptive_rate IS NOT NULL AND adaptive_pressure IS NOT NULL
                     AND adapted_at > clock_timestamp() - make_interval(secs => $2::float8) THEN adaptive_rate END AS rate,
              reaper_iso(taken_at) AS "lastTakeAt", taken_saw_others AS "lastTakeSawOthers"
       FROM cleanup_admission WHERE policy = $1`,
      [policy, freshSeconds],
    ),
  );
  return result.rows[0] ?? { rate: null, lastTakeAt: null, lastTakeSawOthers: null };
}

/**
 * One look at the other clients (OTHER_CLIENTS_COUNTS): waiting on a lock or IO, running a statement,
 * present at all, state changes per second, a statement within the last second; with `since` given (the harm law: null for the first
 * sample), the durations of their statements that ended after it. Absent: `finishedMs` is empty.
 */
export async function admissionOthersSample(db: Db, since?: number | null): Promise<OthersSample> {
  // Autocommit: each call reads pg_stat_activity afresh (within a transaction it is read once).
  const result = await db.query<Omit<OthersSample, 'finishedMs' | 'at'> & { finished_ms: number[]; sampled_at: number }>(
    `SELECT ${OTHER_CLIENTS_COUNTS('$1', '$2::boolean')} FROM pg_stat_activity s WHERE ${OTHER_CLIENTS}`,
    [since ?? null, since !== undefined],
  );
  const { finished_ms: finishedMs, sampled_at: at, ...counts } = result.rows[0]!;
  return { ...counts, finishedMs, at };
}

/**
 * The row-delete throttle's token take, one statement: refill the policy's bucket (rows per
 * second, capacity in rows) from the database clock, read the standbys' replay lag, and take
 * `rows` tokens when the bucket holds min(rows, capacity) of them, the policy is not paused and
 * the brake is off (null `maxLagSeconds`: no brake): no physical standby (of `standbys`, when
 * given) lags more than `maxLagSeconds`, and, when `unknownBrakes` (its grace is over), none has an
 * unknown lag. A group larger than the capacity leaves
 * the bucket in debt, so the rate over time stays the configured one. The row is locked for this
 * statement only (autocommit): the DELETE that follows never holds it.
 * Adaptive (`adaptive` given): the bucket refills at least(the shared adaptive rate, rowsPerSecond
 * when not null), the step proposal is stored under its claim, the admitted rows are counted for
 * the next step, and the other backends waiting on a lock or IO are counted (the signal beside the
 * worker's own latency).
 */
export async function admissionRowsTake(
  db: Db,
  take: {
    policy: string;
    rowsPerSecond: number | null;
    capacity: number;
    rows: number;
    maxLagSeconds: number | null;
    standbys: readonly string[];
    unknownBrakes: boolean;
    adaptive?: AdaptiveRowsTake | null;
  },
): Promise<RowsTakeOutcome> {
  const adaptive = take.adaptive ?? null;
  // Only a policy with a brake reads the standbys: the lag CTEs (three catalog views) were most of
  // this statement's parsing and planning, and it runs once per deleting group (bench, issue 18).
  const braked = take.maxLagSeconds !== null;
  const lagCtes = braked ? `${SERVER_STANDBY_LAG_CTES('$6::text[]')}, ` : '';
  const lagSeconds = braked ? '(SELECT seconds FROM lag)' : '0::float8';
  const lagUnknown = braked ? '(SELECT unknown FROM lag)' : `'{}'::text[]`;
  const lagUnknownCount = braked ? '(SELECT cardinality(unknown) FROM lag)' : '0';
  // Named: parsed once per connection, and (a plain primary-key UPDATE) planned once too.
  const result = await db.query<{
    admitted: boolean;
    tokens: number;
    paused: boolean;
    lag: number;
    unknown: string[];
    braked: boolean;
    adaptive_rate: number | null;
    adapted_at: string | null;
    since_step: number | null;
    admitted_since: number;
    pressure: number | null;
    others_waiting: number;
    others_active: number;
    others_present: number;
    others_changes: number;
    others_recent: number;
    others_finished_ms: number[] | null;
    sampled_at: number | null;
  }>(
    prepared(braked ? 'admission_take_braked' : 'admission_take', `WITH ${lagCtes}cur AS (
       SELECT a.*, clock_timestamp() AS at_now,
              $8::boolean AND $13::float8 IS NOT NULL AND a.adapted_at <= clock_timestamp() - make_interval(secs => $13::float8) AS restarted
       FROM cleanup_admission a WHERE policy = $1 FOR UPDATE
     ), claimed AS (
       SELECT c.*, $8::boolean AND (c.adapted_at IS NULL OR c.restarted OR ($10::float8 IS NOT NULL AND c.adapted_at = $11::timestamptz)) AS stepped FROM cur c
     ), rated AS (
       SELECT claimed.*,
              CASE WHEN NOT $8::boolean THEN claimed.adaptive_rate
                   WHEN claimed.restarted THEN $9::float8
                   WHEN claimed.stepped AND $10::float8 IS NOT NULL THEN $10::float8
                   ELSE coalesce(claimed.adaptive_rate, $9::float8) END AS next_rate
       FROM claimed
     ), b AS (
       SELECT least($2::float8, tokens + greatest(0, extract(epoch FROM at_now - refilled_at))
                * CASE WHEN $8::boolean THEN least(coalesce($3::float8, 'infinity'::float8), next_rate) ELSE $3::float8 END) AS tokens,
              greatest(at_now, refilled_at) AS at, at_now, paused, stepped, next_rate, adapted_at, adaptive_admitted, adaptive_pressure,
              $5::float8 IS NOT NULL AND (${lagSeconds} > $5::float8 OR ($7::boolean AND ${lagUnknownCount} > 0)) AS braked
       FROM rated
     ), decided AS (
       SELECT b.*, NOT b.paused AND NOT b.braked AND b.tokens >= least($4::float8, $2::float8) AS admitted FROM b
     )
     UPDATE cleanup_admission a SET tokens = d.tokens - CASE WHEN d.admitted THEN $4::float8 ELSE 0 END, refilled_at = d.at, updated_at = clock_timestamp(),
       taken_at = clock_timestamp(),
       taken_saw_others = CASE WHEN $8::boolean THEN others.present > 0 OR others.recent > 0 END,
       adaptive_rate = d.next_rate,
       adapted_at = CASE WHEN d.stepped THEN d.at_now ELSE d.adapted_at END,
       adaptive_admitted = CASE WHEN d.stepped THEN 0 ELSE d.adaptive_admitted END + CASE WHEN $8::boolean AND d.admitted THEN $4::float8 ELSE 0 END,
       adaptive_pressure = CASE WHEN d.stepped AND $12::float8 IS NOT NULL THEN $12::float8 ELSE d.adaptive_pressure END
     FROM decided d, LATERAL (
       -- Other client backends of this database (not reaper's): in a statement or a transaction
       -- now (present), running a statement (active), waiting on a lock or IO (waiting), and their
       -- state changes per second (changes). Adaptive only.
       SELECT ${OTHER_CLIENTS_COUNTS('$14', '$15::boolean')}
       FROM pg_stat_activity s
       WHERE $8::boolean AND ${OTHER_CLIENTS}
     ) others
     WHERE a.policy = $1
     RETURNING d.admitted, a.tokens, d.paused, ${lagSeconds} AS lag, ${lagUnknown} AS unknown, d.braked,
       -- Named so that $6 has a type in the text without the lag CTEs (unused by the caller).
       $6::text[] AS standbys,
       a.adaptive_rate, reaper_iso(a.adapted_at) AS adapted_at, extract(epoch FROM d.at_now - a.adapted_at)::float8 AS since_step,
       a.adaptive_admitted AS admitted_since, a.adaptive_pressure AS pressure,
       others.waiting AS others_waiting, others.active AS others_active, others.present AS others_present, others.changes AS others_changes, others.recent AS others_recent,
       others.finished_ms AS others_finished_ms, others.sampled_at`,
    [
      take.policy,
      take.capacity,
      take.rowsPerSecond,
      take.rows,
      take.maxLagSeconds,
      take.standbys,
      take.unknownBrakes,
      adaptive !== null,
      adaptive?.startRate ?? null,
      adaptive?.proposal?.rate ?? null,
      adaptive?.proposal?.seenAdaptedAt ?? null,
      adaptive?.proposal?.pressure ?? adaptive?.restart?.pressure ?? null,
      adaptive?.restart?.staleSeconds ?? null,
      adaptive?.since ?? null,
      adaptive?.since !== undefined,
    ],
  ));
  const row = result.rows[0];
  if (!row) return { admitted: false, tokens: 0, paused: false, replicationLagSeconds: 0, unknownStandbys: [], braked: false, adaptive: null };
  return {
    admitted: row.admitted,
    tokens: row.tokens,
    paused: row.paused,
    replicationLagSeconds: row.lag,
    unknownStandbys: row.unknown,
    braked: row.braked,
    adaptive:
      adaptive !== null && row.adaptive_rate !== null && row.adapted_at !== null
        ? { rate: row.adaptive_rate, adaptedAt: row.adapted_at, sinceStepSeconds: row.since_step ?? 0, admittedSinceStep: row.admitted_since, pressure: row.pressure, othersWaiting: row.others_waiting, othersActive: row.others_active, othersPresent: row.others_present, othersChanges: row.others_changes, othersRecent: row.others_recent, othersFinishedMs: row.others_finished_ms ?? [], sampledAt: row.sampled_at ?? 0 }
        : null,
  };
}

/**
 * One of `concurrency` slots for a row-delete statement, taken inside the deleting transaction
 * (pg_try_advisory_xact_lock on (policy hash, slot)): released by COMMIT or ROLLBACK, and by the
 * server when a worker dies, so a crashed worker never keeps a slot. Returns the slot or null.
 */
export async function admissionRowsSlotTry(db: Db, policy: string, concurrency: number): Promise<number | null> {
  // LIMIT 1 stops at the first slot locked: the filter is evaluated row by row in series order.
  const result = await db.query<{ slot: number }>(
    `SELECT s AS slot FROM generate_series(0, $2::int - 1) s WHERE pg_try_advisory_xact_lock(hashtext('reaper-rows:' || $1), s) LIMIT 1`,
    [policy, concurrency],
  );
  return result.rows[0]?.slot ?? null;
}

/** The physical standbys' lag now (for `status` and the brake): moved to replication.ts, kept here for its callers. */
export { replicationLagRead } from './replication';
