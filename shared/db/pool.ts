import pg from 'pg';

export type Db = pg.Pool | pg.PoolClient;
export type Pool = pg.Pool;
export type Client = pg.PoolClient;

/**
 * Per-session limits. A DELETE blocked by an application's row lock, or a statement stuck behind
 * anything else, must give its connection and its message back (a lock timeout is a retry) instead
 * of holding both forever.
 */
export interface SessionTimeouts {
  statementTimeoutMs: number;
  lockTimeoutMs: number;
}
export const DEFAULT_SESSION_TIMEOUTS: SessionTimeouts = { statementTimeoutMs: 60_000, lockTimeoutMs: 5_000 };

export function makePool(
  connectionString: string,
  max: number,
  applicationName: string,
  timeouts: SessionTimeouts = DEFAULT_SESSION_TIMEOUTS,
): pg.Pool {
  const pool = new pg.Pool({
    connectionString,
    max,
    application_name: applicationName,
    connectionTimeoutMillis: 10_000,
    idleTimeoutMillis: 30_000,
    // Sent as session parameters at connect time (no extra round trip per statement).
    statement_timeout: timeouts.statementTimeoutMs,
    lock_timeout: timeouts.lockTimeoutMs,
    // A transaction left open by a bug or a frozen process must not hold locks forever either.
    idle_in_transaction_session_timeout: Math.max(timeouts.statementTimeoutMs, 60_000),
  });
  // An idle client losing its connection (server restart) must not crash the process: the pool
  // drops the client and the next query opens a fresh one.
  pool.on('error', () => undefined);
  return pool;
}

/**
 * Runs `work` in one transaction on one pooled client. Commits when it returns, rolls back when it
 * throws. `beforeCommit` runs after the work and before COMMIT (the failpoint for crash tests).
 */
export async function withTransaction<T>(
  pool: pg.Pool,
  work: (client: pg.PoolClient) => Promise<T>,
  hooks: { beforeCommit?: () => void } = {},
): Promise<T> {
  const client = await pool.connect();
  let broken = false;
  try {
    await client.query('BEGIN');
    const result = await work(client);
    hooks.beforeCommit?.();
    await client.query('COMMIT');
    return result;
  } catch (error) {
    try {
      await client.query('ROLLBACK');
    } catch {
      // The connection itself failed: hand the client back as broken so the pool discards it.
      broken = true;
    }
    throw error;
  } finally {
    client.release(broken);
  }
}

/**
 * Runs `work` in a READ ONLY transaction (always rolled back): for commands that promise to change
 * nothing, such as `reaper plan`, the database itself refuses any write.
 */
export async function withReadOnlyTransaction<T>(pool: pg.Pool, work: (client: pg.PoolClient) => Promise<T>): Promise<T> {
  const client = await pool.connect();
  let broken = false;
  try {
    await client.query('BEGIN READ ONLY');
    return await work(client);
  } finally {
    await client.query('ROLLBACK').catch(() => {
      broken = true; // the connection itself failed: the pool discards it
    });
    client.release(broken);
  }
}

/** Identifier quoting (pg's own escapeIdentifier). Only policy-validated names ever reach it. */
export function quoteIdentifier(name: string): string {
  return name
    .split('.')
    .map((part) => pg.escapeIdentifier(part))
    .join('.');
}
