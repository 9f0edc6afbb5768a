/**
 * Unit tests for the stand-in media API (tools/media-api/server.ts).
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { request as httpRequest } from 'node:http';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { maxInSlidingWindow, startMediaApi, type MediaApi, type MediaApiOptions } from '../../tools/media-api/server';

/** Starts a server, runs `fn`, and always closes the server. */
async function withApi(options: MediaApiOptions, fn: (api: MediaApi) => Promise<void>): Promise<void> {
  const api = await startMediaApi(options);
  try {
    await fn(api);
  } finally {
    await api.close();
  }
}

/** DELETE /assets/:id, with an Idempotency-Key unless `key` is null. */
function del(api: MediaApi, id: string, key: string | null): Promise<Response> {
  const headers: Record<string, string> = key === null ? {} : { 'Idempotency-Key': key };
  return fetch(`${api.url}/assets/${encodeURIComponent(id)}`, { method: 'DELETE', headers });
}

test('a repeated call with the same key executes once and replays the same answer', async () => {
  await withApi({}, async (api) => {
    const first = await del(api, 'a/1', 'k1');
    assert.equal(first.status, 200);
    assert.deepEqual(await first.json(), { deleted: 'a/1' });

    const second = await del(api, 'a/1', 'k1');
    assert.equal(second.status, 200);
    assert.deepEqual(await second.json(), { deleted: 'a/1' });
    assert.equal(second.headers.get('idempotent-replayed'), 'true');

    assert.deepEqual(api.executionsByKey(), new Map([['k1', 1]]));
    assert.deepEqual(api.deletedIds(), new Set(['a/1']));
    assert.deepEqual(
      api.calls.map((c) => [c.seq, c.id, c.key, c.status, c.executed]),
      [
        [1, 'a/1', 'k1', 200, true],
        [2, 'a/1', 'k1', 200, false],
      ],
    );
    for (const c of api.calls) assert.ok(c.finishedAt >= c.startedAt);
  });
});

test('another key gets 404 for a deleted asset; after restore a new key deletes it again', async () => {
  await withApi({}, async (api) => {
    assert.equal((await del(api, 'x', 'k1')).status, 200);
    assert.equal((await del(api, 'x', 'k2')).status, 404);
    assert.equal((await del(api, 'x', 'k2')).status, 404, 'a 404 outcome is replayed too');

    api.restore('x');
    assert.deepEqual(api.deletedIds(), new Set());
    assert.equal((await del(api, 'x', 'k1')).status, 200, 'old key replays without executing');
    assert.deepEqual(api.deletedIds(), new Set(), 'replay did not delete');

    assert.equal((await del(api, 'x', 'k3')).status, 200);
    assert.deepEqual(api.deletedIds(), new Set(['x']));
    assert.deepEqual(
      api.executionsByKey(),
      new Map([
        ['k1', 1],
        ['k3', 1],
      ]),
    );
    assert.deepEqual(
      api.calls.map((c) => c.executed),
      [true, false, false, false, true],
    );
  });
});

test('token bucket: 429 with Retry-After once the burst is spent', async () => {
  // A refill rate this low cannot add a token during the test.
  await withApi({ ratePerSecond: 0.01, burst: 3, retryAfterSeconds: 7 }, async (api) => {
    for (let i = 0; i < 3; i++) assert.equal((await del(api, `id${i}`, `k${i}`)).status, 200);

    const limited = await del(api, 'id3', 'k3');
    assert.equal(limited.status, 429);
    assert.equal(limited.headers.get('retry-after'), '7');
    assert.equal(api.calls[3]?.executed, false);
    assert.equal(api.deletedIds().has('id3'), false);

    // Removing the limit at run time lets calls through again.
    api.configure({ ratePerSecond: undefined });
    assert.equal((await del(api, 'id3', 'k3')).status, 200, 'the 429 did not burn the key');
  });
});

test('forced throttle: every call gets 429 with Retry-After = seconds left', async () => {
  // The stand-in's clock is fixed: Retry-After is ceil(2.5 s) = 3 however long the call took.
  const now = 1_800_000_000_000;
  await withApi({ clock: () => now }, async (api) => {
    api.configure({ throttleUntil: now + 2500 });
    const res = await del(api, 'a', 'k');
    assert.equal(res.status, 429);
    assert.equal(res.headers.get('retry-after'), '3');
    assert.equal(api.calls[0]?.executed, false);

    api.configure({ throttleUntil: 0 });
    assert.equal((await del(api, 'a', 'k')).status, 200);
  });
});

test('throttleNext: the next N calls get 429 with exactly the Retry-After asked for; throttleForMs starts its window at the next call', async () => {
  let now = 1_800_000_000_000;
  await withApi({ clock: () => now }, async (api) => {
    api.configure({ throttleNext: 2, throttleRetryAfterSeconds: 7 });
    assert.equal((await del(api, 'a', 'k1')).headers.get('retry-after'), '7');
    assert.equal((await del(api, 'a', 'k2')).status, 429);
    assert.equal((await del(api, 'a', 'k3')).status, 200);
    assert.deepEqual(api.calls.map((call) => call.retryAfterSeconds), [7, 7, null], 'the Retry-After sent is recorded per call');

    api.configure({ throttleForMs: 2_500 });
    now += 60_000; // however late the next call comes, the window starts with it
    assert.equal((await del(api, 'b', 'k4')).headers.get('retry-after'), '3');
    now += 2_000;
    assert.equal((await del(api, 'b', 'k5')).headers.get('retry-after'), '1');
    now += 500;
    assert.equal((await del(api, 'b', 'k6')).status, 200, 'the window ended');
  });
});

test('hold: calls are decided on arrival and answered only on release', async () => {
  await withApi({}, async (api) => {
    api.configure({ hold: true });
    const answer = del(api, 'h', 'kh');
    await new Promise<void>((resolve) => {
      const poll = () => (api.heldCalls().length === 1 ? resolve() : setTimeout(poll, 5));
      poll();
    });
    assert.equal(api.calls[0]!.executed, true, 'executed on arrival');
    assert.equal(api.calls[0]!.finishedAt, 0, 'still in progress');
    assert.equal(api.release(), 1);
    assert.equal((await answer).status, 200);
    assert.ok(api.calls[0]!.finishedAt > 0);
  });
});

test('rejectIds answers 403 without executing', async () => {
  await withApi({}, async (api) => {
    api.configure({ rejectIds: new Set(['nope']) });
    assert.equal((await del(api, 'nope', 'k1')).status, 403);
    assert.equal((await del(api, 'fine', 'k2')).status, 200);
    assert.deepEqual(api.deletedIds(), new Set(['fine']));
    assert.deepEqual(api.executionsByKey(), new Map([['k2', 1]]));
    assert.equal(api.calls[0]?.status, 403);
    assert.equal(api.calls[0]?.executed, false);
  });
});

test('failNext answers 503 without executing; the same key then succeeds', async () => {
  await withApi({}, async (api) => {
    api.configure({ failNext: 2 });
    assert.equal((await del(api, 'a', 'k')).status, 503);
    api.configure({ failStatus: 502 });
    assert.equal((await del(api, 'a', 'k')).status, 502);
    assert.deepEqual(api.deletedIds(), new Set());

    assert.equal((await del(api, 'a', 'k')).status, 200);
    assert.deepEqual(
      api.calls.map((c) => [c.status, c.executed]),
      [
        [503, false],
        [502, false],
        [200, true],
      ],
    );
    assert.deepEqual(api.executionsByKey(), new Map([['k', 1]]));
  });
});

test('executeThenFailNext deletes, answers 500, and a retry with the same key replays 200', async () => {
  await withApi({}, async (api) => {
    api.configure({ executeThenFailNext: 1 });
    assert.equal((await del(api, 'a', 'k')).status, 500);
    assert.deepEqual(api.deletedIds(), new Set(['a']));

    assert.equal((await del(api, 'a', 'k')).status, 200);
    assert.deepEqual(api.executionsByKey(), new Map([['k', 1]]));
    assert.deepEqual(
      api.calls.map((c) => [c.status, c.executed]),
      [
        [500, true],
        [200, false],
      ],
    );
  });
});

test('resetNext destroys the connection: fetch throws and nothing is executed', async () => {
  await withApi({}, async (api) => {
    api.configure({ resetNext: 1 });
    await assert.rejects(del(api, 'a', 'k'), TypeError);
    assert.equal(api.calls.length, 1);
    assert.equal(api.calls[0]?.status, 'reset');
    assert.equal(api.calls[0]?.executed, false);
    assert.deepEqual(api.deletedIds(), new Set());

    assert.equal((await del(api, 'a', 'k')).status, 200);
  });
});

test('missing Idempotency-Key is 400 and recorded; other routes are 404 and not recorded', async () => {
  await withApi({}, async (api) => {
    assert.equal((await del(api, 'a', null)).status, 400);
    assert.equal((await fetch(`${api.url}/assets/a`, { method: 'GET' })).status, 404);
    assert.equal((await fetch(`${api.url}/other`, { method: 'DELETE', headers: { 'Idempotency-Key': 'k' } })).status, 404);

    assert.equal(api.calls.length, 1);
    assert.deepEqual([api.calls[0]?.status, api.calls[0]?.key, api.calls[0]?.executed], [400, null, false]);
    assert.deepEqual(api.deletedIds(), new Set());
  });
});

/**
 * A DELETE with this request target byte for byte (node:http sends `path` as is; fetch() would
 * run it through the WHATWG URL parser, which collapses `%2E%2E`).
 */
function rawDelete(api: MediaApi, target: string, key: string | null): Promise<{ status: number; body: unknown }> {
  return new Promise((resolve, reject) => {
    const request = httpRequest(`${api.url}${target.startsWith('/') ? '' : '/'}`, { method: 'DELETE', path: target, headers: key === null ? {} : { 'idempotency-key': key } }, (response) => {
      const chunks: Buffer[] = [];
      response.on('data', (chunk: Buffer) => chunks.push(chunk));
      response.on('end', () => resolve({ status: response.statusCode ?? 0, body: JSON.parse(Buffer.concat(chunks).toString('utf8')) as unknown }));
      response.on('error', reject);
    });
    request.on('error', reject);
    request.end();
  });
}

test('ids and keys are decoded exactly from the request target as sent: %2E%2E is the id "..", never the parent', async () => {
  await withApi({}, async (api) => {
    const cases: Array<[string, string, string, string]> = [
      // [target, key header, id recorded, key recorded]
      ['/assets/%2E', 'k%2E', '.', 'k.'],
      ['/assets/%2E%2E', 'p:%2E%2E:t', '..', 'p:..:t'],
      ['/assets/a%2Fb', 'p:a/b:t', 'a/b', 'p:a/b:t'],
      ['/assets/%252F', 'p:%252F:t', '%2F', 'p:%2F:t'],
      ['/assets/x%3Fy%23z', 'p:x?y#z:t', 'x?y#z', 'p:x?y#z:t'],
      ['/assets/with%20space', 'p:with%20space:t', 'with space', 'p:with space:t'],
      ['/assets/%E2%82%AC', 'p:%E2%82%AC:t', '€', 'p:€:t'],
      ['/assets/%E8%B3%87%E7%94%A3?ignored=1', 'p:%E8%B3%87%E7%94%A3:t', '資産', 'p:資産:t'],
    ];
    for (const [target, header] of cases) assert.equal((await rawDelete(api, target, header)).status, 200, target);
    assert.deepEqual(
      api.calls.map((call) => [call.id, call.key, call.executed]),
      cases.map(([, , id, key]) => [id, key, true]),
    );
    assert.deepEqual(api.executionsByKey(), new Map(cases.map(([, , , key]) => [key, 1])));
  });
});

test('a literal dot segment is a 400 (not an asset, not a 404 that looks like "already deleted"); a broken key encoding is a 400', async () => {
  await withApi({}, async (api) => {
    for (const target of ['/assets/.', '/assets/..']) {
      const answer = await rawDelete(api, target, 'k');
      assert.equal(answer.status, 400, target);
      assert.match(JSON.stringify(answer.body), /%2E/);
    }
    assert.equal(api.calls.length, 0, 'dot segments are no asset calls');
    const broken = await rawDelete(api, '/assets/a', 'p:%E2:t');
    assert.equal(broken.status, 400);
    assert.deepEqual([api.calls.length, api.calls[0]?.key, api.calls[0]?.executed], [1, null, false]);
    assert.deepEqual(api.deletedIds(), new Set());
  });
});

test('maxConcurrent counts requests held open by slowMs', async () => {
  await withApi({}, async (api) => {
    // Sequential calls never overlap.
    for (let i = 0; i < 3; i++) await del(api, `s${i}`, `s${i}`);
    assert.equal(api.maxConcurrent(), 1);

    api.configure({ slowMs: 150 });
    const responses = await Promise.all(Array.from({ length: 5 }, (_, i) => del(api, `p${i}`, `p${i}`)));
    assert.deepEqual(
      responses.map((r) => r.status),
      [200, 200, 200, 200, 200],
    );
    assert.equal(api.maxConcurrent(), 5);
    for (const c of api.calls.slice(3)) assert.ok(c.finishedAt - c.startedAt >= 100, 'slowMs delayed the answer');
  });
});

test('close() drops requests still waiting on slowMs', async () => {
  const api = await startMediaApi();
  api.configure({ slowMs: 60_000 });
  const pending = del(api, 'a', 'k');
  // Poll until the server has the request, then close under it.
  while (api.calls.length === 0) await new Promise<void>((resolve) => setImmediate(resolve));
  await api.close();
  await assert.rejects(pending, TypeError);
  assert.ok(api.calls[0]!.finishedAt > 0);
});

test('maxCallsInWindow counts calls whose startedAt falls in a sliding window', async () => {
  await withApi({}, async (api) => {
    assert.equal(api.maxCallsInWindow(), 0);
    for (let i = 0; i < 4; i++) await del(api, `w${i}`, `w${i}`);
    assert.equal((await del(api, 'w0', null)).status, 400); // any status counts
    // Five quick calls: all inside one second, and the 1 ms window holds at least one.
    assert.equal(api.maxCallsInWindow(), 5);
    assert.equal(api.maxCallsInWindow(60_000), 5);
    assert.ok(api.maxCallsInWindow(1) >= 1);

    const stats = (await (await fetch(`${api.url}/stats`)).json()) as Record<string, number>;
    assert.deepEqual(stats, { calls: 5, executed: 4, maxConcurrent: 1, maxCallsInWindow: 5 });
  });

  // The window arithmetic itself, on fixed timestamps (half-open [t, t + w)).
  const times = [2001, 0, 100, 900, 1000, 1500, 1999, 2000];
  assert.equal(maxInSlidingWindow(times, 1000), 4); // [1500, 2500): 1500, 1999, 2000, 2001 ([1000, 2000) excludes 2000)
  assert.equal(maxInSlidingWindow(times, 1002), 5); // [1000, 2002): 1000, 1500, 1999, 2000, 2001
  assert.equal(maxInSlidingWindow([0, 999, 1000], 1000), 2);
  assert.equal(maxInSlidingWindow([5, 5, 5], 1), 3);
  assert.equal(maxInSlidingWindow([], 1000), 0);
  assert.throws(() => maxInSlidingWindow([1], 0), RangeError);
});

test('media-api-main prints its url and exits cleanly on SIGTERM', async () => {
  const child = spawn(process.execPath, [join(__dirname, '..', '..', 'tools', 'media-api', 'main.js'), '--rate', '0.1', '--burst', '2'], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  try {
    const lines = createInterface({ input: child.stdout });
    const [line] = (await once(lines, 'line')) as [string];
    const { url } = JSON.parse(line) as { url: string };
    assert.match(url, /^http:\/\/127\.0\.0\.1:\d+$/);

    const statuses: number[] = [];
    for (let i = 0; i < 3; i++) {
      const res = await fetch(`${url}/assets/m${i}`, { method: 'DELETE', headers: { 'Idempotency-Key': `m${i}` } });
      statuses.push(res.status);
    }
    assert.deepEqual(statuses, [200, 200, 429]);

    const exited = once(child, 'exit');
    child.kill('SIGTERM');
    const [code] = (await exited) as [number | null];
    assert.equal(code, 0);
  } finally {
    if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
  }
});
