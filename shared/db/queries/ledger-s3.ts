import { quoteIdentifier, type Db } from '../pool';
import { dueRecheckCtes, type admissionGrantAndClaim } from './admission';
import { guardSql } from './expiring-rows';
import type { ResolvedTarget } from './target';
import { noActiveHold } from './holds';
import { outboxInsertForSettledManySql } from './outbox';
import type { ClaimedOperation, LedgerOutcome } from './ledger';

/**
 * The ledger and admission statements of object storage policies (remote.kind s3). Same ledger,
 * same claim re-check (admission.dueRecheckCtes), same conditional transitions as remote-delete;
 * what differs is that one claim is one DeleteObjects request: the claimed operations share a
 * request id, admission takes one request token AND one key token per key, and the concurrency
 * cap counts requests in flight.
 */

export interface S3GrantOutcome {
  /** Operations now in_flight for the caller under request id `requestId` (empty: none claimed). */
  claimed: ClaimedOperation[];
  keyTokens: number;
  requestTokens: number;
  paused: boolean;
  blockedForMs: number;
  /** Requests that may still start under the concurrency cap, before this claim. */
  freeRequests: number;
  /** Due, still-eligible operations of the batch (claimed or not). */
  eligible: number;
  /** Keys this request would carry: min(eligible, requestKeys); it waits for that many key tokens. */
  wanted: number;
  superseded: number;
  held: number;
  /** How long before the statement answered its bucket was read (its refill instant), ms. */
  bucketAgeMs: number;
}

/**
 * The object storage grant, in ONE statement once the policy's admission row is locked
 * (admissionLock): refill the keys bucket (the row's tokens, at keysPerSecond up to requestKeys)
 * and the requests bucket (request_tokens, at requestsPerSecond up to its capacity) from the
 * database clock, count the requests in flight (distinct live claim_request_id), re-check the
 * batch's due operations against their rows (superseded / held finish here), and claim one
 * request's worth: when the policy is neither paused nor blocked, a request token and a request
 * slot are free, and the keys bucket holds min(eligible due operations, requestKeys) whole keys,
 * less `leadKeys` it may lend ahead (a request never leaves smaller than waiting a moment would
 * make it). A claim leaves the bucket at most -minLeadKeys: the caller sends the request when the
 * refill has paid its keys, never sooner than that after the grant (time to prepare it), even from
 * a full bucket (after an idle spell, those keys are not used). Claimed operations get
 * the lease, attempt + 1, the batch and `requestId`. A key is never in two in-flight requests:
 * an operation in flight under a live lease is not due, and SKIP LOCKED keeps two claims apart.
 */
export async function s3AdmissionGrantAndClaim(
  db: Db,
  target: ResolvedTarget,
  grant: Omit<Parameters<typeof admissionGrantAndClaim>[2], 'ratePerSecond' | 'burst'> & {
    requestKeys: number;
    keysPerSecond: number;
    requestCapacity: number;
    requestsPerSecond: number;
    requestId: string;
    /** Keys the bucket may lend ahead: a request is granted this many keys before its keys are there, to be sent when they are. */
    leadKeys: number;
    /** A claim leaves the bucket at most -minLeadKeys: its keys are paid no sooner than this many keys' time after the grant. */
    minLeadKeys: number;
  },
): Promise<S3GrantOutcome> {
  const result = await db.query<{
    tokens: number;
    request_tokens: number;
    paused: boolean;
    blocked_for_ms: number;
    free: number;
    eligible: number;
    wanted: number;
    superseded: number;
    held: number;
    claimed: Array<{ operation_key: string; asset_id: string; attempt_count: number }> | null;
    bucket_age_ms: number;
  }>(
    `WITH bucket AS (
       SELECT least($2::float8, a.tokens + greatest(0, extract(epoch FROM n.at - a.refilled_at)) * $3::float8) AS tokens,
              least($10::float8, coalesce(a.request_tokens, $10::float8)
                    + greatest(0, extract(epoch FROM n.at - coalesce(a.request_refilled_at, n.at))) * $11::float8) AS request_tokens,
              greatest(n.at, a.refilled_at) AS at, a.paused,
              greatest(0, coalesce(extract(epoch FROM a.blocked_until - n.at) * 1000, 0))::float8 AS blocked_for_ms
       FROM cleanup_admission a, (SELECT clock_timestamp() AS at) n
       WHERE a.policy = $1
     ), slots AS (
       SELECT $4::int - count(DISTINCT coalesce(claim_request_id, operation_key))::int AS free FROM cleanup_ledger
       WHERE policy = $1 AND state = 'in_flight' AND lease_expires_at >= clock_timestamp()
     ), ${dueRecheckCtes(target, { policy: '$1', keys: '$5', cutoff: '$8', guardFrom: 15 })}
     ), eligible AS (
       SELECT count(*)::int AS n, least(count(*)::int, $2::int) AS wanted FROM due WHERE still_eligible AND NOT held
     ), allowance AS (
       SELECT CASE WHEN b.paused OR b.blocked_for_ms > 0 OR b.request_tokens < 1 OR s.free < 1 OR e.wanted = 0 OR floor(b.tokens + $13::float8) < e.wanted THEN 0
                   ELSE e.wanted END AS n
       FROM bucket b, slots s, eligible e
     ), claimed AS (
       UPDATE cleanup_ledger l SET state = 'in_flight', lease_owner = $6, claim_batch_id = $9, claim_request_id = $12,
         last_delivered_at = clock_timestamp(), lease_expires_at = clock_timestamp() + $7 * interval '1 millisecond',
         attempt_count = l.attempt_count + 1, updated_at = clock_timestamp()
       WHERE l.operation_key IN (SELECT operation_key FROM due WHERE still_eligible AND NOT held ORDER BY not_before, operation_key LIMIT (SELECT n FROM allowance))
       RETURNING l.operation_key, l.asset_id, l.attempt_count
     ), stored AS (
       UPDATE cleanup_admission a SET tokens = least(b.tokens - (SELECT count(*) FROM claimed), -$14::float8), refilled_at = b.at,
         request_tokens = b.request_tokens - 1, request_refilled_at = b.at, updated_at = clock_timestamp()
       FROM bucket b
       WHERE a.policy = $1 AND EXISTS (SELECT 1 FROM claimed)
       RETURNING 1
     )
     SELECT CASE WHEN EXISTS (SELECT 1 FROM claimed) THEN least(b.tokens - (SELECT count(*) FROM claimed), -$14::float8) ELSE b.tokens END AS tokens,
            b.request_tokens - CASE WHEN EXISTS (SELECT 1 FROM claimed) THEN 1 ELSE 0 END AS request_tokens,
            b.paused, b.blocked_for_ms, s.free, e.n AS eligible, e.wanted,
            (SELECT count(*)::int FROM superseded) AS superseded, (SELECT count(*)::int FROM held) AS held,
            (SELECT json_agg(claimed) FROM claimed) AS claimed,
            (SELECT count(*) FROM stored) AS stored,
            -- Last in the list: read after the claim and the store ran.
            (extract(epoch FROM clock_timestamp() - b.at) * 1000)::float8 AS bucket_age_ms
     FROM bucket b, slots s, eligible e`,
    [
      grant.policy,
      grant.requestKeys,
      grant.keysPerSecond,
      grant.concurrency,
      grant.keys,
      grant.owner,
      grant.leaseMs,
      grant.cutoff,
      grant.batchId,
      grant.requestCapacity,
      grant.requestsPerSecond,
      grant.requestId,
      grant.leadKeys,
      grant.minLeadKeys,
      ...target.guardValues,
    ],
  );
  const row = result.rows[0];
  if (!row) throw new Error(`no admission row for policy ${grant.policy} (admissionLock creates it first)`);
  return {
    claimed: (row.claimed ?? []).map((c) => ({ operationKey: c.operation_key, assetId: c.asset_id, attemptCount: c.attempt_count })),
    keyTokens: Number(row.tokens),
    requestTokens: Number(row.request_tokens),
    paused: row.paused,
    blockedForMs: row.blocked_for_ms,
    freeRequests: row.free,
    eligible: row.eligible,
    wanted: row.wanted,
    superseded: row.superseded,
    held: row.held,
    bucketAgeMs: row.bucket_age_ms,
  };
}

/**
 * Takes `keys` more tokens from the policy's keys bucket (it may go below zero: a debt the refill
 * pays first), for a request sent late (shared/admission/s3.ts chargeLateSend). One statement.
 */
export async function admissionChargeKeys(db: Db, policy: string, keys: number): Promise<void> {
  await db.query(`UPDATE cleanup_admission SET tokens = tokens - $2, updated_at = clock_timestamp() WHERE policy = $1`, [policy, keys]);
}

/** One key's outcome to record, under the claim (lease owner + attempt) that sent it. */
export interface S3KeyOutcomeRow {
  operationKey: string;
  attempt: number;
  lastResult: string;
  error: string | null;
}

/**
 * Finishes many operations of one request, each conditional on its claim (owner AND attempt, as
 * ledger.ledgerFinish): returns the keys whose claim was still current (the others are
 * 'stale-lease': a newer claim is the truth). A confirmed operation drops its payload.
 */
export async function ledgerFinishRequestKeys(db: Db, owner: string, outcome: LedgerOutcome, rows: readonly S3KeyOutcomeRow[]): Promise<Set<string>> {
  if (rows.length === 0) return new Set();
  const result = await db.query<{ operation_key: string }>(
    `UPDATE cleanup_ledger l SET state = 'done', outcome = $2, last_result = u.last_result, last_error = u.error,
       payload = CASE WHEN $2 = 'confirmed' THEN NULL ELSE l.payload END,
       completed_at = clock_timestamp(), updated_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL
     FROM unnest($3::text[], $4::int[], $5::text[], $6::text[]) AS u(operation_key, attempt, last_result, error)
     WHERE l.operation_key = u.operation_key AND l.lease_owner = $1 AND l.attempt_count = u.attempt AND l.state = 'in_flight'
     RETURNING l.operation_key`,
    [owner, outcome, ...columnsOf(rows)],
  );
  return new Set(result.rows.map((row) => row.operation_key));
}

/**
 * Puts many operations of one request back to pending until `delayMs` from now (a retryable key
 * error, a throttled or uncertain request), each conditional on its claim. Returns the keys applied.
 */
export async function ledgerRescheduleRequestKeys(db: Db, owner: string, delayMs: number, rows: readonly S3KeyOutcomeRow[]): Promise<Set<string>> {
  if (rows.length === 0) return new Set();
  const result = await db.query<{ operation_key: string }>(
    `UPDATE cleanup_ledger l SET state = 'pending', not_before = clock_timestamp() + $2 * interval '1 millisecond',
       last_result = u.last_result, last_error = u.error, lease_owner = NULL, lease_expires_at = NULL, updated_at = clock_timestamp()
     FROM unnest($3::text[], $4::int[], $5::text[], $6::text[]) AS u(operation_key, attempt, last_result, error)
     WHERE l.operation_key = u.operation_key AND l.lease_owner = $1 AND l.attempt_count = u.attempt AND l.state = 'in_flight'
     RETURNING l.operation_key`,
    [owner, Math.max(0, Math.round(delayMs)), ...columnsOf(rows)],
  );
  return new Set(result.rows.map((row) => row.operation_key));
}

function columnsOf(rows: readonly S3KeyOutcomeRow[]): [string[], number[], string[], Array<string | null>] {
  return [rows.map((row) => row.operationKey), rows.map((row) => row.attempt), rows.map((row) => row.lastResult), rows.map((row) => row.error)];
}

/**
 * The audit of object storage deletions, in the transaction that records the request's outcome:
 * one cleanup_audit row per deleted object AND version (`versionId` null: the current version, or
 * a version no longer known). Written whether or not the caller's claim is still current (the
 * store deleted the object either way), and once per (operation, version): the ledger rows are
 * locked in key order first, so a stale and a current writer of one operation take turns and the
 * second sees the first's rows. An operation whose retry found nothing left to delete (its first
 * request's answer was lost) gets one row with a null version, unless it has one already.
 */
export async function auditRecordS3Deleted(
  db: Db,
  policyVersion: string,
  deleted: ReadonlyArray<{ operationKey: string; versionIds: ReadonlyArray<string | null> }>,
): Promise<number> {
  if (deleted.length === 0) return 0;
  const keys = [...new Set(deleted.map((entry) => entry.operationKey))].sort();
  await db.query(`SELECT 1 FROM cleanup_ledger WHERE operation_key = ANY($1::text[]) ORDER BY operation_key FOR UPDATE`, [keys]);
  const pairs = deleted.flatMap((entry) => (entry.versionIds.length > 0 ? entry.versionIds : [null]).map((versionId) => ({ key: entry.operationKey, versionId })));
  const result = await db.query(
    `INSERT INTO cleanup_audit (policy, key, observed_expiry, run_id, batch_id, policy_version, operation_key, outcome, version_id)
     SELECT l.policy, l.asset_id, l.observed_expiry, l.run_id, l.claim_batch_id, $3, l.operation_key, 'confirmed', v.version_id
     FROM unnest($1::text[], $2::text[]) AS v(operation_key, version_id) JOIN cleanup_ledger l ON l.operation_key = v.operation_key
     WHERE NOT EXISTS (SELECT 1 FROM cleanup_audit a WHERE a.policy = l.policy AND a.key = l.asset_id AND a.operation_key = l.operation_key
                         AND (a.version_id IS NOT DISTINCT FROM v.version_id OR v.version_id IS NULL))`,
    [pairs.map((pair) => pair.key), pairs.map((pair) => pair.versionId), policyVersion],
  );
  return result.rowCount ?? 0;
}

/** Audit rows of a policy's operation, with their version ids (tests, `reaper audit`). */
export async function auditVersionsOf(db: Db, operationKey: string): Promise<Array<string | null>> {
  const result = await db.query<{ version_id: string | null }>(`SELECT version_id FROM cleanup_audit WHERE operation_key = $1 ORDER BY audit_id`, [operationKey]);
  return result.rows.map((row) => row.version_id);
}

/**
 * ledger.targetSettleConfirmed for all the confirmed keys of one request, in two statements
 * instead of two per key: each policy row that still holds its operation's retention decision
 * (key, exact observed expiry, guard) and has no active legal hold is marked (markConfirmed) or
 * deleted, with their expiry events when events are on (one outbox row per run and batch of the
 * settled keys, outboxInsertForSettledManySql); the operations whose row holds the decision
 * but is held now are turned to outcome 'held' (the object is gone; the row is kept until the hold
 * is removed, as for the HTTP remote). Rows that changed are left alone. In the confirming transaction.
 */
export async function targetSettleConfirmedMany(
  db: Db,
  target: ResolvedTarget,
  settle: {
    items: ReadonlyArray<{ assetId: string; observedExpiry: string }>;
    markConfirmed: Readonly<Record<string, string | number | boolean>> | undefined;
    events?: { policyVersion: string } | null;
  },
): Promise<{ settled: number; held: number }> {
  if (settle.items.length === 0) return { settled: 0, held: 0 };
  const { table, key, expiresAt, keyType } = target;
  const decision = `t.${key} = i.id::${keyType} AND t.${expiresAt} = i.observed${guardSql(target, 4)}`;
  const item = `(SELECT * FROM unnest($1::text[], $2::timestamptz[]) AS u(id, observed)) i`;
  const notHeld = noActiveHold('$3', `t.${key}`);
  const params: unknown[] = [settle.items.map((entry) => entry.assetId), settle.items.map((entry) => entry.observedExpiry), target.policy, ...target.guardValues];
  const base = params.length;
  let change: string;
  if (settle.markConfirmed && Object.keys(settle.markConfirmed).length > 0) {
    const assignments = Object.keys(settle.markConfirmed).map((column, index) => `${quoteIdentifier(column)} = $${base + 1 + index}`);
    params.push(...Object.values(settle.markConfirmed).map(String));
    change = `UPDATE ${table} t SET ${assignments.join(', ')} FROM ${item} WHERE ${decision} AND ${notHeld}`;
  } else {
    change = `DELETE FROM ${table} t USING ${item} WHERE ${decision} AND ${notHeld}`;
  }
  let outbox = '';
  if (settle.events) {
    params.push(settle.events.policyVersion);
    outbox = outboxInsertForSettledManySql({ policy: '$3', policyVersion: `$${params.length}` });
  }
  const settled = await db.query<{ n: number }>(
    `WITH settled AS (${change} RETURNING t.${key}::text AS key, t.${expiresAt} AS expiry)${outbox} SELECT count(*)::int AS n FROM settled`,
    params,
  );
  const n = settled.rows[0]!.n;
  if (n === settle.items.length) return { settled: n, held: 0 };
  const held = await db.query(
    `UPDATE cleanup_ledger l SET outcome = 'held', last_result = coalesce(l.last_result, '') || '; row kept: legal hold', updated_at = clock_timestamp()
     FROM ${table} t, ${item}
     WHERE ${decision} AND NOT ${notHeld}
       AND l.operation_key = $3 || ':' || t.${key}::text || ':' || reaper_iso(t.${expiresAt}) AND l.state = 'done' AND l.outcome = 'confirmed'`,
    params.slice(0, base),
  );
  return { settled: n, held: held.rowCount ?? 0 };
}
