import { quoteIdentifier, type Db } from '../pool';
import { guardSql, type ExpiringItem } from './expiring-rows';
import type { ResolvedTarget } from './target';
import { noActiveHold } from './holds';
import { outboxInsertForSettledSql } from './outbox';

/**
 * The remote-delete ledger (cleanup_ledger): the record of remote work. Every transition is
 * conditional: on the state it leaves and, for completion, on the current claim (lease owner AND
 * attempt number). Zero rows is an answer ('stale-lease', 'not-due'), never an exception.
 */

export type LedgerOutcome = 'confirmed' | 'rejected' | 'gave-up' | 'superseded' | 'held';

export interface ClaimedOperation {
  operationKey: string;
  assetId: string;
  /** The claim token: attempt_count as set by this claim. Completion requires it unchanged. */
  attemptCount: number;
}

/**
 * THE eligibility re-check of remote-delete, in one place: the policy's row `t` still holds the
 * retention decision an operation `l` carries (same key, the exact observed expiry, expired at or
 * before least(cutoff, now) — no message can make an unexpired row eligible — and the guard). Used
 * by recording and by the claim. A later condition (e.g. `AND NOT EXISTS (active legal hold)`)
 * belongs here and nowhere else.
 *
 * `id` and `observed` are SQL expressions for the operation's asset id (text) and observed expiry
 * (timestamptz); `cutoff` is the parameter holding the batch's cutoff; guard values start at
 * parameter `guardFrom`.
 */
export function stillEligibleSql(target: ResolvedTarget, at: { id: string; observed: string; cutoff: string; guardFrom: number }): string {
  const { table, key, expiresAt, keyType } = target;
  const guard = guardSql(target, at.guardFrom);
  return `SELECT 1 FROM ${table} t WHERE t.${key} = (${at.id})::${keyType} AND t.${expiresAt} = ${at.observed}
            AND t.${expiresAt} <= least(${at.cutoff}::timestamptz, statement_timestamp())${guard}`;
}

/**
 * SQL condition: the row an operation names (`id`, its asset id as text) is under an active legal
 * hold. Compared with the ROW's canonical key text (t.key::text), never with how a message or an
 * operation spelled the id: for a bigint key, a batch naming `007` is held by the hold on `7`.
 */
export function rowHeldSql(target: ResolvedTarget, at: { id: string; policy: string }): string {
  const { table, key, keyType } = target;
  return `EXISTS (SELECT 1 FROM ${table} t WHERE t.${key} = (${at.id})::${keyType} AND NOT ${noActiveHold(at.policy, `t.${key}`)})`;
}

/**
 * Records one pending operation per item whose row is STILL eligible (same expiry to the
 * microsecond, expiry <= least(cutoff, now), guard true), remembering the batch that recorded it.
 * Open operations of the batch are marked as carried (last_delivered_at) and their delivery
 * counted; finished ones are not touched, except those that ended 'held' or 'superseded' while
 * their row holds the same decision again: they are re-opened (pending, due now). Keys are the
 * row's canonical text (t.key::text), whatever spelling the message used. A webhook is not a
 * delivery: what it records is carried by the ledger sweeper. Returns the keys of the batch that
 * have an operation (new or old).
 */
export async function ledgerRecordCandidates(
  db: Db,
  target: ResolvedTarget,
  batch: {
    policy: string;
    runId: string | null;
    cutoff: string;
    items: readonly ExpiringItem[];
    source: 'scan' | 'webhook';
    /** The batch carrying the items (absent for a webhook). */
    batchId?: string | null;
  },
): Promise<{ inserted: number; known: string[] }> {
  const { table, key, expiresAt, keyType } = target;
  const guard = guardSql(target, 8);
  const result = await db.query<{ operation_key: string; inserted: boolean }>(
    `WITH item AS (
       -- the key's canonical spelling (cast through its type; the expiry through reaper_iso), so
       -- '007' and '7' of a bigint key, or two spellings of one instant, name one operation
       SELECT $1 || ':' || (i.id::${keyType})::text || ':' || reaper_iso(i.observed::timestamptz) AS operation_key,
              i.id, i.observed::timestamptz AS observed_expiry
       FROM unnest($2::text[], $3::text[]) AS i(id, observed)
     ), eligible AS (
       -- the operation key, the asset id (holds, the remote call, audit) are the ROW's canonical
       -- key text from this join, never the message's spelling; one per row however often named
       SELECT DISTINCT ON (t.${key}) $1 || ':' || t.${key}::text || ':' || reaper_iso(t.${expiresAt}) AS operation_key,
              t.${key}::text AS id, t.${expiresAt} AS observed_expiry, to_jsonb(t) AS payload
       FROM item JOIN ${table} t ON t.${key} = item.id::${keyType} AND t.${expiresAt} = item.observed_expiry
                               AND t.${expiresAt} <= least($4::timestamptz, statement_timestamp())${guard}
       ORDER BY t.${key}
     ), recorded AS (
       INSERT INTO cleanup_ledger AS l (operation_key, policy, asset_id, observed_expiry, run_id, source, payload, delivery_count, batch_id, last_delivered_at)
       -- a webhook is not a broker delivery (transport and cleanup attempts are counted apart)
       SELECT operation_key, $1, id, observed_expiry, $5, $6, payload, CASE WHEN $6 = 'webhook' THEN 0 ELSE 1 END, $7,
              CASE WHEN $6 = 'webhook' THEN NULL ELSE clock_timestamp() END
       FROM eligible
       ORDER BY operation_key -- rows are locked in key order by every writer: no deadlock between duplicate deliveries
       ON CONFLICT (operation_key) DO UPDATE
         SET delivery_count = l.delivery_count + CASE WHEN $6 = 'webhook' THEN 0 ELSE 1 END,
             last_delivered_at = CASE WHEN $6 = 'webhook' THEN l.last_delivered_at ELSE clock_timestamp() END,
             updated_at = clock_timestamp(),
             -- An operation stopped by a legal hold, or superseded because its row changed (guard,
             -- or a cutoff it did not pass) is re-opened when its row holds the same decision
             -- again (this join just said so): otherwise that retention decision is lost for good.
             state = CASE WHEN l.outcome IN ('held', 'superseded') THEN 'pending' ELSE l.state END,
             outcome = CASE WHEN l.outcome IN ('held', 'superseded') THEN NULL ELSE l.outcome END,
             completed_at = CASE WHEN l.outcome IN ('held', 'superseded') THEN NULL ELSE l.completed_at END,
             not_before = CASE WHEN l.outcome IN ('held', 'superseded') THEN clock_timestamp() ELSE l.not_before END,
             batch_id = CASE WHEN l.outcome IN ('held', 'superseded') THEN coalesce($7, l.batch_id) ELSE l.batch_id END
         WHERE l.state <> 'done' OR l.outcome IN ('held', 'superseded')
       RETURNING l.operation_key, (xmax = 0) AS inserted
     ), known AS (
       -- operations of this batch recorded earlier and not touched above (finished, or their row changed since)
       SELECT l.operation_key, false AS inserted FROM cleanup_ledger l
       WHERE l.operation_key IN (SELECT operation_key FROM item)
         AND l.operation_key NOT IN (SELECT operation_key FROM recorded)
     )
     SELECT operation_key, inserted FROM recorded UNION ALL SELECT operation_key, inserted FROM known`,
    [
      batch.policy,
      batch.items.map((item) => item.id),
      batch.items.map((item) => item.observedExpiry),
      batch.cutoff,
      batch.runId,
      batch.source,
      batch.batchId ?? null,
      ...target.guardValues,
    ],
  );
  return { inserted: result.rows.filter((row) => row.inserted).length, known: result.rows.map((row) => row.operation_key) };
}

/**
 * Of `keys`: how many are due now, open, and when the earliest not-yet-due or leased one will be;
 * `confirmedByBatch`: confirmations made by claims of `batchId` itself (item 17: a receipt never
 * counts what another batch confirmed); `ahead`: open operations of the policy before this batch's
 * first due one in line (not_before, key) — its turn at the admitted rate — counted up to
 * `aheadLimit` at most (a batch deep in a large backlog needs to know only that it is far).
 */
export async function ledgerDueSummary(
  db: Db,
  summary: { policy: string; keys: readonly string[]; batchId: string; aheadLimit?: number },
): Promise<{ due: number; open: number; confirmedByBatch: number; nextInMs: number | null; ahead: number }> {
  const result = await db.query<{ due: number; open: number; confirmed: number; next_in_ms: number | null; ahead: number }>(
    `WITH mine AS (
       SELECT * FROM cleanup_ledger WHERE operation_key = ANY($1::text[])
     ), first_due AS (
       SELECT not_before, operation_key FROM mine WHERE state = 'pending' AND not_before <= clock_timestamp()
       ORDER BY not_before, operation_key LIMIT 1
     )
     SELECT count(*) FILTER (WHERE outcome = 'confirmed' AND claim_batch_id = $2)::int AS confirmed,
            count(*) FILTER (WHERE (state = 'pending' AND not_before <= clock_timestamp())
                              OR (state = 'in_flight' AND lease_expires_at < clock_timestamp()))::int AS due,
            count(*) FILTER (WHERE state <> 'done')::int AS open,
            greatest(0, ceil(extract(epoch FROM min(CASE WHEN state = 'pending' THEN not_before
                                                     WHEN state = 'in_flight' THEN lease_expires_at END) - clock_timestamp()) * 1000))::float8 AS next_in_ms,
            coalesce((SELECT count(*)::int FROM (SELECT 1 FROM cleanup_ledger l, first_due f
                      WHERE l.policy = $3 AND l.state = 'pending' AND (l.not_before, l.operation_key) < (f.not_before, f.operation_key)
                      LIMIT $4) ahead), 0) AS ahead
     FROM mine`,
    [summary.keys, summary.batchId, summary.policy, summary.aheadLimit ?? null],
  );
  const row = result.rows[0]!;
  return { due: row.due, open: row.open, confirmedByBatch: row.confirmed, nextInMs: row.next_in_ms, ahead: row.ahead };
}

/** The claim an outcome belongs to: the lease owner AND the attempt number its claim set (the fence). */
export interface ClaimToken {
  operationKey: string;
  owner: string;
  attempt: number;
}

/**
 * Finishes an operation. Conditional on the caller's claim still being the current one (lease
 * owner AND attempt number): a worker frozen past its lease, or another process started with the
 * same REAPER_WORKER_ID, finds 0 rows and changes nothing (the newer claim wins). A confirmed
 * operation drops its payload (only ids, timestamps, counts and outcome stay).
 */
export async function ledgerFinish(
  db: Db,
  finish: ClaimToken & { outcome: LedgerOutcome; lastResult: string; error?: string | null },
): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET state = 'done', outcome = $3, last_result = $4, last_error = $5,
       payload = CASE WHEN $3 = 'confirmed' THEN NULL ELSE payload END,
       completed_at = clock_timestamp(), updated_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL
     WHERE operation_key = $1 AND lease_owner = $2 AND attempt_count = $6 AND state = 'in_flight'`,
    [finish.operationKey, finish.owner, finish.outcome, finish.lastResult, finish.error ?? null, finish.attempt],
  );
  return result.rowCount === 1;
}

/**
 * Puts an operation back to pending until `delayMs` from now (rate limited, uncertain, circuit
 * open). `uncountAttempt` when no call was made after all. Conditional on the claim (owner and
 * attempt number). The batch that claimed it still carries it (last_delivered_at kept).
 */
export async function ledgerReschedule(
  db: Db,
  reschedule: ClaimToken & { delayMs: number; lastResult: string; error?: string | null; uncountAttempt?: boolean },
): Promise<boolean> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET state = 'pending', not_before = clock_timestamp() + $3 * interval '1 millisecond',
       last_result = $4, last_error = $5, attempt_count = attempt_count - CASE WHEN $6 THEN 1 ELSE 0 END,
       lease_owner = NULL, lease_expires_at = NULL, updated_at = clock_timestamp()
     WHERE operation_key = $1 AND lease_owner = $2 AND attempt_count = $7 AND state = 'in_flight'`,
    [
      reschedule.operationKey,
      reschedule.owner,
      Math.max(0, Math.round(reschedule.delayMs)),
      reschedule.lastResult,
      reschedule.error ?? null,
      !!reschedule.uncountAttempt,
      reschedule.attempt,
    ],
  );
  return result.rowCount === 1;
}

/**
 * The batch stops carrying its open pending operations: they wait in the ledger (not_before is
 * their turn; never earlier than now + `notBeforeMs`) and the ledger sweeper publishes the batch
 * again when their turn is near. Returns how many were parked.
 */
export async function ledgerPark(db: Db, park: { keys: readonly string[]; notBeforeMs: number }): Promise<number> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET last_delivered_at = NULL,
       not_before = greatest(not_before, clock_timestamp() + $2 * interval '1 millisecond'), updated_at = clock_timestamp()
     WHERE operation_key = ANY($1::text[]) AND state = 'pending'`,
    [park.keys, Math.max(0, Math.round(park.notBeforeMs))],
  );
  return result.rowCount ?? 0;
}

/**
 * The reclaimer: in-flight operations whose lease expired go back to pending, due now, and no
 * longer carried (the holder is presumed gone): the ledger sweeper sends their batch again. They
 * are re-checked against their row by the claim before any further call.
 */
export async function ledgerReturnExpiredLeases(db: Db): Promise<number> {
  const result = await db.query(
    `UPDATE cleanup_ledger SET state = 'pending', not_before = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL,
       last_result = 'lease-expired', last_delivered_at = NULL, updated_at = clock_timestamp()
     WHERE state = 'in_flight' AND lease_expires_at < clock_timestamp()`,
  );
  return result.rowCount ?? 0;
}

/** Keeps the message of a batch with open operations, so the ledger can send it again. */
export async function remoteBatchesKeep(db: Db, batch: { batchId: string; policy: string; content: Buffer }): Promise<void> {
  await db.query(`INSERT INTO cleanup_remote_batches (batch_id, policy, content) VALUES ($1, $2, $3) ON CONFLICT (batch_id) DO NOTHING`, [
    batch.batchId,
    batch.policy,
    batch.content,
  ]);
}

/** The batch is finished (its receipt is written): its message is no longer needed. */
export async function remoteBatchesForget(db: Db, batchId: string): Promise<void> {
  await db.query(`DELETE FROM cleanup_remote_batches WHERE batch_id = $1`, [batchId]);
}

/**
 * Kept batches of `policy` that nothing will send again although they have no receipt: every
 * operation they name is finished, but not by a claim of theirs. A batch is parked (acked, kept
 * here) while its operations wait; the sweeper sends it again only for an operation that is still
 * pending, and it receives the operation only if the operation's batch_id is its own. So a parked
 * batch whose operations another batch finished (two runs published the same row before either
 * was recorded, a takeover republished a window, a lease held by a frozen worker), or that were
 * recorded under another batch's id, would stay without a receipt and keep its run `published`.
 *
 * Looks at most `limit` kept batches after `after` (batch id order; the caller goes round), kept
 * or last sent again more than `keptForMs` ago (a delivery in progress writes its own receipt),
 * naming at least one recorded operation and no open one. The message's ids are spelled as the
 * publisher wrote them (`007` of a bigint key, an upper-case uuid): each is cast through the key's
 * type (`keyType`, as resolved) to the canonical text the ledger's operation keys use; a kept
 * batch's ids all cast (its delivery recorded them through the same cast). Those returned count as sent again now
 * (created_at moved to now: not returned again for `keptForMs`). `last`: the last batch id looked
 * at (null: the end was reached).
 */
export async function remoteBatchesOrphaned(
  db: Db,
  look: { policy: string; keyType: string; after: string | null; limit: number; keptForMs: number },
): Promise<{ orphans: Array<{ batchId: string; content: Buffer }>; last: string | null }> {
  const result = await db.query<{ batch_id: string; content: Buffer | null; orphan: boolean }>(
    `WITH window_ AS (
       SELECT batch_id, content, created_at FROM cleanup_remote_batches
       WHERE policy = $1 AND ($2::text IS NULL OR batch_id > $2) ORDER BY batch_id LIMIT $3
     ), judged AS (
       SELECT w.batch_id, w.created_at < clock_timestamp() - $4 * interval '1 millisecond' AND ops.recorded > 0 AND ops.open = 0 AS orphan
       FROM window_ w CROSS JOIN LATERAL (
         -- the operations the batch names (keys as recorded: policy, canonical id, reaper_iso expiry)
         SELECT count(l.operation_key) AS recorded, count(*) FILTER (WHERE l.state <> 'done') AS open
         FROM jsonb_array_elements(convert_from(w.content, 'UTF8')::jsonb -> 'items') AS i(item)
         JOIN cleanup_ledger l ON l.operation_key = $1 || ':' || ((i.item ->> 'id')::${look.keyType})::text || ':' || reaper_iso((i.item ->> 'observedExpiry')::timestamptz)
       ) ops
     ), resent AS (
       UPDATE cleanup_remote_batches b SET created_at = clock_timestamp() FROM judged j
       WHERE b.batch_id = j.batch_id AND j.orphan
       RETURNING b.batch_id, b.content
     )
     SELECT j.batch_id, r.content, j.orphan FROM judged j LEFT JOIN resent r USING (batch_id) ORDER BY j.batch_id`,
    [look.policy, look.after, look.limit, look.keptForMs],
  );
  const rows = result.rows;
  return {
    orphans: rows.filter((row) => row.orphan && row.content).map((row) => ({ batchId: row.batch_id, content: row.content! })),
    last: rows.length < look.limit ? null : rows[rows.length - 1]!.batch_id,
  };
}

export interface SweepCandidate {
  operationKey: string;
  assetId: string;
  observedExpiry: string;
  /** The batch that carried it; its kept message, when there is one, is in the pick's `kept`. */
  batchId: string | null;
}

export interface SweepPick {
  paused: boolean;
  carried: number;
  picked: SweepCandidate[];
  /** The kept message (as published) of each picked operation's batch, by batch id: each read once. */
  kept: ReadonlyMap<string, Buffer>;
}

/**
 * The sweeper's pick, under a per-policy advisory lock (one sweeper at a time per policy): pending
 * operations due within `aheadMs` that no copy carries (never carried, parked, reclaimed, or last
 * carried more than `staleMs` ago: a copy lost from a delay tier), in line order, at most as many
 * as the admission can take within `aheadMs` minus what copies already carry. Null when another
 * sweeper holds the lock. The caller publishes, then marks them carried (ledgerMarkCarried) in the
 * same transaction.
 */
export async function ledgerSweepPick(
  db: Db,
  sweep: { policy: string; ratePerSecond: number; aheadMs: number; staleMs: number; limit: number },
): Promise<SweepPick | null> {
  const lock = await db.query<{ locked: boolean }>(`SELECT pg_try_advisory_xact_lock(hashtext('reaper.ledger-sweep'), hashtext($1)) AS locked`, [sweep.policy]);
  if (!lock.rows[0]!.locked) return null;
  const state = await db.query<{ paused: boolean; blocked_ms: number; carried: number }>(
    `SELECT coalesce((SELECT paused FROM cleanup_admission WHERE policy = $1), false) AS paused,
            coalesce((SELECT greatest(0, extract(epoch FROM blocked_until - clock_timestamp()) * 1000) FROM cleanup_admission WHERE policy = $1), 0)::float8 AS blocked_ms,
            (SELECT count(*)::int FROM cleanup_ledger WHERE policy = $1 AND state <> 'done'
               AND last_delivered_at > clock_timestamp() - $2 * interval '1 millisecond') AS carried`,
    [sweep.policy, sweep.staleMs],
  );
  const { paused, blocked_ms: blockedMs, carried } = state.rows[0]!;
  // Paused: nothing is sent (work waits in the ledger, resume continues). Blocked by a 429: the
  // turn starts when the block ends.
  if (paused) return { paused, carried, picked: [], kept: new Map() };
  const budget = Math.max(0, Math.ceil((sweep.ratePerSecond * Math.max(0, sweep.aheadMs - blockedMs)) / 1000) - carried);
  // Nothing carried at all: at least one batch moves, whatever the rate.
  const limit = Math.min(sweep.limit, carried === 0 ? Math.max(1, budget) : budget);
  if (limit === 0) return { paused, carried, picked: [], kept: new Map() };
  const result = await db.query<{ operation_key: string; asset_id: string; observed_expiry: string; batch_id: string | null }>(
    `SELECT operation_key, asset_id, reaper_iso(observed_expiry) AS observed_expiry, batch_id FROM cleanup_ledger
     WHERE policy = $1 AND state = 'pending' AND not_before <= clock_timestamp() + $2 * interval '1 millisecond'
       AND (last_delivered_at IS NULL OR last_delivered_at < clock_timestamp() - $3 * interval '1 millisecond')
     ORDER BY not_before, operation_key LIMIT $4 FOR UPDATE SKIP LOCKED`,
    [sweep.policy, sweep.aheadMs, sweep.staleMs, limit],
  );
  // Each batch's message once, not once per operation: joined per operation, a pick of 5,000
  // operations of 1,000-key batches moved each ~70 KB message 1,000 times (~350 MB) and held the
  // pick's row locks and the sweep lock for 1.4-5.7 s (bench figure 9 stalled waiting for it).
  const batchIds = [...new Set(result.rows.flatMap((row) => (row.batch_id === null ? [] : [row.batch_id])))];
  const messages = await db.query<{ batch_id: string; content: Buffer }>(`SELECT batch_id, content FROM cleanup_remote_batches WHERE batch_id = ANY($1::text[])`, [batchIds]);
  return {
    paused,
    carried,
    picked: result.rows.map((row) => ({ operationKey: row.operation_key, assetId: row.asset_id, observedExpiry: row.observed_expiry, batchId: row.batch_id })),
    kept: new Map(messages.rows.map((row) => [row.batch_id, row.content])),
  };
}

/**
 * After the sweeper published: the open operations of the published batches are carried as of
 * now; operations that had no kept batch get the new batch's id (so the next sweep resends it).
 */
export async function ledgerMarkCarried(db: Db, carried: { batchIds: readonly string[]; adopted: ReadonlyArray<{ operationKey: string; batchId: string }> }): Promise<void> {
  await db.query(
    `UPDATE cleanup_ledger l SET batch_id = a.batch_id, last_delivered_at = clock_timestamp()
     FROM unnest($1::text[], $2::text[]) AS a(operation_key, batch_id) WHERE l.operation_key = a.operation_key AND l.state <> 'done'`,
    [carried.adopted.map((a) => a.operationKey), carried.adopted.map((a) => a.batchId)],
  );
  await db.query(`UPDATE cleanup_ledger SET last_delivered_at = clock_timestamp() WHERE batch_id = ANY($1::text[]) AND state <> 'done'`, [carried.batchIds]);
}

/**
 * The sweeper's publish failed after ledgerMarkCarried committed: its pending operations are not
 * carried after all, so the next sweep may pick them at once. Only pending ones: an operation a
 * worker already claimed is carried by that worker.
 */
export async function ledgerUnmarkCarried(db: Db, batchIds: readonly string[]): Promise<void> {
  await db.query(`UPDATE cleanup_ledger SET last_delivered_at = NULL WHERE batch_id = ANY($1::text[]) AND state = 'pending'`, [batchIds]);
}

/** The database clock as a batch cutoff (ISO with microseconds). */
export async function ledgerDatabaseNow(db: Db): Promise<string> {
  return (await db.query<{ now: string }>(`SELECT reaper_iso(clock_timestamp()) AS now`)).rows[0]!.now;
}

/**
 * After a confirmed call, in the confirming transaction: the policy's own row is marked
 * (markConfirmed) or deleted if it still holds the same retention decision AND no legal hold is on
 * it now (re-checked here: a hold placed while the call was in flight still keeps the row).
 * 'held': the row holds the decision but is held; the remote object is gone (the ledger finished
 * 'confirmed' and the audit row says so), and the operation is turned to outcome 'held' so that,
 * once the hold is removed, the next scan re-opens it: the retry with the same Idempotency-Key is
 * confirmed again by the remote and this step then settles the row. 'changed': the row no longer
 * holds the decision (renewed, guard changed, gone), nothing to settle.
 */
export async function targetSettleConfirmed(
  db: Db,
  target: ResolvedTarget,
  settle: {
    assetId: string;
    observedExpiry: string;
    markConfirmed: Readonly<Record<string, string | number | boolean>> | undefined;
    /** Expiry events on: a settled row gets one cleanup_outbox row, in this statement. */
    events?: { policyVersion: string } | null;
  },
): Promise<'settled' | 'held' | 'changed'> {
  const { table, key, expiresAt, keyType } = target;
  const guard = guardSql(target, 4);
  const decision = `t.${key} = $1::${keyType} AND t.${expiresAt} = $2::timestamptz${guard}`;
  const params: unknown[] = [settle.assetId, settle.observedExpiry, target.policy, ...target.guardValues];
  const notHeld = noActiveHold('$3', `t.${key}`);
  let statement: string;
  if (settle.markConfirmed && Object.keys(settle.markConfirmed).length > 0) {
    const first = params.length + 1;
    const assignments = Object.keys(settle.markConfirmed).map((column, index) => `${quoteIdentifier(column)} = $${first + index}`);
    params.push(...Object.values(settle.markConfirmed).map(String));
    statement = `UPDATE ${table} t SET ${assignments.join(', ')} WHERE ${decision} AND ${notHeld}`;
  } else {
    statement = `DELETE FROM ${table} t WHERE ${decision} AND ${notHeld}`;
  }
  if (settle.events) {
    params.push(settle.events.policyVersion);
    const settled = `${statement} RETURNING t.${key}::text AS key, t.${expiresAt} AS expiry`;
    statement = `WITH settled AS (${settled})${outboxInsertForSettledSql({ policy: '$3', policyVersion: `$${params.length}` })} SELECT 1 FROM settled`;
  }
  if (((await db.query(statement, params)).rowCount ?? 0) > 0) return 'settled';
  // Not settled: held, or the row changed. The operation is found by the row's canonical key.
  const held = await db.query(
    `UPDATE cleanup_ledger l SET outcome = 'held', last_result = coalesce(l.last_result, '') || '; row kept: legal hold', updated_at = clock_timestamp()
     FROM ${table} t
     WHERE ${decision} AND NOT ${notHeld}
       AND l.operation_key = $3 || ':' || t.${key}::text || ':' || reaper_iso(t.${expiresAt}) AND l.state = 'done' AND l.outcome = 'confirmed'`,
    params.slice(0, 3 + target.guardValues.length),
  );
  return (held.rowCount ?? 0) > 0 ? 'held' : 'changed';
}

export interface LedgerCounts {
  policy: string;
  pending: number;
  pendingDue: number;
  inFlight: number;
  confirmed: number;
  rejected: number;
  gaveUp: number;
  superseded: number;
}

export async function ledgerCountsByPolicy(db: Db): Promise<LedgerCounts[]> {
  const result = await db.query<{
    policy: string;
    pending: number;
    pending_due: number;
    in_flight: number;
    confirmed: number;
    rejected: number;
    gave_up: number;
    superseded: number;
  }>(
    `SELECT policy,
       count(*) FILTER (WHERE state = 'pending')::int AS pending,
       count(*) FILTER (WHERE state = 'pending' AND not_before <= clock_timestamp())::int AS pending_due,
       count(*) FILTER (WHERE state = 'in_flight')::int AS in_flight,
       count(*) FILTER (WHERE outcome = 'confirmed')::int AS confirmed,
       count(*) FILTER (WHERE outcome = 'rejected')::int AS rejected,
       count(*) FILTER (WHERE outcome = 'gave-up')::int AS gave_up,
       count(*) FILTER (WHERE outcome = 'superseded')::int AS superseded
     FROM cleanup_ledger GROUP BY policy ORDER BY policy`,
  );
  return result.rows.map((row) => ({
    policy: row.policy,
    pending: row.pending,
    pendingDue: row.pending_due,
    inFlight: row.in_flight,
    confirmed: row.confirmed,
    rejected: row.rejected,
    gaveUp: row.gave_up,
    superseded: row.superseded,
  }));
}
