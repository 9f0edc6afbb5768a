import type { BatchResult } from './results';

/**
 * Maps an error thrown while handling a batch to a result. Unknown errors take the safe path:
 * the outcome is unknown, nothing is acked, the broker redelivers (and its delivery limit ends a
 * batch that fails every time in the dead-letter queue).
 */

/** SQLSTATE classes and codes meaning "the database is not reachable right now". */
const UNAVAILABLE_CODES = new Set(['57P01', '57P02', '57P03', '53300']);
const UNAVAILABLE_CLASSES = ['08'];
/** Node socket errors meaning the same. */
const UNAVAILABLE_ERRNOS = new Set(['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH']);
/** pg-pool's error when no pooled client became free in time (not a failed connect). */
const POOL_CHECKOUT_TIMEOUT = /timeout exceeded when trying to connect/i;
/** Errors worth retrying as they are (the batch is fine; another attempt can succeed). */
const TRANSIENT_CODES = new Set(['40001', '40P01', '55P03', '57014']);

export function classifyHandlerError(error: unknown): BatchResult {
  const err = (typeof error === 'object' && error !== null ? error : {}) as { code?: unknown; message?: unknown };
  const code = typeof err.code === 'string' ? err.code : '';
  const message = typeof err.message === 'string' ? err.message : String(error);
  const unavailable =
    UNAVAILABLE_CODES.has(code) ||
    UNAVAILABLE_CLASSES.some((prefix) => code.startsWith(prefix)) ||
    UNAVAILABLE_ERRNOS.has(code) ||
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
  if (TRANSIENT_CODES.has(code)) return { kind: 'unknown', reason: `transient database error ${code}: ${message}`, databaseUnavailable: false };
  return { kind: 'unknown', reason: `unexpected error${code ? ` ${code}` : ''}: ${message}`, databaseUnavailable: false };
}
