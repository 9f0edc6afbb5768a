import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { test } from 'node:test';
import { makeLogger } from '../../shared/observability/logger';
import {
  classifyStatus,
  encodeIdempotencyKey,
  encodePathSegment,
  makeHttpRemoteClient,
  MAX_RETRY_AFTER_MS,
  parseRetryAfter,
  retryAfterWasCapped,
  withCircuitBreaker,
} from '../../shared/remote/client';
import { startMediaApi } from '../../tools/media-api/server';
import { ODD_IDS } from '../support/odd-ids';

/** docs/design.md "Remote API calls": the classification is exact, and an open circuit makes no call. */

test('2xx, 404 and 410 confirm; 429 is rate limited; 408 and 5xx are uncertain; other 4xx are rejected', () => {
  for (const status of [200, 202, 204, 404, 410]) assert.equal(classifyStatus(status, null).kind, 'confirmed', String(status));
  assert.deepEqual(classifyStatus(429, '3'), { kind: 'rate-limited', retryAfterMs: 3000, status: 429 });
  for (const status of [408, 500, 502, 503, 504]) assert.equal(classifyStatus(status, null).kind, 'uncertain', String(status));
  for (const status of [400, 401, 403, 409, 422]) assert.equal(classifyStatus(status, null).kind, 'rejected', String(status));
});

test('Retry-After is read as seconds or as an HTTP date; garbage is null', () => {
  const now = Date.parse('2026-11-29T20:00:00Z');
  assert.equal(parseRetryAfter('120', now), 120_000);
  assert.equal(parseRetryAfter('Sun, 29 Nov 2026 20:00:05 GMT', now), 5_000);
  assert.equal(parseRetryAfter('Sun, 29 Nov 2026 19:00:00 GMT', now), 0, 'a date in the past means now');
  assert.equal(parseRetryAfter(null, now), null);
  assert.equal(parseRetryAfter('soon', now), null);
});

test('item 9: Retry-After is capped at one hour; a year, an overflowing number and a far date are all the cap', () => {
  const now = Date.parse('2026-11-29T20:00:00Z');
  assert.equal(MAX_RETRY_AFTER_MS, 3_600_000);
  assert.equal(parseRetryAfter('3600', now), 3_600_000, 'exactly the cap is honoured as is');
  assert.equal(retryAfterWasCapped('3600', now), false);
  assert.equal(parseRetryAfter('31536000', now), MAX_RETRY_AFTER_MS, 'a year');
  assert.equal(retryAfterWasCapped('31536000', now), true);
  const overflowing = '9'.repeat(400); // Number() of it is Infinity: no interval can hold it
  assert.equal(parseRetryAfter(overflowing, now), MAX_RETRY_AFTER_MS);
  assert.equal(retryAfterWasCapped(overflowing, now), true);
  assert.equal(parseRetryAfter('Fri, 01 Jan 2100 00:00:00 GMT', now), MAX_RETRY_AFTER_MS, 'a date far ahead');
  assert.deepEqual(classifyStatus(429, '99999999999999999999', now), { kind: 'rate-limited', retryAfterMs: MAX_RETRY_AFTER_MS, status: 429 });
  assert.equal(retryAfterWasCapped(null, now), false);
  assert.equal(retryAfterWasCapped('soon', now), false);
});

test('item 9: the HTTP client logs the original Retry-After when it caps it', async () => {
  const lines: Array<Record<string, unknown>> = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      lines.push(JSON.parse(chunk.toString()) as Record<string, unknown>);
      done();
    },
  });
  const log = makeLogger({ level: 'info', service: 'test' }, sink);
  const api = await startMediaApi();
  try {
    const client = makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 2000, headers: {} }, log);
    api.configure({ throttleUntil: Date.now() + 365 * 24 * 3600 * 1000 }); // the stand-in answers Retry-After: <a year in seconds>
    assert.deepEqual(await client.delete('capped', 'key-capped'), { kind: 'rate-limited', retryAfterMs: MAX_RETRY_AFTER_MS, status: 429 });
    const capped = lines.filter((line) => line.msg === 'Retry-After longer than the cap; capped');
    assert.equal(capped.length, 1, JSON.stringify(lines));
    assert.ok(Number(capped[0]!.retryAfter) >= 365 * 24 * 3600 - 1, `the original value is logged (${String(capped[0]!.retryAfter)})`);
    assert.equal(capped[0]!.cappedToMs, MAX_RETRY_AFTER_MS);
    // An ordinary Retry-After is not worth a line.
    api.configure({ throttleUntil: Date.now() + 2000 });
    assert.equal((await client.delete('short', 'key-short')).kind, 'rate-limited');
    assert.equal(lines.filter((line) => line.msg === 'Retry-After longer than the cap; capped').length, 1);
  } finally {
    await api.close();
  }
});

test('item 3: an id is one path segment (dots included) and the key a valid header value, both exactly decodable', () => {
  assert.equal(encodePathSegment('.'), '%2E');
  assert.equal(encodePathSegment('..'), '%2E%2E');
  assert.equal(encodePathSegment('a/b'), 'a%2Fb');
  assert.equal(encodePathSegment('%2F'), '%252F');
  assert.equal(encodePathSegment('x?y#z'), 'x%3Fy%23z');
  assert.equal(encodePathSegment("it's!(*)"), 'it%27s%21%28%2A%29');
  assert.equal(encodePathSegment('€'), '%E2%82%AC');
  assert.equal(encodePathSegment('Az09-_~'), 'Az09-_~', 'unreserved characters other than "." stay');
  assert.equal(encodePathSegment('\ud800'), '%EF%BF%BD', 'a lone surrogate does not throw (it is U+FFFD, as PostgreSQL would hold it)');
  assert.equal(encodeIdempotencyKey('media-assets:a-1:2026-11-29T19:58:12.345678Z'), 'media-assets:a-1:2026-11-29T19:58:12.345678Z', 'a visible-ASCII key travels unchanged');
  assert.equal(encodeIdempotencyKey('p:€ 100%:t'), 'p:%E2%82%AC%20100%25:t');
  for (const id of ODD_IDS) {
    assert.equal(decodeURIComponent(encodePathSegment(id)), id, `${id}: the segment decodes to the id`);
    assert.match(encodePathSegment(id), /^(?:[A-Za-z0-9\-_~]|%[0-9A-F]{2})+$/, `${id}: one segment, nothing a URL parser could read as "." or ".."`);
    const key = `media-assets:${id}:2026-11-29T19:58:12.345678Z`;
    assert.equal(decodeURIComponent(encodeIdempotencyKey(key)), key, `${id}: the key decodes exactly`);
    assert.match(encodeIdempotencyKey(key), /^[\x21-\x7e]+$/, `${id}: the key is visible ASCII`);
  }
});

test('item 3: every odd id reaches exactly its own address with its key, and nothing throws', async () => {
  const api = await startMediaApi();
  try {
    const client = withCircuitBreaker(makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 2000, headers: {} }));
    for (const id of ODD_IDS) {
      const key = `media-assets:${id}:2026-11-29T19:58:12.345678Z`;
      assert.deepEqual(await client.delete(id, key), { kind: 'confirmed', status: 200 }, `${id}: deleted (200), not a 404 of some other route`);
    }
    assert.deepEqual(
      api.calls.map((call) => [call.id, call.key, call.status, call.executed]),
      ODD_IDS.map((id) => [id, `media-assets:${id}:2026-11-29T19:58:12.345678Z`, 200, true]),
      'one call per id, at its own address, with its own key',
    );
    assert.deepEqual(api.deletedIds(), new Set(ODD_IDS));
    assert.equal(client.breaker.stats.failures, 0, 'nothing counted toward the circuit breaker');
    client.breaker.shutdown();
  } finally {
    await api.close();
  }
});

test('a remote.path with characters that cannot go on the request line is refused when the client is made', () => {
  assert.throws(() => makeHttpRemoteClient({ baseUrl: 'http://127.0.0.1:1', path: '/my assets/{id}', timeoutMs: 1000, headers: {} }), /remote\.path/);
});

test('the HTTP client sends Idempotency-Key, and timeouts and resets are uncertain', async () => {
  const api = await startMediaApi();
  try {
    // Calls that must succeed get a timeout no loaded machine reaches; the timeout case gets a
    // short timeout and an answer that never comes in time (held by the stand-in, not slowed by a
    // fixed delay a slow machine could overrun either way).
    const client = makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 30_000, headers: {} });
    assert.deepEqual(await client.delete('a/1', 'key-1'), { kind: 'confirmed', status: 200 });
    assert.equal(api.calls[0]!.key, 'key-1');
    assert.equal(api.calls[0]!.id, 'a/1', 'the id is URL-encoded into the path and arrives intact');
    api.configure({ resetNext: 1 });
    assert.equal((await client.delete('a-2', 'key-2')).kind, 'uncertain');
    const impatient = makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 200, headers: {} });
    api.configure({ hold: true });
    const slow = await impatient.delete('a-3', 'key-3');
    assert.equal(slow.kind, 'uncertain');
    assert.match((slow as { reason: string }).reason, /timeout after 200 ms/);
    api.release(); // answers nobody waits for any more
  } finally {
    await api.close();
  }
});

test('after enough uncertain calls the circuit opens: no call reaches the remote, and the outcome says when to retry', async () => {
  const api = await startMediaApi();
  try {
    const client = withCircuitBreaker(makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 1000, headers: {} }), {
      errorThresholdPercentage: 50,
      volumeThreshold: 4,
      resetTimeoutMs: 60_000,
    });
    api.configure({ failNext: 4, failStatus: 503 });
    for (let i = 0; i < 4; i++) assert.equal((await client.delete(`x-${i}`, `k-${i}`)).kind, 'uncertain');
    const callsBefore = api.calls.length;
    assert.deepEqual(await client.delete('x-5', 'k-5'), { kind: 'circuit-open', retryInMs: 60_000 });
    assert.equal(api.calls.length, callsBefore, 'an open circuit makes no call');
    // Rate limits and rejections are answers, not failures: they do not open a fresh circuit.
    const calm = withCircuitBreaker(makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 1000, headers: {} }), {
      errorThresholdPercentage: 50,
      volumeThreshold: 4,
      resetTimeoutMs: 60_000,
    });
    api.configure({ rejectIds: new Set(['r-0', 'r-1', 'r-2', 'r-3', 'r-4']) });
    for (let i = 0; i < 5; i++) assert.equal((await calm.delete(`r-${i}`, `rk-${i}`)).kind, 'rejected');
    assert.equal(calm.breaker.opened, false);
    calm.breaker.shutdown();
    client.breaker.shutdown();
  } finally {
    await api.close();
  }
});

test('a connection left idle around the server\'s keep-alive timeout is not reused into a reset', async () => {
  // node:http's default server announces a 5 s keep-alive and closes idle connections about 6 s
  // after their last answer; a client that sends on one in that instant gets ECONNRESET (an
  // uncertain call for nothing; the window is a few ms wide, hence one client per 2 ms).
  const api = await startMediaApi();
  try {
    const idles = Array.from({ length: 101 }, (_, index) => 5_900 + index * 2);
    const outcomes = await Promise.all(
      idles.map(async (idleMs) => {
        const client = makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 2000, headers: {} });
        await client.delete(`first-${idleMs}`, `first-${idleMs}`);
        await new Promise((resolve) => setTimeout(resolve, idleMs));
        return [idleMs, (await client.delete(`second-${idleMs}`, `second-${idleMs}`)).kind] as const;
      }),
    );
    assert.deepEqual(outcomes.filter(([, kind]) => kind !== 'confirmed'), []);
  } finally {
    await api.close();
  }
});
