import type pg from 'pg';

/**
 * A lock a test holds to stop a service at a known point (a table lock, or rows its open
 * transaction inserted), always released: release() is idempotent, and releaseHeldLocks() (in a
 * `finally` or an `after` hook) ends any lock a failing test still holds, so a failure never
 * leaves a transaction open that hangs the next step or the DROP DATABASE of the file.
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
export function holdCheckpointLock(pool: pg.Pool): Promise<HeldLock> {
  return holdTransaction(pool, (client) => client.query('LOCK TABLE cleanup_run_batches IN SHARE MODE'), 'COMMIT');
}

/**
 * Holds remote-delete deliveries of these batches in their bookkeeping, and nothing else: a row of
 * cleanup_remote_batches per batch, inserted and not committed, makes the delivery's
 * remoteBatchesKeep (INSERT ... ON CONFLICT (batch_id) DO NOTHING, the last statement of
 * recordRemoteBatch's transaction) wait for this transaction to end. Nothing else waits: the
 * admission path (the admission row, the claim, the outcome writes, the row's settle) never
 * touches that table, and the statements that do (the ledger sweeper, a finished batch's forget)
 * work on committed rows only. Rolled back on release: the deliveries then insert their own rows
 * (the ledger sweeper must never find this placeholder content).
 */
export function holdRemoteBatchKeeps(pool: pg.Pool, batches: ReadonlyArray<{ batchId: string; policy: string }>): Promise<HeldLock> {
  return holdTransaction(
    pool,
    (client) =>
      client.query(`INSERT INTO cleanup_remote_batches (batch_id, policy, content) SELECT unnest($1::text[]), unnest($2::text[]), ''::bytea`, [
        batches.map((batch) => batch.batchId),
        batches.map((batch) => batch.policy),
      ]),
    'ROLLBACK',
  );
}

/** Worker statements now waiting for a lock to keep a remote batch's message (the one holdRemoteBatchKeeps takes). */
export async function workersWaitingOnBatchKeep(pool: pg.Pool): Promise<number> {
  const result = await pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = 'reaper-worker' AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO cleanup_remote_batches%'`,
  );
  return result.rows[0]!.n;
}

/** `take` in a transaction of its own connection, kept open until release(), which ends it with `end`. */
async function holdTransaction(pool: pg.Pool, take: (client: pg.PoolClient) => Promise<unknown>, end: 'COMMIT' | 'ROLLBACK'): Promise<HeldLock> {
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
        await client.query(end);
        client.release();
      } catch (error) {
        client.release(error as Error); // a broken connection is destroyed, not returned to the pool
      }
    },
  };
  try {
    await client.query('BEGIN');
    await take(client);
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
