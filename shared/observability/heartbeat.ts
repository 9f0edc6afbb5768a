import { randomUUID } from 'node:crypto';
import type { Logger } from 'pino';
import type { Pool } from '../db/pool';
import { heartbeatsForget, heartbeatsRecord, type Heartbeat } from '../db/queries/heartbeats';

/** How often a service refreshes its heartbeat row. */
export const HEARTBEAT_INTERVAL_MS = 5_000;
/** A worker whose row is older than this is taken as gone (three missed beats). */
export const WORKER_FRESH_SECONDS = (3 * HEARTBEAT_INTERVAL_MS) / 1000;
/** `reaper trigger`/`replay` call a scheduler "seen recently" within this many seconds. */
export const SCHEDULER_RECENT_SECONDS = 30;

export interface HeartbeatHandle {
  instanceId: string;
  /** Stops beating and deletes the row: the process is gone now, not when the row goes stale. */
  stop(): Promise<void>;
}

/**
 * Writes the first beat before resolving (a worker announces what it accepts BEFORE it consumes;
 * if that first write fails, start-up fails, as it would for any other database step), then one
 * every HEARTBEAT_INTERVAL_MS. A failed later beat is logged and retried on the next tick: a row
 * that goes stale only makes the process look older or absent, which is the safe reading.
 */
export async function startHeartbeat(pool: Pool, beat: Omit<Heartbeat, 'instanceId'>, log: Logger): Promise<HeartbeatHandle> {
  const row: Heartbeat = { ...beat, instanceId: randomUUID() };
  await heartbeatsRecord(pool, row);
  let beating: Promise<void> | null = null;
  const timer = setInterval(() => {
    if (beating) return;
    beating = heartbeatsRecord(pool, row)
      .catch((error: Error) => log.warn({ err: error.message }, 'heartbeat not recorded; next beat retries'))
      .finally(() => {
        beating = null;
      });
  }, HEARTBEAT_INTERVAL_MS);
  timer.unref();
  return {
    instanceId: row.instanceId,
    async stop() {
      clearInterval(timer);
      // A beat still on its way is an upsert: landing after the delete, it would bring the row
      // back, and a stopped worker would look connected for WORKER_FRESH_SECONDS (the scheduler
      // then holds the batch version back for an old worker that is gone).
      await beating;
      // Not deleted (database down): the row goes stale and is read as gone after WORKER_FRESH_SECONDS.
      await heartbeatsForget(pool, row.instanceId).catch((error: Error) => log.warn({ err: error.message }, 'heartbeat row not deleted at stop'));
    },
  };
}
