import http from 'node:http';
import https from 'node:https';
import type CircuitBreaker from 'opossum';
import { circuitBreakerClass } from '../lazy-modules';
import type { Logger } from 'pino';

/**
 * The remote side of remote-delete: an interface (so the handler does not care how a deletion is
 * made) and an HTTP adapter. Classification is docs/design.md's, exactly: 2xx/404/410 confirmed, 429
 * rate limited (Retry-After), 408/5xx/timeouts/network errors uncertain, other 4xx rejected.
 */
export type RemoteOutcome =
  | { kind: 'confirmed'; status: number }
  | { kind: 'rate-limited'; retryAfterMs: number | null; status: 429 }
  | { kind: 'uncertain'; reason: string }
  | { kind: 'rejected'; status: number; reason: string }
  /** The circuit breaker is open: no call was made. */
  | { kind: 'circuit-open'; retryInMs: number };

export interface RemoteCleanupClient {
  delete(id: string, idempotencyKey: string): Promise<RemoteOutcome>;
}

export interface HttpRemoteOptions {
  baseUrl: string;
  path: string; // contains {id}
  timeoutMs: number;
  headers: Readonly<Record<string, string>>;
}

export function classifyStatus(status: number, retryAfter: string | null, now = Date.now()): RemoteOutcome {
  if ((status >= 200 && status < 300) || status === 404 || status === 410) return { kind: 'confirmed', status };
  if (status === 429) return { kind: 'rate-limited', retryAfterMs: parseRetryAfter(retryAfter, now), status: 429 };
  if (status === 408 || status >= 500) return { kind: 'uncertain', reason: `HTTP ${status}` };
  return { kind: 'rejected', status, reason: `HTTP ${status}` };
}

/**
 * The longest Retry-After honoured. A 429 blocks the whole policy for its Retry-After, so a remote
 * that answers "a year" (or a value too large for PostgreSQL's interval) would stop the policy for
 * that long; longer values are cut to this, and the client logs the original.
 */
export const MAX_RETRY_AFTER_MS = 60 * 60 * 1000;

/** Retry-After as delay-seconds or an HTTP date, uncapped (Infinity when too large to be a number); null when absent or unreadable. */
function readRetryAfter(value: string | null, now: number): number | null {
  if (value === null || value.trim() === '') return null;
  const trimmed = value.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed) * 1000;
  const date = Date.parse(trimmed);
  if (Number.isNaN(date)) return null;
  return Math.max(0, date - now);
}

/** Retry-After in milliseconds, at most MAX_RETRY_AFTER_MS; null when absent or unreadable. */
export function parseRetryAfter(value: string | null, now = Date.now()): number | null {
  const delayMs = readRetryAfter(value, now);
  return delayMs === null ? null : Math.min(delayMs, MAX_RETRY_AFTER_MS);
}

/** True when the header asks for longer than MAX_RETRY_AFTER_MS (and was therefore cut). */
export function retryAfterWasCapped(value: string | null, now = Date.now()): boolean {
  const delayMs = readRetryAfter(value, now);
  return delayMs !== null && delayMs > MAX_RETRY_AFTER_MS;
}

const HEX = Array.from({ length: 256 }, (_, byte) => `%${byte.toString(16).toUpperCase().padStart(2, '0')}`);

/** Percent-encodes the UTF-8 bytes of `value` except those `keep` accepts. Total: never throws (a lone surrogate becomes U+FFFD, as PostgreSQL would have stored it). */
function percentEncode(value: string, keep: (byte: number) => boolean): string {
  let encoded = '';
  for (const byte of Buffer.from(value, 'utf8')) encoded += keep(byte) ? String.fromCharCode(byte) : HEX[byte]!;
  return encoded;
}

const isAlphaNumeric = (byte: number): boolean => (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x5a) || (byte >= 0x61 && byte <= 0x7a);

/**
 * An id as exactly one RFC 3986 path segment: every byte is percent-encoded except ALPHA, DIGIT,
 * '-', '_' and '~'. Unlike encodeURIComponent this also encodes '.', so the ids '.' and '..' are
 * '%2E' and '%2E%2E', never dot segments, and the sub-delims it leaves alone (!'()*), which some
 * servers and proxies treat specially. The request is sent with this target verbatim (no URL
 * parser in between: the WHATWG parser used by fetch() collapses '%2E%2E' to the parent too).
 */
export function encodePathSegment(id: string): string {
  return percentEncode(id, (byte) => isAlphaNumeric(byte) || byte === 0x2d || byte === 0x5f || byte === 0x7e);
}

/**
 * The Idempotency-Key header value for an operation key: every byte outside visible ASCII
 * (0x21-0x7E), and '%' itself, is percent-encoded (UTF-8, upper-case hex); everything else is
 * sent as is. A key made only of visible ASCII without '%' is sent unchanged; any other key is
 * still a valid header value (a raw '€' made fetch() throw). Decoding it is exactly
 * decodeURIComponent.
 */
export function encodeIdempotencyKey(operationKey: string): string {
  return percentEncode(operationKey, (byte) => byte >= 0x21 && byte <= 0x7e && byte !== 0x25);
}

/** How long an idle keep-alive connection to the remote is kept. */
const FREE_SOCKET_IDLE_MS = 4_000;

/** Bytes allowed in a request target as we send it (visible ASCII); anything else in remote.path is a configuration error. */
const REQUEST_TARGET = /^[\x21-\x7e]+$/;

/** Thrown from the request when the call's timeout fires; mapped to an uncertain outcome. */
class CallTimeout extends Error {
  constructor(timeoutMs: number) {
    super(`timeout after ${timeoutMs} ms`);
  }
}

/**
 * A deletion over HTTP: `DELETE <baseUrl><path with {id}>` with `Idempotency-Key`, bounded by a
 * timeout that covers the whole exchange. Sent with node:http and the request target built here,
 * byte for byte (see encodePathSegment). Never throws: every failure is an outcome.
 */
export function makeHttpRemoteClient(options: HttpRemoteOptions, log?: Logger): RemoteCleanupClient {
  const base = new URL(options.baseUrl);
  const transport = base.protocol === 'https:' ? https : http;
  // Idle connections are reused, and closed after FREE_SOCKET_IDLE_MS (or a second before the
  // server's own Keep-Alive timeout, if it announces a shorter one). Without an agent timeout
  // node:http ignores that hint, and a DELETE sent on a connection the server is closing at that
  // moment fails with ECONNRESET: an uncertain call for nothing.
  const agent = new transport.Agent({ keepAlive: true, timeout: FREE_SOCKET_IDLE_MS });
  const prefix = base.pathname.replace(/\/$/, '');
  const hostname = base.hostname.replace(/^\[(.*)\]$/, '$1'); // IPv6 literals come bracketed
  const port = base.port === '' ? undefined : Number(base.port);
  if (!REQUEST_TARGET.test(prefix + options.path.replaceAll('{id}', 'x'))) {
    throw new Error(`remote.path ${JSON.stringify(options.path)}: only visible ASCII is allowed outside {id} (percent-encode the rest)`);
  }

  function send(target: string, idempotencyKey: string): Promise<{ status: number; retryAfter: string | null }> {
    return new Promise((resolve, reject) => {
      let answered: { status: number; retryAfter: string | null } | null = null;
      const request = transport.request({
        agent,
        hostname,
        port,
        method: 'DELETE',
        path: target,
        headers: { ...options.headers, 'idempotency-key': idempotencyKey },
      });
      const timer = setTimeout(() => request.destroy(new CallTimeout(options.timeoutMs)), options.timeoutMs);
      const done = (): void => {
        clearTimeout(timer);
        if (answered) resolve(answered);
      };
      request.on('response', (response) => {
        const header = response.headers['retry-after'];
        answered = { status: response.statusCode ?? 0, retryAfter: header ?? null };
        // Drain so the connection is reused; the body carries nothing we need. The status is the
        // answer even if the body then breaks off.
        response.resume();
        response.on('end', done);
        response.on('close', done);
        response.on('error', done);
      });
      request.on('error', (error) => {
        clearTimeout(timer);
        if (answered) resolve(answered);
        else reject(error);
      });
      request.end();
    });
  }

  return {
    async delete(id, idempotencyKey) {
      const target = prefix + options.path.replaceAll('{id}', encodePathSegment(id));
      let answer: { status: number; retryAfter: string | null };
      try {
        answer = await send(target, encodeIdempotencyKey(idempotencyKey));
      } catch (error) {
        if (error instanceof CallTimeout) return { kind: 'uncertain', reason: error.message };
        const code = (error as { code?: string }).code;
        return { kind: 'uncertain', reason: `network error${code ? ` ${code}` : ''}: ${(error as Error).message}` };
      }
      const now = Date.now();
      if (answer.status === 429 && retryAfterWasCapped(answer.retryAfter, now)) {
        log?.warn({ retryAfter: answer.retryAfter, cappedToMs: MAX_RETRY_AFTER_MS, id }, 'Retry-After longer than the cap; capped');
      }
      return classifyStatus(answer.status, answer.retryAfter, now);
    },
  };
}

/** Thrown inside the breaker for uncertain outcomes, so they count as failures. */
class UncertainOutcome extends Error {
  constructor(readonly outcome: RemoteOutcome) {
    super('uncertain');
  }
}

export interface BreakerOptions {
  /** Failure percentage over the rolling window that opens the circuit. */
  errorThresholdPercentage: number;
  /** Calls in the window before the percentage counts. */
  volumeThreshold: number;
  /** How long the circuit stays open before one trial call. */
  resetTimeoutMs: number;
}

export const DEFAULT_BREAKER: BreakerOptions = { errorThresholdPercentage: 50, volumeThreshold: 10, resetTimeoutMs: 10_000 };

/**
 * Wraps a client in an opossum circuit breaker: when most recent calls were uncertain (the remote
 * is down), calls stop for a while. An open circuit returns 'circuit-open' (work is rescheduled,
 * never failed). Rate limits and rejections are answers, not failures, and do not trip it.
 */
export function withCircuitBreaker(client: RemoteCleanupClient, options: BreakerOptions = DEFAULT_BREAKER): RemoteCleanupClient & { breaker: CircuitBreaker } {
  const breaker = new (circuitBreakerClass())(
    async (id: string, key: string) => {
      const outcome = await client.delete(id, key);
      if (outcome.kind === 'uncertain') throw new UncertainOutcome(outcome);
      return outcome;
    },
    {
      timeout: false, // the client has its own timeout
      errorThresholdPercentage: options.errorThresholdPercentage,
      volumeThreshold: options.volumeThreshold,
      resetTimeout: options.resetTimeoutMs,
      rollingCountTimeout: 10_000,
    },
  );
  return {
    breaker,
    async delete(id, key) {
      try {
        return (await breaker.fire(id, key)) as RemoteOutcome;
      } catch (error) {
        if (error instanceof UncertainOutcome) return error.outcome;
        if ((error as { code?: string }).code === 'EOPENBREAKER') return { kind: 'circuit-open', retryInMs: options.resetTimeoutMs };
        return { kind: 'uncertain', reason: (error as Error).message };
      }
    },
  };
}
