import type { BatchResult } from './results';

/**
 * Maps an error thrown while handling a batch to a result. Unknown errors take the safe path:
 * the outcome is unknown; settle.ts gives the batch back later through a delay tier (backing off,
 * the failures counted in x-reaper-failures) or, for an unreachable database, to the broker while
 * consumption pauses; the delivery limit ends a batch that fails every time in the dead-letter queue. Waiting for another transaction (a row
 * lock an application holds, a deadlock, a serialization conflict) is not such a failure: the
 * transaction rolled back, so the outcome is KNOWN (nothing happened), and the batch will succeed
 * once the other transaction ends. It goes to a delay tier (a new message: its delivery count
 * starts again), so no amount of waiting for a lock ever dead-letters a batch as `delivery-limit`.
 */

/** SQLSTATE classes and codes meaning "the database is not reachable right now". */
const UNAVAILABLE_CODES = new Set(['57P01', '57P02', '57P03', '53300']);
const UNAVAILABLE_CLASSES = ['08'];
/**
 * A database that refuses new connections (ALLOW_CONNECTIONS false, being dropped or created) says
 * so at connect time with the general code 55000: only that message means an outage.
 */
const NOT_ACCEPTING_CONNECTIONS = /is not currently accepting connections/i;
/** Node socket errors meaning the same. */
const UNAVAILABLE_ERRNOS = new Set(['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH']);
/** pg-pool's error when no pooled client became free in time (not a failed connect). */
const POOL_CHECKOUT_TIMEOUT = /timeout exceeded when trying to connect/i;
/**
 * Contention with other transactions, rolled back: retried from a delay tier, never counted toward
 * the delivery limit. lock_not_available (55P03, REAPER_LOCK_TIMEOUT_MS ran out) waits longer than
 * a deadlock or a serialization failure, whose other party has already been told to go on.
 */
const CONTENTION_DELAY_MS: ReadonlyMap<string, number> = new Map([
  ['55P03', 1_000],
  ['40P01', 250],
  ['40001', 250],
]);
/**
 * Errors worth retrying as they are, counted toward the delivery limit: a statement timeout
 * (57014) can repeat on every delivery (a batch the table cannot delete in time), so it must end.
 */
const TRANSIENT_CODES = new Set(['57014']);

export function classifyHandlerError(error: unknown): BatchResult {
  const err = (typeof error === 'object' && error !== null ? error : {}) as { code?: unknown; message?: unknown };
  const code = typeof err.code === 'string' ? err.code : '';
  const message = typeof err.message === 'string' ? err.message : String(error);
  const unavailable =
    UNAVAILABLE_CODES.has(code) ||
    UNAVAILABLE_CLASSES.some((prefix) => code.startsWith(prefix)) ||
    UNAVAILABLE_ERRNOS.has(code) ||
    (code === '55000' && NOT_ACCEPTING_CONNECTIONS.test(message)) ||
    /Connection terminated|connection timeout|Client has encountered a connection error/i.test(message);
  if (unavailable) return { kind: 'unknown', reason: `database unavailable: ${message}`, databaseUnavailable: true };
  if (code.startsWith('22')) {
    // Data exception: a value in the message cannot be a key of this table (e.g. not a uuid). Every
    // delivery would fail the same way.
    return { kind: 'dead-letter', reason: 'invalid-message', detail: `database refused the batch (${code}): ${message}` };
  }
  if (POOL_CHECKOUT_TIMEOUT.test(message)) {
    // Every pooled connection was busy for connectionTimeoutMillis: this process is overloaded, the
    // database is fine. Retry the batch; do not stop consuming as for an outage.
    return { kind: 'unknown', reason: `no free database connection in this process: ${message}`, databaseUnavailable: false };
  }
  const contentionDelayMs = CONTENTION_DELAY_MS.get(code);
  if (contentionDelayMs !== undefined) return { kind: 'retry', delayMs: contentionDelayMs, reason: `waited for another transaction (${code}): ${message}` };
  if (TRANSIENT_CODES.has(code)) return { kind: 'unknown', reason: `transient database error ${code}: ${message}`, databaseUnavailable: false };
  return { kind: 'unknown', reason: `unexpected error${code ? ` ${code}` : ''}: ${message}`, databaseUnavailable: false };
}
