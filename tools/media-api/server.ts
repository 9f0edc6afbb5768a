/**
 * A stand-in "media API": the remote system whose assets reaper deletes.
 *
 * It is used by tests, the demo and the benchmark. It implements exactly one
 * real endpoint, `DELETE /assets/:id`, with the properties a remote-delete
 * client has to cope with (idempotency keys, rate limiting, slow answers,
 * transient failures, ambiguous outcomes, connection resets, permanent
 * rejections), and it records every call so callers can check what the
 * client actually did to it: how often each key really deleted something,
 * how many requests were in flight at once, how many calls arrived in any
 * one-second window.
 *
 * Only Node built-ins are used.
 *
 * Design note: the outcome of a call is decided synchronously when its
 * request arrives (token taken, delete executed, key remembered); `slowMs`
 * only delays the answer. Decisions therefore follow arrival order exactly,
 * and a client that gives up during the delay sees a realistic ambiguous
 * outcome: the delete may already have happened.
 */
import { once } from 'node:events';
import { createServer, type IncomingMessage, type OutgoingHttpHeaders, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { performance } from 'node:perf_hooks';

export interface MediaApiOptions {
  /** 0 (default) = ephemeral port; the server always binds 127.0.0.1. */
  port?: number;
  /** Token bucket refill rate; undefined = no limit. */
  ratePerSecond?: number;
  /** Bucket capacity (default = ratePerSecond, at least 1). */
  burst?: number;
  /** Value of Retry-After on a token-bucket 429 (default 1). */
  retryAfterSeconds?: number;
  /**
   * The clock the forced throttle reads (epoch ms; default Date.now): a test that checks the
   * Retry-After arithmetic fixes it, so the answer does not depend on how long the call took.
   */
  clock?: () => number;
}

export interface MediaApiCall {
  /** 1-based, in arrival order. */
  seq: number;
  /** Asset id, percent-decoded from the one path segment exactly as sent. */
  id: string;
  /** Idempotency-Key header, percent-decoded; null when missing (or not valid percent-encoding). */
  key: string | null;
  /** Epoch ms when the request arrived. */
  startedAt: number;
  /** Epoch ms when the answer was sent (or the socket destroyed / closed by the client); 0 while in progress. */
  finishedAt: number;
  /** HTTP status decided for the call, or 'reset' when the socket was destroyed without an answer. */
  status: number | 'reset';
  /** True when this call actually deleted the asset (a 200 execution, or an executeThenFail one). */
  executed: boolean;
  /** The Retry-After header sent with a 429, exactly as sent (seconds); null otherwise. */
  retryAfterSeconds: number | null;
}

export interface MediaApi {
  /** e.g. http://127.0.0.1:12345 */
  url: string;
  /** Every request to DELETE /assets/:id, in arrival order. */
  calls: MediaApiCall[];
  /** How many times each Idempotency-Key actually deleted something (should be 1). */
  executionsByKey(): Map<string, number>;
  /** Ids currently deleted (a copy). */
  deletedIds(): Set<string>;
  /** The asset exists again: a later DELETE with a NEW key deletes it again. */
  restore(id: string): void;
  /** Most requests in progress at once (from request arrival to the answer). */
  maxConcurrent(): number;
  /** Most calls (any status) whose startedAt falls in any sliding window [t, t + windowMs) (default 1000). */
  maxCallsInWindow(windowMs?: number): number;
  /**
   * Answers the calls held by `hold` (those `which` accepts; default all), in arrival order, and
   * returns how many were answered. Calls whose client already gave up are not answered.
   */
  release(which?: (call: MediaApiCall) => boolean): number;
  /** Calls decided and waiting for release() (hold). */
  heldCalls(): MediaApiCall[];
  /** Change behaviour at run time. Passing `ratePerSecond: undefined` explicitly removes the rate limit. */
  configure(patch: Partial<MediaApiBehaviour>): void;
  /** Stops the server, dropping any request still in progress. */
  close(): Promise<void>;
}

export interface MediaApiBehaviour {
  /** Delay before answering each call (default 0). */
  slowMs: number;
  /** Epoch ms: until then EVERY call gets 429 + Retry-After (forced rate limiting). */
  throttleUntil: number;
  /**
   * A throttle window of this many ms that starts at the NEXT call to arrive (then throttleUntil
   * is set from it and this goes back to 0): the window covers the first calls however long the
   * client takes to send them.
   */
  throttleForMs: number;
  /**
   * Decide each call when it arrives (as always: executed, key remembered) but do not answer it
   * until release(): the call stays "in progress" for exactly as long as the test wants, instead
   * of for a slowMs that a slow machine may overrun.
   */
  hold: boolean;
  /**
   * Next N calls get 429 with exactly `throttleRetryAfterSeconds` as Retry-After, not executed: a
   * throttle counted in calls, not in wall-clock time, so a test does not depend on how fast the
   * machine gets its calls out (and no rounding of a remaining time is involved).
   */
  throttleNext: number;
  /** Retry-After (seconds) sent by throttleNext (default 1). */
  throttleRetryAfterSeconds: number;
  /** Next N calls answer failStatus WITHOUT executing. */
  failNext: number;
  /** Status used by failNext (default 503). */
  failStatus: number;
  /** Next N calls that reach execution execute the delete, then answer 500 (ambiguous outcome). */
  executeThenFailNext: number;
  /** Next N calls: destroy the socket without answering, without executing. */
  resetNext: number;
  /** DELETE of these ids answers 403 (permanent rejection), not executed. */
  rejectIds: Set<string>;
  ratePerSecond?: number;
  burst?: number;
}

/** JSON-serialisable body. */
type Json = string | number | boolean | null | Json[] | { [key: string]: Json };

/** What the server will do with a call, decided when it arrives. */
type Outcome =
  | { kind: 'reply'; status: number; body: Json; headers?: OutgoingHttpHeaders; executed: boolean; immediate?: boolean }
  | { kind: 'reset' };

/** The remembered first execution of an idempotency key. */
interface KeyRecord {
  status: number;
  body: Json;
}

/**
 * A token bucket that starts full and refills continuously at `rate` tokens
 * per second up to `capacity`. Uses the monotonic clock.
 */
class TokenBucket {
  private tokens: number;
  private last: number;

  constructor(
    private rate: number,
    private capacity: number,
  ) {
    this.tokens = capacity;
    this.last = performance.now();
  }

  /** Takes one token if available. */
  tryTake(): boolean {
    this.refill();
    if (this.tokens >= 1) {
      this.tokens -= 1;
      return true;
    }
    return false;
  }

  /** Changes rate and capacity, keeping the tokens already accrued (capped at the new capacity). */
  reconfigure(rate: number, capacity: number): void {
    this.refill();
    this.rate = rate;
    this.capacity = capacity;
    this.tokens = Math.min(this.tokens, capacity);
  }

  private refill(): void {
    const now = performance.now();
    this.tokens = Math.min(this.capacity, this.tokens + ((now - this.last) / 1000) * this.rate);
    this.last = now;
  }
}

/**
 * Largest number of `times` falling in any half-open window [t, t + windowMs).
 * Exported for tests; `MediaApi.maxCallsInWindow` applies it to the calls' startedAt.
 */
export function maxInSlidingWindow(times: readonly number[], windowMs: number): number {
  if (!(windowMs > 0) || !Number.isFinite(windowMs)) {
    throw new RangeError(`windowMs must be a positive finite number, got ${windowMs}`);
  }
  const sorted = [...times].sort((a, b) => a - b);
  let best = 0;
  let lo = 0;
  for (let hi = 0; hi < sorted.length; hi++) {
    while (sorted[hi]! - sorted[lo]! >= windowMs) lo++;
    best = Math.max(best, hi - lo + 1);
  }
  return best;
}

function checkRate(ratePerSecond: number | undefined, burst: number | undefined): void {
  if (ratePerSecond !== undefined && !(ratePerSecond >= 0 && Number.isFinite(ratePerSecond))) {
    throw new RangeError(`ratePerSecond must be a finite number >= 0, got ${ratePerSecond}`);
  }
  if (burst !== undefined && !(burst >= 1 && Number.isFinite(burst))) {
    throw new RangeError(`burst must be a finite number >= 1, got ${burst}`);
  }
}

/** Bucket capacity: the explicit burst, else ratePerSecond, at least 1. */
function capacityOf(ratePerSecond: number, burst: number | undefined): number {
  return burst ?? Math.max(1, ratePerSecond);
}

/**
 * The asset id of a request target `/assets/<segment>[?query]`, decoded exactly: the target is read
 * as sent on the request line, never through a URL parser (WHATWG URL turns `/assets/%2E%2E` into
 * `/`), and the one segment is percent-decoded, so `%2E%2E` is the id `..`, `a%2Fb` is `a/b` and
 * `%252F` is `%2F`. Anything else is no asset route (null). A literal `.` or `..` segment is a dot
 * segment, which a client must never send for an id: `'dot-segment'` (answered 400, so such a bug
 * cannot pass for "already deleted").
 */
function matchAssetId(target: string): string | null | 'dot-segment' {
  const m = /^\/assets\/([^/?#]+)(?:\?.*)?$/.exec(target);
  if (m === null) return null;
  if (m[1] === '.' || m[1] === '..') return 'dot-segment';
  try {
    return decodeURIComponent(m[1]!);
  } catch {
    return null;
  }
}

/**
 * The Idempotency-Key header, decoded as reaper sends it (README "Remote API calls"): bytes outside
 * visible ASCII, and '%', travel percent-encoded. Null when missing; 'invalid' when the
 * percent-encoding is broken.
 */
function idempotencyKey(req: IncomingMessage): string | null | { invalid: string } {
  const raw = req.headers['idempotency-key'];
  const value = Array.isArray(raw) ? raw[0] : raw;
  if (value === undefined || value === '') return null;
  try {
    return decodeURIComponent(value);
  } catch {
    return { invalid: value };
  }
}

function sendJson(res: ServerResponse, status: number, body: Json, headers: OutgoingHttpHeaders = {}): void {
  const payload = JSON.stringify(body);
  res.writeHead(status, {
    ...headers,
    'Content-Type': 'application/json',
    'Content-Length': Buffer.byteLength(payload),
  });
  res.end(payload);
}

export async function startMediaApi(options: MediaApiOptions = {}): Promise<MediaApi> {
  checkRate(options.ratePerSecond, options.burst);
  const retryAfterSeconds = options.retryAfterSeconds ?? 1;
  const clock = options.clock ?? Date.now;
  /** Answers waiting for release() (hold), with their calls. */
  const held: Array<{ call: MediaApiCall; answer: () => void }> = [];

  const behaviour: MediaApiBehaviour = {
    slowMs: 0,
    throttleUntil: 0,
    throttleForMs: 0,
    hold: false,
    throttleNext: 0,
    throttleRetryAfterSeconds: 1,
    failNext: 0,
    failStatus: 503,
    executeThenFailNext: 0,
    resetNext: 0,
    rejectIds: new Set<string>(),
    ratePerSecond: options.ratePerSecond,
    burst: options.burst,
  };
  let bucket: TokenBucket | null =
    options.ratePerSecond === undefined
      ? null
      : new TokenBucket(options.ratePerSecond, capacityOf(options.ratePerSecond, options.burst));

  // ---- recorded state ----
  const calls: MediaApiCall[] = [];
  const deleted = new Set<string>();
  const keys = new Map<string, KeyRecord>(); // remembered forever
  const executions = new Map<string, number>();
  let seq = 0;
  let inFlight = 0;
  let peakInFlight = 0;
  const pendingTimers = new Set<NodeJS.Timeout>();

  /** Applies the checks in order and, if they all pass, executes the delete. */
  function decide(id: string, key: string | null | { invalid: string }): Outcome {
    if (key === null) {
      return { kind: 'reply', status: 400, body: { error: 'missing Idempotency-Key header' }, executed: false, immediate: true };
    }
    if (typeof key !== 'string') {
      return { kind: 'reply', status: 400, body: { error: 'Idempotency-Key is not valid percent-encoding', key: key.invalid }, executed: false, immediate: true };
    }

    // 1. Forced throttle: Retry-After = whole seconds until it ends.
    const now = clock();
    if (behaviour.throttleForMs > 0) {
      behaviour.throttleUntil = now + behaviour.throttleForMs;
      behaviour.throttleForMs = 0;
    }
    if (behaviour.throttleUntil > now) {
      const retryAfter = Math.ceil((behaviour.throttleUntil - now) / 1000);
      return { kind: 'reply', status: 429, body: { error: 'throttled' }, headers: { 'Retry-After': String(retryAfter) }, executed: false };
    }

    // 1b. Forced throttle by count: the explicit Retry-After.
    if (behaviour.throttleNext > 0) {
      behaviour.throttleNext--;
      return {
        kind: 'reply',
        status: 429,
        body: { error: 'throttled' },
        headers: { 'Retry-After': String(behaviour.throttleRetryAfterSeconds) },
        executed: false,
      };
    }

    // 2. Token bucket.
    if (bucket !== null && !bucket.tryTake()) {
      return {
        kind: 'reply',
        status: 429,
        body: { error: 'rate limited' },
        headers: { 'Retry-After': String(retryAfterSeconds) },
        executed: false,
      };
    }

    // 3. Connection reset, not executed.
    if (behaviour.resetNext > 0) {
      behaviour.resetNext--;
      return { kind: 'reset' };
    }

    // 4. Transient failure, not executed.
    if (behaviour.failNext > 0) {
      behaviour.failNext--;
      return { kind: 'reply', status: behaviour.failStatus, body: { error: 'injected failure' }, executed: false };
    }

    // 5. Permanent rejection.
    if (behaviour.rejectIds.has(id)) {
      return { kind: 'reply', status: 403, body: { error: 'forbidden', id }, executed: false };
    }

    // 6. Idempotency: replay the first execution's answer.
    const previous = keys.get(key);
    if (previous !== undefined) {
      return {
        kind: 'reply',
        status: previous.status,
        body: previous.body,
        headers: { 'Idempotent-Replayed': 'true' },
        executed: false,
      };
    }

    // 7. Execute.
    let record: KeyRecord;
    let executed = false;
    if (!deleted.has(id)) {
      deleted.add(id);
      executions.set(key, (executions.get(key) ?? 0) + 1);
      executed = true;
      record = { status: 200, body: { deleted: id } };
    } else {
      record = { status: 404, body: { error: 'not found', id } };
    }
    keys.set(key, record);

    if (behaviour.executeThenFailNext > 0) {
      behaviour.executeThenFailNext--;
      return { kind: 'reply', status: 500, body: { error: 'injected failure after execution' }, executed };
    }
    return { kind: 'reply', status: record.status, body: record.body, executed };
  }

  function handleDelete(req: IncomingMessage, res: ServerResponse, id: string): void {
    const key = idempotencyKey(req);
    const startedAt = Date.now();
    const outcome = decide(id, key);
    const call: MediaApiCall = {
      seq: ++seq,
      id,
      key: typeof key === 'string' ? key : null,
      startedAt,
      finishedAt: 0,
      status: outcome.kind === 'reset' ? 'reset' : outcome.status,
      executed: outcome.kind === 'reply' && outcome.executed,
      retryAfterSeconds: outcome.kind === 'reply' && outcome.headers?.['Retry-After'] !== undefined ? Number(outcome.headers['Retry-After']) : null,
    };
    calls.push(call);

    inFlight++;
    peakInFlight = Math.max(peakInFlight, inFlight);
    let finished = false;
    let timer: NodeJS.Timeout | undefined;
    // Ends the in-progress period exactly once: when answering, or when the
    // connection closes first (client gave up, or close() dropped it).
    const finish = (): void => {
      if (finished) return;
      finished = true;
      inFlight--;
      call.finishedAt = Date.now();
      if (timer !== undefined) {
        clearTimeout(timer);
        pendingTimers.delete(timer);
      }
    };
    res.on('close', finish);

    const answer = (): void => {
      if (finished) return;
      finish();
      if (outcome.kind === 'reset') {
        req.socket.destroy();
      } else {
        sendJson(res, outcome.status, outcome.body, outcome.headers);
      }
    };

    const delay = behaviour.slowMs;
    if (behaviour.hold && !(outcome.kind === 'reply' && outcome.immediate === true)) {
      held.push({ call, answer });
    } else if (delay > 0 && !(outcome.kind === 'reply' && outcome.immediate === true)) {
      timer = setTimeout(answer, delay);
      pendingTimers.add(timer);
    } else {
      answer();
    }
  }

  function stats(): Json {
    return {
      calls: calls.length,
      executed: calls.filter((c) => c.executed).length,
      maxConcurrent: peakInFlight,
      maxCallsInWindow: maxInSlidingWindow(
        calls.map((c) => c.startedAt),
        1000,
      ),
    };
  }

  const server = createServer((req, res) => {
    req.resume(); // request bodies are ignored; drain them
    const target = req.url ?? '/'; // the request target exactly as sent: no URL parser, no dot-segment removal
    if (req.method === 'GET' && target.split('?')[0] === '/stats') {
      sendJson(res, 200, stats());
      return;
    }
    const id = req.method === 'DELETE' ? matchAssetId(target) : null;
    if (id === 'dot-segment') {
      sendJson(res, 400, { error: 'a "." or ".." path segment names no asset: percent-encode the id ("%2E")' });
      return;
    }
    if (id === null) {
      sendJson(res, 404, { error: 'no such route' });
      return;
    }
    handleDelete(req, res, id);
  });

  server.listen(options.port ?? 0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;

  let closing: Promise<void> | undefined;

  return {
    url: `http://127.0.0.1:${port}`,
    calls,
    executionsByKey: () => new Map(executions),
    deletedIds: () => new Set(deleted),
    restore(id: string): void {
      deleted.delete(id);
    },
    release(which = () => true): number {
      let answered = 0;
      for (const entry of [...held]) {
        if (!which(entry.call)) continue;
        held.splice(held.indexOf(entry), 1);
        if (entry.call.finishedAt === 0) answered++;
        entry.answer();
      }
      return answered;
    },
    heldCalls: () => held.filter((entry) => entry.call.finishedAt === 0).map((entry) => entry.call),
    maxConcurrent: () => peakInFlight,
    maxCallsInWindow(windowMs = 1000): number {
      return maxInSlidingWindow(
        calls.map((c) => c.startedAt),
        windowMs,
      );
    },
    configure(patch: Partial<MediaApiBehaviour>): void {
      if (patch.slowMs !== undefined) behaviour.slowMs = patch.slowMs;
      if (patch.throttleUntil !== undefined) behaviour.throttleUntil = patch.throttleUntil;
      if (patch.throttleNext !== undefined) behaviour.throttleNext = patch.throttleNext;
      if (patch.throttleForMs !== undefined) behaviour.throttleForMs = patch.throttleForMs;
      if (patch.hold !== undefined) behaviour.hold = patch.hold;
      if (patch.throttleRetryAfterSeconds !== undefined) behaviour.throttleRetryAfterSeconds = patch.throttleRetryAfterSeconds;
      if (patch.failNext !== undefined) behaviour.failNext = patch.failNext;
      if (patch.failStatus !== undefined) behaviour.failStatus = patch.failStatus;
      if (patch.executeThenFailNext !== undefined) behaviour.executeThenFailNext = patch.executeThenFailNext;
      if (patch.resetNext !== undefined) behaviour.resetNext = patch.resetNext;
      if (patch.rejectIds !== undefined) behaviour.rejectIds = patch.rejectIds;

      // Rate limit: an explicitly present key (even if undefined) counts.
      if ('ratePerSecond' in patch || 'burst' in patch) {
        const rate = 'ratePerSecond' in patch ? patch.ratePerSecond : behaviour.ratePerSecond;
        const burst = 'burst' in patch ? patch.burst : behaviour.burst;
        checkRate(rate, burst);
        behaviour.ratePerSecond = rate;
        behaviour.burst = burst;
        if (rate === undefined) {
          bucket = null;
        } else if (bucket === null) {
          bucket = new TokenBucket(rate, capacityOf(rate, burst)); // starts full
        } else {
          bucket.reconfigure(rate, capacityOf(rate, burst));
        }
      }
    },
    close(): Promise<void> {
      closing ??= (async () => {
        for (const t of pendingTimers) clearTimeout(t);
        pendingTimers.clear();
        held.splice(0); // dropped with their connections below
        const closed = once(server, 'close');
        server.close();
        server.closeAllConnections(); // drop keep-alive and in-progress connections
        await closed;
      })();
      return closing;
    },
  };
}
