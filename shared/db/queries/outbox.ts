import { expiryEventId, type ExpiryEventV2, type PartitionRetiredEventV1 } from '../../contracts/expiry-event';
import type { Db } from '../pool';

/**
 * The expiry-event outbox (cleanup_outbox, migration 0019): rows written by the deleting statements
 * in the same transaction as the deletion (so an event exists exactly when its deletion committed),
 * published and then deleted by `reaper relay` (services/relay). The CTE builders below are
 * fragments of those statements; they interpolate only parameter numbers and CTE names.
 */

/**
 * row-delete: the outbox CTE of expiringRowsDeleteGroupIfStillExpired, ONE row per batch of the
 * statement that deleted rows (migration 0031), carrying the keys and observed expiries of every row
 * its `removed` CTE deleted for that batch, in the same order (the same ORDER BY in both aggregates),
 * with the batch's cutoff from the statement's `b` CTE. A no-op, a held row or a renewed row is not
 * in `removed`, so it has no event; a batch that deleted nothing gets no row. A key is in `removed` at
 * most once (a DELETE removes a row once, even when two batches of the group name it), so the event
 * id policy:key:expiry:outbox_id stays unique within the row.
 */
export function outboxInsertForRemovedSql(parameters: { policy: string; policyVersion: string }): string {
  return `, outboxed AS (
       INSERT INTO cleanup_outbox (policy, keys, observed_expiries, event_count, cutoff, run_id, batch_id, policy_version)
       SELECT ${parameters.policy}, array_agg(r.key ORDER BY r.expiry, r.key), array_agg(r.expiry ORDER BY r.expiry, r.key), count(*),
         b.cutoff, r.run_id, r.batch_id, ${parameters.policyVersion}
       FROM removed r JOIN b ON b.ord = r.ord
       GROUP BY r.ord, b.cutoff, r.run_id, r.batch_id
     )`;
}

/**
 * remote-delete, one key settled (ledger.targetSettleConfirmed): the outbox CTE writes one row of one
 * event (key, observed_expiry: the layout of migration 0019) when its `settled` CTE deleted (or
 * marked) the policy's row after the remote confirmed; run and batch id come from the ledger
 * operation (the row's canonical key makes its operation key). A held or changed row is not in
 * `settled`, so it gets none.
 */
export function outboxInsertForSettledSql(parameters: { policy: string; policyVersion: string }): string {
  return `, outboxed AS (
       INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
       SELECT ${parameters.policy}, s.key, s.expiry, NULL, l.run_id, l.claim_batch_id, ${parameters.policyVersion}
       FROM settled s LEFT JOIN ${settledOperationSql(parameters.policy)}
     )`;
}

/**
 * remote-delete, the keys of one request settled in one statement (ledger-s3.targetSettleConfirmedMany):
 * one row per (run, batch) of their ledger operations, carrying the events of its settled keys as
 * arrays (as outboxInsertForRemovedSql). A key is settled once per statement (an UPDATE or DELETE
 * changes a row once), so it is in a row at most once.
 */
export function outboxInsertForSettledManySql(parameters: { policy: string; policyVersion: string }): string {
  return `, outboxed AS (
       INSERT INTO cleanup_outbox (policy, keys, observed_expiries, event_count, cutoff, run_id, batch_id, policy_version)
       SELECT ${parameters.policy}, array_agg(s.key ORDER BY s.expiry, s.key), array_agg(s.expiry ORDER BY s.expiry, s.key), count(*),
         NULL, l.run_id, l.claim_batch_id, ${parameters.policyVersion}
       FROM settled s LEFT JOIN ${settledOperationSql(parameters.policy)}
       GROUP BY l.run_id, l.claim_batch_id
     )`;
}

/** The ledger operation of a settled key (its operation key: policy:key:observed expiry), joined as `l`. */
function settledOperationSql(policy: string): string {
  return `cleanup_ledger l ON l.operation_key = ${policy} || ':' || s.key || ':' || reaper_iso(s.expiry)`;
}

/**
 * An outbox row as the relay publishes it: the expiry events of one row (one per key: all the rows
 * one batch of a statement deleted, or one for a row of the older layout), or a retired partition's
 * event. The row is deleted only once every one of its events was confirmed.
 */
export type OutboxEntry =
  | { outboxId: string; policy: string; kind: 'expired'; events: ExpiryEventV2[] }
  | { outboxId: string; policy: string; kind: 'partition-retired'; event: PartitionRetiredEventV1 };

/** How many events (messages) an outbox entry publishes. */
export function outboxEntryEvents(entry: OutboxEntry): number {
  return entry.kind === 'expired' ? entry.events.length : 1;
}

/**
 * The outbox row of a retired partition (issue 44), in the retiring transaction: key
 * `partition:reaper_retired.<name>`, observed_expiry its upper bound, kind 'partition-retired' with
 * its row count, bound and checksum.
 */
export async function outboxInsertPartitionRetired(
  db: Db,
  event: { policy: string; partition: string; upperBound: string; runId: string | null; policyVersion: string; rowCount: number; bound: string; keyChecksum: string },
): Promise<void> {
  await db.query(
    `INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version, kind, row_count, partition_bound, key_checksum)
     VALUES ($1, 'partition:' || $2, $3, NULL, $4, NULL, $5, 'partition-retired', $6, $7, $8)`,
    [event.policy, event.partition, event.upperBound, event.runId, event.policyVersion, event.rowCount, event.bound, event.keyChecksum],
  );
}

/**
 * The relay's claim: the oldest unclaimed rows while the events of the rows before each one add up
 * to less than `eventLimit` (always at least one row, however many events it holds: a pass carries
 * at most eventLimit - 1 + the largest row's events), claimed by `owner` for `leaseMs`, in one short
 * statement (autocommit: no transaction stays open while the caller waits for the broker). Always
 * from the oldest row: a row that committed after a row with a higher id (ids are taken at insert,
 * commits land in any order) is never left behind a pass. SKIP LOCKED keeps two relays that claim at
 * the same moment apart; the lease keeps them apart afterwards. The rows are locked in the inner
 * subquery (FOR UPDATE does not go with a window function in one SELECT) and counted in the outer
 * one: at most eventLimit rows are locked (each holds at least one event), those past the limit only
 * for this statement. A claim that outlives its lease (a relay killed or stalled) is taken again by
 * any relay; the owner's own claims are taken again at once (its passes run one at a time: a claim of
 * its own seen at the start of a pass is left by a pass that failed before its delete). Rows of a
 * (policy, kind) in `skip` are left out: a routing key the relay found unroutable waits for its own
 * retry time without holding back the rows behind it.
 */
export async function outboxClaimOldest(
  db: Db,
  claim: { eventLimit: number; owner: string; leaseMs: number; skip?: ReadonlyArray<{ policy: string; kind: OutboxEntry['kind'] }> },
): Promise<OutboxEntry[]> {
  const skip = claim.skip ?? [];
  const result = await db.query<{
    outbox_id: string;
    policy: string;
    key: string | null;
    observed_expiry: string | null;
    keys: string[] | null;
    observed_expiries: string[] | null;
    cutoff: string | null;
    run_id: string | null;
    batch_id: string | null;
    deleted_at: string;
    policy_version: string;
    kind: string;
    row_count: string | null;
    partition_bound: string | null;
    key_checksum: string | null;
  }>(
    `UPDATE cleanup_outbox o SET claimed_by = $2, claim_expires_at = clock_timestamp() + $3 * interval '1 millisecond'
     FROM (
       SELECT outbox_id FROM (
         SELECT outbox_id, sum(event_count) OVER (ORDER BY outbox_id) - event_count AS events_before
         FROM (SELECT outbox_id, event_count FROM cleanup_outbox
               WHERE (claim_expires_at IS NULL OR claim_expires_at < clock_timestamp() OR claimed_by = $2)
                 AND (policy, kind) NOT IN (SELECT * FROM unnest($4::text[], $5::text[]))
               ORDER BY outbox_id LIMIT $1 FOR UPDATE SKIP LOCKED) locked
       ) counted
       WHERE events_before < $1
     ) picked
     WHERE o.outbox_id = picked.outbox_id
     RETURNING o.outbox_id::text, o.policy, o.key, reaper_iso(o.observed_expiry) AS observed_expiry,
       o.keys, ARRAY(SELECT reaper_iso(e) FROM unnest(o.observed_expiries) WITH ORDINALITY AS u(e, n) ORDER BY n) AS observed_expiries,
       reaper_iso(o.cutoff) AS cutoff, o.run_id::text, o.batch_id, reaper_iso(o.deleted_at) AS deleted_at, o.policy_version, o.kind,
       o.row_count::text, o.partition_bound, o.key_checksum`,
    [claim.eventLimit, claim.owner, claim.leaseMs, skip.map((entry) => entry.policy), skip.map((entry) => entry.kind)],
  );
  return result.rows
    .sort((a, b) => (BigInt(a.outbox_id) < BigInt(b.outbox_id) ? -1 : 1))
    .map((row): OutboxEntry => {
      if (row.kind === 'partition-retired') {
        const key = row.key ?? '';
        return {
          outboxId: row.outbox_id,
          policy: row.policy,
          kind: 'partition-retired',
          event: {
            version: 1,
            eventId: `${row.policy}:${key}:${row.outbox_id}`,
            policy: row.policy,
            partition: key.replace(/^partition:/, ''),
            bound: row.partition_bound ?? '',
            upperBound: row.observed_expiry ?? '',
            rowCount: Number(row.row_count ?? 0),
            keyChecksum: row.key_checksum ?? '',
            runId: row.run_id,
            retiredAt: row.deleted_at,
            policyVersion: row.policy_version,
          },
        };
      }
      // Either layout (migration 0031): the arrays, or the one key of a row written before them.
      const keys = row.keys ?? [row.key ?? ''];
      const expiries = row.keys ? (row.observed_expiries ?? []) : [row.observed_expiry ?? ''];
      return {
        outboxId: row.outbox_id,
        policy: row.policy,
        kind: 'expired',
        events: keys.map((key, index) => {
          const observedExpiry = expiries[index]!;
          return {
            version: 2,
            eventId: expiryEventId({ policy: row.policy, key, observedExpiry }, row.outbox_id),
            policy: row.policy,
            key,
            observedExpiry,
            cutoff: row.cutoff,
            runId: row.run_id,
            batchId: row.batch_id,
            deletedAt: row.deleted_at,
            policyVersion: row.policy_version,
          };
        }),
      };
    });
}

/**
 * Deletes rows whose events the broker confirmed, where `owner` still holds their claim (a relay
 * whose lease ran out leaves them to the relay that took them over: published twice at worst,
 * consumers dedupe on the message id). Returns how many were deleted.
 */
export async function outboxDeletePublished(db: Db, outboxIds: readonly string[], owner: string): Promise<number> {
  const result = await db.query('DELETE FROM cleanup_outbox WHERE outbox_id = ANY($1::bigint[]) AND claimed_by = $2', [outboxIds, owner]);
  return result.rowCount ?? 0;
}

/** Gives back every claim whose owner starts with `ownerPrefix` (a relay's earlier life). Returns how many. */
export async function outboxReleaseClaimsOf(db: Db, ownerPrefix: string): Promise<number> {
  const result = await db.query(
    `UPDATE cleanup_outbox SET claimed_by = NULL, claim_expires_at = NULL WHERE claimed_by IS NOT NULL AND left(claimed_by, length($1)) = $1`,
    [ownerPrefix],
  );
  return result.rowCount ?? 0;
}

/**
 * A row of several events (migration 0031) of which the broker confirmed some and refused others:
 * it keeps only the refused ones (`refused`: 1-based positions in its arrays), in one statement that
 * also gives its claim back, so the confirmed ones are not published again and the relay keeps pace
 * with a consumer that takes fewer than a row's events at a time (a queue with x-max-length and
 * reject-publish: given back whole, a row of more events than the queue's room would be refused in
 * part at every pass, for ever, and its first events duplicated each time). The outbox id, and so
 * every kept event's message id, stays the same. Only where `owner` still holds the claim.
 */
export async function outboxKeepRefused(db: Db, outboxId: string, owner: string, refused: readonly number[]): Promise<void> {
  await db.query(
    `UPDATE cleanup_outbox o SET keys = k.keys, observed_expiries = k.expiries, event_count = k.n, claimed_by = NULL, claim_expires_at = NULL
     FROM (SELECT array_agg(r.keys[i] ORDER BY i) AS keys, array_agg(r.observed_expiries[i] ORDER BY i) AS expiries, count(*)::int AS n
           FROM cleanup_outbox r, unnest($3::int[]) AS i
           WHERE r.outbox_id = $1 AND i BETWEEN 1 AND r.event_count) k
     WHERE o.outbox_id = $1 AND o.claimed_by = $2 AND o.keys IS NOT NULL AND k.n > 0`,
    [outboxId, owner, refused],
  );
}

/** Gives back claims that were not published (a refused or unconfirmed publish): taken again at the next pass. */
export async function outboxReleaseClaims(db: Db, outboxIds: readonly string[], owner: string): Promise<void> {
  await db.query('UPDATE cleanup_outbox SET claimed_by = NULL, claim_expires_at = NULL WHERE outbox_id = ANY($1::bigint[]) AND claimed_by = $2', [outboxIds, owner]);
}

/**
 * Per policy, the age in seconds of its oldest unpublished event (0 when none): one index probe
 * per policy, whatever the outbox's size (insertion order stands in for age).
 */
export async function outboxOldestAges(db: Db, policies: readonly string[]): Promise<Array<{ policy: string; oldestAgeSeconds: number }>> {
  const result = await db.query<{ policy: string; age: number | null }>(
    `SELECT p.policy, extract(epoch FROM clock_timestamp() - o.deleted_at)::float8 AS age
     FROM unnest($1::text[]) AS p(policy)
     LEFT JOIN LATERAL (SELECT deleted_at FROM cleanup_outbox WHERE policy = p.policy ORDER BY outbox_id LIMIT 1) o ON true`,
    [policies],
  );
  return result.rows.map((row) => ({ policy: row.policy, oldestAgeSeconds: Math.max(0, row.age ?? 0) }));
}

/**
 * The policy's unpublished events (the sum of its rows' event_count, migration 0031), counted up to
 * `cap`: a bounded walk of at most `cap` rows in insertion order (each holds at least one event), so
 * the worker's limit check and `reaper status` do not get slower as the outbox grows past its limit.
 */
export async function outboxCountUpTo(db: Db, policy: string, cap: number): Promise<number> {
  const result = await db.query<{ n: number }>(
    `SELECT least(coalesce(sum(event_count), 0), $2)::int AS n FROM (SELECT event_count FROM cleanup_outbox WHERE policy = $1 ORDER BY outbox_id LIMIT $2) o`,
    [policy, cap],
  );
  return result.rows[0]!.n;
}

/** Every unpublished event in the outbox, of one policy or all (a whole-table sum: tests, the bench, the checker's end-of-run count). */
export async function outboxEventCount(db: Db, policy?: string): Promise<number> {
  const result = await db.query<{ n: number }>(`SELECT coalesce(sum(event_count), 0)::int AS n FROM cleanup_outbox WHERE $1::text IS NULL OR policy = $1`, [policy ?? null]);
  return result.rows[0]!.n;
}

/** The keys of every unpublished row event in the outbox, sorted, of either layout (tests). */
export async function outboxEventKeys(db: Db): Promise<string[]> {
  const result = await db.query<{ key: string }>(
    `SELECT k AS key FROM cleanup_outbox o, unnest(coalesce(o.keys, ARRAY[o.key])) AS k WHERE o.kind = 'expired' ORDER BY k`,
  );
  return result.rows.map((row) => row.key);
}

/** Connections of `reaper relay` processes to this database now (their pool's application_name): for `reaper events status`. */
export async function outboxRelayConnections(db: Db): Promise<number> {
  const result = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-relay'`,
  );
  return result.rows[0]!.n;
}
