import CircuitBreaker from 'opossum';

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

/** Retry-After as delay-seconds or an HTTP date; null when absent or unreadable. */
export function parseRetryAfter(value: string | null, now = Date.now()): number | null {
  if (value === null || value.trim() === '') return null;
  const trimmed = value.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed) * 1000;
  const date = Date.parse(trimmed);
  if (Number.isNaN(date)) return null;
  return Math.max(0, date - now);
}

/** A deletion over HTTP: `DELETE <baseUrl><path>` with `Idempotency-Key`, bounded by a timeout. */
export function makeHttpRemoteClient(options: HttpRemoteOptions): RemoteCleanupClient {
  return {
    async delete(id, idempotencyKey) {
      const url = options.baseUrl.replace(/\/$/, '') + options.path.replace('{id}', encodeURIComponent(id));
      let response: Response;
      try {
        response = await fetch(url, {
          method: 'DELETE',
          headers: { ...options.headers, 'idempotency-key': idempotencyKey },
          signal: AbortSignal.timeout(options.timeoutMs),
        });
      } catch (error) {
        const cause = (error as { cause?: { code?: string } }).cause?.code;
        const name = (error as Error).name;
        return { kind: 'uncertain', reason: name === 'TimeoutError' ? `timeout after ${options.timeoutMs} ms` : `network error${cause ? ` ${cause}` : ''}: ${(error as Error).message}` };
      }
      await response.arrayBuffer().catch(() => undefined); // drain so the connection is reused; the body carries nothing we need
      return classifyStatus(response.status, response.headers.get('retry-after'));
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
  const breaker = new CircuitBreaker(
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
