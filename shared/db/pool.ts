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
  /** TCP keepalive idle time (0: off). Detects a peer host or route that died without a FIN. */
  keepAliveMs?: number;
}
export const DEFAULT_SESSION_TIMEOUTS: SessionTimeouts = { statementTimeoutMs: 60_000, lockTimeoutMs: 5_000, keepAliveMs: 10_000 };

/**
 * How much longer than statement_timeout the client waits for an answer before it gives the
 * connection up. The server's statement_timeout cannot help when the link itself stalls (bytes
 * stop, the socket stays open: a hung middlebox, a frozen NAT entry): its error never arrives. TCP
 * keepalive cannot help either when something in between still acknowledges. So the client
 * bounds every query itself: a stalled link is detected within statement_timeout + this margin.
 */
export const CLIENT_TIMEOUT_MARGIN_MS = 5_000;

/** The client-side bound of one query (0: none, when statement_timeout is off). */
export function clientQueryTimeoutMs(timeouts: SessionTimeouts): number {
  return timeouts.statementTimeoutMs > 0 ? timeouts.statementTimeoutMs + CLIENT_TIMEOUT_MARGIN_MS : 0;
}

/**
 * Plans (issue 18). reaper's per-group statements are named (shared/db/queries/prepared.ts): each
 * connection parses them once. Sessions keep the server's plan_cache_mode (auto), so the admission
 * take (a primary-key UPDATE) is planned five times and then runs its generic plan. The row-delete
 * statement's transaction sets ROW_DELETE_PLAN_CACHE_MODE (SET LOCAL, in the BEGIN's own round
 * trip): auto would keep planning it for its values (the planner rates the generic plan's per-batch
 * receipt probes dearer than a custom plan's estimate), and that planning was 15% of its time;
 * its generic plan is a good one (index probes throughout; test/integration/statement-plans).
 * Before, every session forced custom plans, which cost 0.9 ms of planning per admission take.
 */
export const ROW_DELETE_PLAN_CACHE_MODE = 'force_generic_plan';

/** A connection of a 'close-idle' pool unused for this long is closed. */
export const IDLE_TIMEOUT_MS = 30_000;

/**
 * How a pool treats connections it no longer uses:
 * - 'close-idle' (the CLI, short-lived tools): a connection idle for IDLE_TIMEOUT_MS is closed.
 * - 'keep' (the long-running services): every connection the pool opened stays open (pg-pool's
 *   `min` = `max`), and warmPool opens them at start. A policy that runs every few minutes would
 *   otherwise start each run on new backends, whose first statements load the catalog caches and
 *   parse at 7-38 ms each on the database's core (issue 18's statement log of a run start), in the
 *   very seconds the run's scan and first deletions compete with the application. The connection
 *   budget already counts REAPER_DB_POOL_SIZE per process (README, Autoscaling); a connection
 *   that fails is dropped by the pool and opened again when needed.
 */
export type IdleConnections = 'close-idle' | 'keep';

export function makePool(
  connectionString: string,
  max: number,
  applicationName: string,
  timeouts: SessionTimeouts = DEFAULT_SESSION_TIMEOUTS,
  idle: IdleConnections = 'close-idle',
  /** Tests only: a shorter idle timeout, to see a 'close-idle' pool close and a 'keep' one not. */
  idleTimeoutMs = IDLE_TIMEOUT_MS,
): pg.Pool {
  const pool = new pg.Pool({
    connectionString,
    max,
    ...(idle === 'keep' ? { min: max } : {}),
    application_name: applicationName,
    connectionTimeoutMillis: 10_000,
    idleTimeoutMillis: idleTimeoutMs,
    // Sent as session parameters at connect time (no extra round trip per statement).
    statement_timeout: timeouts.statementTimeoutMs,
    lock_timeout: timeouts.lockTimeoutMs,
    // A transaction left open by a bug or a frozen process must not hold locks forever either.
    idle_in_transaction_session_timeout: Math.max(timeouts.statementTimeoutMs, 60_000),
    // A stalled link: see CLIENT_TIMEOUT_MARGIN_MS. A query that times out here leaves its client
    // unusable; withTransaction's ROLLBACK then fails and the client is discarded, and pool.query
    // releases a failed client as broken, so the next query opens a fresh connection.
    ...(clientQueryTimeoutMs(timeouts) > 0 ? { query_timeout: clientQueryTimeoutMs(timeouts) } : {}),
    keepAlive: (timeouts.keepAliveMs ?? 10_000) > 0,
    ...((timeouts.keepAliveMs ?? 10_000) > 0 ? { keepAliveInitialDelayMillis: timeouts.keepAliveMs ?? 10_000 } : {}),
  });
  // An idle client losing its connection (server restart) must not crash the process: the pool
  // drops the client and the next query opens a fresh one.
  pool.on('error', () => undefined);
  // A checked-out client whose connection dies between two queries (server restarted, backend
  // terminated, link reset while a transaction is open) emits 'error' with nobody listening, and
  // Node ends the process (the chaos run found workers exiting 1 this way). Its next query fails
  // instead ("Client has encountered a connection error", classified as the database being
  // unavailable) and the client is released as broken.
  pool.on('connect', (client) => client.on('error', () => undefined));
  return pool;
}

/**
 * Opens every connection of a 'keep' pool at start (one trivial statement each, so each backend
 * has started and authenticated) and hands them back idle. Best effort: a connection that cannot
 * be opened now is opened later, when a statement needs it. Returns how many were opened.
 */
export async function warmPool(pool: pg.Pool): Promise<number> {
  const opened = await Promise.allSettled(Array.from({ length: pool.options.max }, () => pool.connect()));
  const clients = opened.flatMap((result) => (result.status === 'fulfilled' ? [result.value] : []));
  const answered = await Promise.all(
    clients.map((client) =>
      client.query('SELECT 1').then(
        () => (client.release(), true),
        () => (client.release(true), false), // a connection that failed is discarded, not kept
      ),
    ),
  );
  return answered.filter(Boolean).length;
}

/**
 * Runs `work` in one transaction on one pooled client. Commits when it returns, rolls back when it
 * throws. `beforeCommit` runs after the work and before COMMIT (the failpoint for crash tests);
 * `planCacheMode` holds for this transaction only.
 */
export async function withTransaction<T>(
  pool: pg.Pool,
  work: (client: pg.PoolClient) => Promise<T>,
  hooks: { beforeCommit?: () => void; planCacheMode?: typeof ROW_DELETE_PLAN_CACHE_MODE } = {},
): Promise<T> {
  const client = await pool.connect();
  let broken = false;
  try {
    return await transactionOn(client, work, { ...hooks, onBroken: () => (broken = true) });
  } finally {
    client.release(broken);
  }
}

/**
 * One transaction on a client the caller holds (withTransaction's, or a connection kept for its
 * session advisory lock: partition retirement). `onBroken`: the connection cannot be used again
 * (the caller discards it).
 */
export async function transactionOn<T, C extends pg.ClientBase>(
  client: C,
  work: (client: C) => Promise<T>,
  hooks: { beforeCommit?: () => void; planCacheMode?: typeof ROW_DELETE_PLAN_CACHE_MODE; onBroken?: () => void } = {},
): Promise<T> {
  try {
    // One simple-protocol message either way: the SET LOCAL costs no extra round trip.
    await client.query(hooks.planCacheMode ? `BEGIN; SET LOCAL plan_cache_mode = ${hooks.planCacheMode}` : 'BEGIN');
    const result = await work(client);
    hooks.beforeCommit?.();
    await client.query('COMMIT');
    return result;
  } catch (error) {
    if (connectionLost(error)) {
      // The link itself is gone or stalled: a ROLLBACK on it would wait out the client's query
      // bound a second time. The server rolls back when the connection closes; discard the client.
      hooks.onBroken?.();
      throw error;
    }
    try {
      await client.query('ROLLBACK');
    } catch {
      // The connection itself failed: hand the client back as broken so the pool discards it.
      hooks.onBroken?.();
    }
    throw error;
  }
}

/** Errors after which this client's connection cannot be used again (pg's own messages). */
function connectionLost(error: unknown): boolean {
  const message = error instanceof Error ? error.message : '';
  return /Query read timeout|Connection terminated|connection error|not queryable/i.test(message);
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
