import type { Db } from '../pool';

/** Services that record a heartbeat (migration 0013). */
export type HeartbeatService = 'scheduler' | 'worker';

export interface Heartbeat {
  instanceId: string;
  service: HeartbeatService;
  workerId: string;
  amqpPrefix: string;
  policies: readonly string[];
  /** Workers: the newest batch version they accept. Null for schedulers. */
  maxBatchVersion: number | null;
}

/** Rows not refreshed for this long are deleted by the next heartbeat of anyone (crashed processes). */
const FORGET_AFTER_SECONDS = 86_400;

/**
 * Records that a process is alive: inserts its row or refreshes `seen_at`; rows of processes gone
 * for a day are dropped in the same statement, so the table stays the size of the fleet.
 */
export async function heartbeatsRecord(db: Db, beat: Heartbeat): Promise<void> {
  await db.query(
    `WITH forgotten AS (
       DELETE FROM service_heartbeats WHERE seen_at < clock_timestamp() - $7 * interval '1 second' AND instance_id <> $1)
     INSERT INTO service_heartbeats (instance_id, service, worker_id, amqp_prefix, policies, max_batch_version)
     VALUES ($1, $2, $3, $4, $5::text[], $6)
     ON CONFLICT (instance_id) DO UPDATE SET seen_at = clock_timestamp(), policies = EXCLUDED.policies,
       max_batch_version = EXCLUDED.max_batch_version`,
    [beat.instanceId, beat.service, beat.workerId, beat.amqpPrefix, beat.policies, beat.maxBatchVersion, FORGET_AFTER_SECONDS],
  );
}

/** A clean stop: the process is gone now, not when its row goes stale. */
export async function heartbeatsForget(db: Db, instanceId: string): Promise<void> {
  await db.query('DELETE FROM service_heartbeats WHERE instance_id = $1', [instanceId]);
}

/** The latest heartbeat of a scheduler that has `policy` (any prefix: the database is the deployment's). */
export async function heartbeatsLatestScheduler(db: Db, policy: string): Promise<{ seenAt: string; ageSeconds: number; workerId: string } | null> {
  const result = await db.query<{ seen_at: string; age_seconds: number; worker_id: string }>(
    `SELECT reaper_iso(seen_at) AS seen_at, extract(epoch FROM clock_timestamp() - seen_at)::float8 AS age_seconds, worker_id
     FROM service_heartbeats WHERE service = 'scheduler' AND $1 = ANY(policies) ORDER BY seen_at DESC LIMIT 1`,
    [policy],
  );
  const row = result.rows[0];
  return row ? { seenAt: row.seen_at, ageSeconds: Number(row.age_seconds), workerId: row.worker_id } : null;
}

/**
 * Workers seen within `freshSeconds` that consume `policy` under `amqpPrefix`, with what they
 * accept and their instance id (the identity the batch-version gate looks for on the broker: a
 * fresh row alone may be a worker killed a moment ago).
 */
export async function heartbeatsLiveWorkers(
  db: Db,
  filter: { policy: string; amqpPrefix: string; freshSeconds: number },
): Promise<Array<{ instanceId: string; workerId: string; maxBatchVersion: number }>> {
  const result = await db.query<{ instance_id: string; worker_id: string; max_batch_version: number }>(
    `SELECT instance_id::text AS instance_id, worker_id, coalesce(max_batch_version, 1) AS max_batch_version FROM service_heartbeats
     WHERE service = 'worker' AND amqp_prefix = $2 AND $1 = ANY(policies)
       AND seen_at >= clock_timestamp() - $3 * interval '1 second'
     ORDER BY worker_id`,
    [filter.policy, filter.amqpPrefix, filter.freshSeconds],
  );
  return result.rows.map((row) => ({ instanceId: row.instance_id, workerId: row.worker_id, maxBatchVersion: row.max_batch_version }));
}
