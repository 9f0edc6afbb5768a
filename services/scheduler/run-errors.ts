/**
 * What an error thrown while executing a run means for the run. A permanent error fails the run
 * with its reason (another attempt would fail the same way: retrying it forever blocked the
 * replica, then the next one that took the run over). A retryable one is retried with the lease
 * kept. Unknown errors are retryable: a run is never failed for an error nobody classified, and
 * a retry costs only time (the lease stays held and checked, other policies run on).
 */
export type RunErrorClass =
  | { kind: 'permanent'; reason: string }
  /** `persistent`: a fault that is permanent once it has lasted a while (see UNROUTABLE below). */
  | { kind: 'retryable'; reason: string; persistent?: 'unroutable' };

/**
 * SQLSTATE classes that no retry can fix: the policy's table, column or permission is gone or
 * wrong (42: syntax error or access rule violation, e.g. 42P01 undefined table, 42703 undefined
 * column, 42501 insufficient privilege), a value the table refuses (22: data exception), a schema
 * that is gone (3F), a feature the server lacks (0A).
 */
const PERMANENT_CLASSES = ['42', '22', '3F', '0A'];
/** Single codes outside those classes that are permanent: 2BP01 dependent objects still exist. */
const PERMANENT_CODES = new Set(['2BP01']);
/**
 * Named so a reviewer sees they were considered: the database unreachable or overloaded (08, 53,
 * 57P01-57P03), serialization and deadlock (40001, 40P01), lock or statement timeouts (55P03,
 * 57014), wrong credentials while a secret rotates (28). All retryable, like anything unlisted.
 */
const RETRYABLE_CLASSES = ['08', '53', '40', '28', '55', '57'];

/** The publisher's refusal when no queue is bound for the policy's routing key (mandatory). */
const UNROUTABLE = /^unroutable\b/;

export function classifyRunError(error: unknown): RunErrorClass {
  const err = (typeof error === 'object' && error !== null ? error : {}) as { code?: unknown; message?: unknown };
  const code = typeof err.code === 'string' ? err.code : '';
  const message = typeof err.message === 'string' ? err.message : String(error);
  const isSqlState = /^[0-9A-Z]{5}$/.test(code);
  if (isSqlState && (PERMANENT_CODES.has(code) || PERMANENT_CLASSES.some((prefix) => code.startsWith(prefix)))) {
    return { kind: 'permanent', reason: `database error ${code}: ${message}` };
  }
  if (isSqlState && RETRYABLE_CLASSES.some((prefix) => code.startsWith(prefix))) {
    return { kind: 'retryable', reason: `database error ${code}: ${message}` };
  }
  // A work queue deleted (or its binding removed) makes every publish come back unroutable. An
  // operator may be re-declaring it (the scheduler re-asserts topology on reconnect): retry for a
  // while, then fail the run (RunErrorClass 'persistent').
  if (UNROUTABLE.test(message)) return { kind: 'retryable', reason: message, persistent: 'unroutable' };
  return { kind: 'retryable', reason: code ? `${code}: ${message}` : message };
}
