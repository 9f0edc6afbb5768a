import assert from 'node:assert/strict';
import { test } from 'node:test';
import { classifyStatus, makeHttpRemoteClient, parseRetryAfter, withCircuitBreaker } from '../../shared/remote/client';
import { startMediaApi } from '../support/media-api';

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

test('the HTTP client sends Idempotency-Key, and timeouts and resets are uncertain', async () => {
  const api = await startMediaApi();
  try {
    const client = makeHttpRemoteClient({ baseUrl: api.url, path: '/assets/{id}', timeoutMs: 200, headers: {} });
    assert.deepEqual(await client.delete('a/1', 'key-1'), { kind: 'confirmed', status: 200 });
    assert.equal(api.calls[0]!.key, 'key-1');
    assert.equal(api.calls[0]!.id, 'a/1', 'the id is URL-encoded into the path and arrives intact');
    api.configure({ resetNext: 1 });
    assert.equal((await client.delete('a-2', 'key-2')).kind, 'uncertain');
    api.configure({ slowMs: 500 });
    const slow = await client.delete('a-3', 'key-3');
    assert.equal(slow.kind, 'uncertain');
    assert.match((slow as { reason: string }).reason, /timeout after 200 ms/);
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
