import type pg from 'pg';

/**
 * A table lock a test holds to stop a service at a known point, always released: release() is
 * idempotent, and releaseHeldLocks() (in a `finally` or an `after` hook) ends any lock a failing
 * test still holds, so a failure never leaves a transaction open that hangs the next step or the
 * DROP DATABASE of the file.
 */
export interface HeldLock {
  readonly held: boolean;
  release(): Promise<void>;
}

const held = new Set<HeldLock>();

/**
 * Holds the scheduler between two windows: a SHARE lock on cleanup_run_batches makes its next
 * checkpoint (an INSERT there) wait, while reads (`reaper trigger`, the test's own queries) go on.
 */
export async function holdCheckpointLock(pool: pg.Pool): Promise<HeldLock> {
  const client = await pool.connect();
  let open = true;
  const lock: HeldLock = {
    get held() {
      return open;
    },
    async release() {
      if (!open) return;
      open = false;
      held.delete(lock);
      try {
        await client.query('COMMIT');
        client.release();
      } catch (error) {
        client.release(error as Error); // a broken connection is destroyed, not returned to the pool
      }
    },
  };
  try {
    await client.query('BEGIN');
    await client.query('LOCK TABLE cleanup_run_batches IN SHARE MODE');
  } catch (error) {
    open = false;
    client.release(error as Error);
    throw error;
  }
  held.add(lock);
  return lock;
}

/**
 * The scheduler's environment in a test that holds its checkpoints: its INSERT must still be
 * waiting when the test hands the lock over, however long the steps in between take on a loaded
 * machine. With the default REAPER_LOCK_TIMEOUT_MS (5 s) it gives up meanwhile and the hand-over
 * finds no waiter.
 */
export const SCHEDULER_HELD_CHECKPOINT_ENV: Readonly<Record<string, string>> = { REAPER_LOCK_TIMEOUT_MS: '120000' };

/**
 * Lets exactly one waiting checkpoint through and holds the next one: the next SHARE lock is
 * requested first and queues behind the scheduler's waiting INSERT (a lock request waits behind a
 * conflicting waiter), then `current` is released. The INSERT goes through, and the scheduler's
 * following checkpoint queues behind the new lock, however fast it gets there.
 */
export async function handOverCheckpointLock(pool: pg.Pool, current: HeldLock): Promise<HeldLock> {
  const next = holdCheckpointLock(pool);
  const queued = async () =>
    (
      await pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'LOCK TABLE cleanup_run_batches%'`,
      )
    ).rows[0]!.n > 0;
  const deadline = Date.now() + 10_000;
  while (!(await queued())) {
    if (Date.now() > deadline) {
      await current.release();
      await (await next).release();
      throw new Error('the next checkpoint lock never queued behind the waiting checkpoint');
    }
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  await current.release();
  return next;
}

/** Releases every lock still held (for `finally` blocks and `after` hooks). */
export async function releaseHeldLocks(): Promise<void> {
  await Promise.all([...held].map((lock) => lock.release()));
}

/** True while a scheduler's checkpoint waits on a lock (the one holdCheckpointLock takes). */
export async function schedulerWaitsOnCheckpoint(pool: pg.Pool): Promise<boolean> {
  const result = await pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = 'reaper-scheduler' AND wait_event_type = 'Lock'`,
  );
  return result.rows[0]!.n > 0;
}
