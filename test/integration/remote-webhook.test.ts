import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { signWebhook } from '../../services/scheduler/webhooks';
import { eventually } from '../support/eventually';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { runReaperCli, type ReaperProcess } from '../support/processes';
import {
  assertRetention,
  callsByKey,
  closeRemoteWorld,
  currentKeyOf,
  ledgerRows,
  MEDIA_POLICY,
  mediaPolicyYaml,
  seedAssets,
  startSchedulerProcess,
  started,
  startWorkerProcess,
} from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';
import { stopAllCleanly } from '../support/fixtures';

/**
 * POST /webhooks/<policy> on the scheduler (docs/design.md "HTTP"; issue: webhooks converge on the same
 * key as the scan). A webhook and a scan for the same asset make ONE operation, whichever comes
 * first, and the remote is called once. A wrong signature, a tampered body, a missing signature or
 * a timestamp more than 5 minutes off is refused with 401 and changes nothing: no ledger row, no run.
 * Issue 7 item 19: the signature covers the method and the path too, so a request signed for one
 * policy is refused on another's path; and a signature is accepted once, by any replica.
 */
const SECRET = 'webhook-secret-for-tests-0123456789';
/** A second remote-delete policy on the same table: the target of a replay across paths. */
const OTHER_POLICY = 'media-assets-b';

describe('remote-delete: webhooks', () => {
  let bed: TestBed;
  let api: MediaApi;
  let processes: ReaperProcess[] = [];
  let webhookUrl = '';
  let otherWebhookUrl = '';
  let replicaWebhookUrl = '';

  before(async () => {
    bed = await makeTestBed('remote_webhook');
    api = await startMediaApi();
    const yaml = mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 });
    const otherPolicy = yaml.slice('policies:\n'.length).replace(`name: ${MEDIA_POLICY}`, `name: ${OTHER_POLICY}`);
    bed.writePolicies(yaml + otherPolicy);
    const scheduler = startSchedulerProcess(bed, 'webhook-scheduler', { HTTP_PORT: '0', REAPER_WEBHOOK_SECRET: SECRET });
    const replica = startSchedulerProcess(bed, 'webhook-scheduler-2', { HTTP_PORT: '0', REAPER_WEBHOOK_SECRET: SECRET });
    const worker = startWorkerProcess(bed, 'webhook-worker');
    processes = [scheduler, worker, replica];
    const line = await scheduler.waitForLine('scheduler started', (l) => l.msg === 'scheduler started');
    assert.ok(Number(line.httpPort) > 0, `the scheduler reports its HTTP port (${String(line.httpPort)})`);
    webhookUrl = `http://127.0.0.1:${String(line.httpPort)}/webhooks/${MEDIA_POLICY}`;
    otherWebhookUrl = `http://127.0.0.1:${String(line.httpPort)}/webhooks/${OTHER_POLICY}`;
    const replicaLine = await replica.waitForLine('scheduler started', (l) => l.msg === 'scheduler started');
    replicaWebhookUrl = `http://127.0.0.1:${String(replicaLine.httpPort)}/webhooks/${MEDIA_POLICY}`;
    await started(worker, 'worker');
  });

  after(async () => {
    try {
      await stopAllCleanly(processes);
    } finally {
      await closeRemoteWorld({ bed, api });
    }
  });

  const nowSeconds = () => Math.floor(Date.now() / 1000);

  async function post(body: string, headers: Record<string, string>, url = webhookUrl): Promise<{ status: number; json: Record<string, unknown> }> {
    const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body });
    return { status: response.status, json: (await response.json()) as Record<string, unknown> };
  }

  const pathOf = (url: string) => new URL(url).pathname;

  /** Headers of a correctly signed webhook for `body`, sent as POST to `url`. */
  function signedHeaders(body: string, url = webhookUrl, timestamp = String(nowSeconds()), secret = SECRET, method = 'POST'): Record<string, string> {
    return { 'x-reaper-timestamp': timestamp, 'x-reaper-signature': signWebhook(secret, { timestamp, method, path: pathOf(url), body }) };
  }

  /**
   * A correctly signed webhook for `id`: a new event each time. Two events for the same id within
   * one second would carry the same timestamp and so the same signature, which the scheduler
   * rightly refuses as a replay; a sender's next event is signed with a later timestamp.
   */
  let lastTimestamp = 0;
  function signedWebhook(id: string): Promise<{ status: number; json: Record<string, unknown> }> {
    const body = JSON.stringify({ id });
    lastTimestamp = Math.max(nowSeconds(), lastTimestamp + 1);
    return post(body, signedHeaders(body, webhookUrl, String(lastTimestamp)));
  }

  const signaturesSeen = async () => (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_webhook_signatures')).rows[0]!.n;

  const runCount = async () => (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_runs')).rows[0]!.n;
  const ledgerCount = async () => (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_ledger')).rows[0]!.n;
  const pause = async () => assert.equal((await runReaperCli(['pause', MEDIA_POLICY], bed.processEnv())).code, 0);
  const resume = async () => assert.equal((await runReaperCli(['resume', MEDIA_POLICY], bed.processEnv())).code, 0);

  test('bad signature, tampered body, missing signature, old or future timestamp: 401, and nothing changes', async () => {
    const [refused] = await seedAssets(bed.pool, 'refused', 1);
    const runsBefore = await runCount();
    const ledgerBefore = await ledgerCount();
    const body = JSON.stringify({ id: refused });
    const now = String(nowSeconds());
    const old = String(nowSeconds() - 6 * 60);
    const future = String(nowSeconds() + 6 * 60);
    const signed = (overrides: Partial<Parameters<typeof signWebhook>[1]>, secret = SECRET) =>
      signWebhook(secret, { timestamp: now, method: 'POST', path: pathOf(webhookUrl), body, ...overrides });
    const signaturesBefore = await signaturesSeen();
    const cases: Array<[string, Record<string, string>, string?]> = [
      ['signed with another secret', { 'x-reaper-timestamp': now, 'x-reaper-signature': signed({}, 'some-other-secret-0123456789') }],
      ['signature of another body', { 'x-reaper-timestamp': now, 'x-reaper-signature': signed({ body: JSON.stringify({ id: 'someone-else' }) }) }],
      ['signature over another timestamp', { 'x-reaper-timestamp': now, 'x-reaper-signature': signed({ timestamp: String(Number(now) - 1) }) }],
      ['signature over another method', { 'x-reaper-timestamp': now, 'x-reaper-signature': signed({ method: 'PUT' }) }],
      ['signature over another path', { 'x-reaper-timestamp': now, 'x-reaper-signature': signed({ path: pathOf(otherWebhookUrl) }) }],
      ['signature of the old form "<timestamp>.<body>"', { 'x-reaper-timestamp': now, 'x-reaper-signature': `sha256=${createHmac('sha256', SECRET).update(`${now}.${body}`).digest('hex')}` }],
      ['signature missing', { 'x-reaper-timestamp': now }],
      ['signature not hex of HMAC', { 'x-reaper-timestamp': now, 'x-reaper-signature': 'sha256=deadbeef' }],
      ['timestamp 6 minutes old (correctly signed)', { 'x-reaper-timestamp': old, 'x-reaper-signature': signed({ timestamp: old }) }],
      ['timestamp 6 minutes ahead (correctly signed)', { 'x-reaper-timestamp': future, 'x-reaper-signature': signed({ timestamp: future }) }],
      ['timestamp missing', { 'x-reaper-signature': signed({}) }],
    ];
    for (const [name, headers] of cases) {
      const response = await post(body, headers);
      assert.equal(response.status, 401, `${name}: 401 (got ${response.status} ${JSON.stringify(response.json)})`);
    }
    assert.equal(await ledgerCount(), ledgerBefore, 'no ledger row');
    assert.equal(await runCount(), runsBefore, 'no run');
    assert.equal(await signaturesSeen(), signaturesBefore, 'no signature remembered for a refused request');

    // The refusal is the whole answer: the handler replies 401 before touching the database, and
    // the scheduler says why, once per request.
    const refusals = () => processes[0]!.lines.filter((line) => line.msg === 'webhook refused' && line.policy === MEDIA_POLICY);
    await eventually('each refusal logged', () => refusals().length >= cases.length);
    assert.equal(refusals().length, cases.length, 'each refusal logged with its reason');
    assert.deepEqual(await ledgerRows(bed.pool, [refused!]), [], 'no ledger row for the refused asset');
    assert.equal(api.calls.filter((call) => call.id === refused).length, 0, 'no call for the refused asset');
    // Clean up for the next tests: this asset is not part of them.
    await bed.pool.query(`DELETE FROM media_assets WHERE asset_id = $1`, [refused]);
  });

  test('webhook first, then the scan: one operation, one call', async () => {
    const [assetId] = await seedAssets(bed.pool, 'webhook-first', 1);
    const expectedKey = await currentKeyOf(bed.pool, assetId!);
    await pause();
    try {
      const first = await signedWebhook(assetId!);
      assert.equal(first.status, 202, JSON.stringify(first.json));
      assert.equal(first.json.operationKey, expectedKey, 'the webhook records the key the scan would make');
      assert.equal(first.json.created, true);
      const [recorded] = await ledgerRows(bed.pool, [assetId!]);
      assert.equal(recorded!.source, 'webhook');
      assert.equal(recorded!.state, 'pending');
      const deliveriesAtWebhook = recorded!.delivery_count;

      // The ledger is the record of remote work (issue 7, item 10): a scan does not publish an
      // item whose operation exists, and while paused nothing carries it.
      const run = await runReaperCli(['trigger', MEDIA_POLICY, '--wait', '--timeout', '30', '--json'], bed.processEnv());
      assert.equal(run.code, 0, run.stdout);
      const published = await bed.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM cleanup_runs WHERE policy = $1 AND state = 'completed' AND coalesce(candidates, 0) > 0`,
        [MEDIA_POLICY],
      );
      assert.equal(published.rows[0]!.n, 0, 'no run published the asset the webhook recorded');
      assert.equal((await ledgerRows(bed.pool, [assetId!]))[0]!.delivery_count, deliveriesAtWebhook, 'no batch carried it while paused');
      const again = await signedWebhook(assetId!);
      assert.equal(again.status, 202, JSON.stringify(again.json));
      assert.equal(again.json.operationKey, expectedKey);
      assert.equal(again.json.created, false, 'a repeated webhook creates nothing');
      assert.equal((await ledgerRows(bed.pool, [assetId!])).length, 1, 'still one operation');
      assert.equal(api.calls.filter((call) => call.id === assetId).length, 0, 'paused: no call yet');
    } finally {
      await resume();
    }
    await eventually('the operation confirmed', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.outcome === 'confirmed', { timeoutMs: 15_000 });
    const rows = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(rows.length, 1);
    assertRetention(rows);
    assert.deepEqual(api.calls.filter((call) => call.id === assetId).map((call) => call.key), [expectedKey], 'one call, with that key');
    assert.equal(api.executionsByKey().get(expectedKey), 1);
  });

  test('scan first, then the webhook: the webhook finds the same operation', async () => {
    const [assetId] = await seedAssets(bed.pool, 'scan-first', 1);
    const expectedKey = await currentKeyOf(bed.pool, assetId!);
    await pause();
    try {
      assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);
      await eventually('the scan to record the operation', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.source === 'scan', { timeoutMs: 15_000 });
      const response = await signedWebhook(assetId!);
      assert.equal(response.status, 202, JSON.stringify(response.json));
      assert.equal(response.json.operationKey, expectedKey, 'same key as the scan');
      assert.equal(response.json.created, false, 'no second operation');
    } finally {
      await resume();
    }
    await eventually('the operation confirmed', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.outcome === 'confirmed', { timeoutMs: 15_000 });
    const rows = await ledgerRows(bed.pool, [assetId!]);
    assert.deepEqual(rows.map((row) => row.operation_key), [expectedKey], 'one operation');
    assertRetention(rows);
    assert.equal(callsByKey(api).get(expectedKey)?.length, 1, 'one call');
    assert.equal(api.executionsByKey().get(expectedKey), 1);
  });
  test('item 19: a request signed for one policy, replayed against another policy\'s path: 401, nothing changes; on its own path it is accepted', async () => {
    const [assetId] = await seedAssets(bed.pool, 'cross-path', 1);
    const body = JSON.stringify({ id: assetId });
    const headers = signedHeaders(body, webhookUrl);
    await pause();
    try {
      const runsBefore = await runCount();
      const ledgerBefore = await ledgerCount();
      const replayed = await post(body, headers, otherWebhookUrl);
      assert.equal(replayed.status, 401, JSON.stringify(replayed.json));
      assert.match(String(replayed.json.error), /signature does not match/);
      assert.equal(await ledgerCount(), ledgerBefore, 'no ledger row');
      assert.equal(await runCount(), runsBefore, 'no run');
      assert.deepEqual(await ledgerRows(bed.pool, [assetId!]), []);
      // The refusal did not use the signature up: on the path it was signed for, it is taken.
      const own = await post(body, headers, webhookUrl);
      assert.equal(own.status, 202, JSON.stringify(own.json));
      const policies = await bed.pool.query<{ policy: string }>('SELECT policy FROM cleanup_ledger WHERE asset_id = $1', [assetId]);
      assert.deepEqual(policies.rows.map((row) => row.policy), [MEDIA_POLICY], 'only the policy it was signed for');
    } finally {
      await resume();
    }
    await eventually('the operation confirmed', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.outcome === 'confirmed', { timeoutMs: 15_000 });
  });

  test('item 19: the same signed request twice: the second is refused with 401 and changes nothing, on this replica or another', async () => {
    const [assetId] = await seedAssets(bed.pool, 'replayed', 1);
    const body = JSON.stringify({ id: assetId });
    const headers = signedHeaders(body, webhookUrl);
    await pause();
    try {
      const first = await post(body, headers);
      assert.equal(first.status, 202, JSON.stringify(first.json));
      const runsAfterFirst = await runCount();
      const ledgerAfterFirst = await ledgerCount();
      const signatures = await signaturesSeen();
      for (const [where, url] of [
        ['same replica', webhookUrl],
        ['another replica', replicaWebhookUrl],
      ] as const) {
        const again = await post(body, headers, url);
        assert.equal(again.status, 401, `${where}: ${JSON.stringify(again.json)}`);
        assert.match(String(again.json.error), /already used/);
      }
      assert.equal(await runCount(), runsAfterFirst, 'no run proposed by the replays');
      assert.equal(await ledgerCount(), ledgerAfterFirst, 'no ledger row');
      assert.deepEqual((await ledgerRows(bed.pool, [assetId!])).map((row) => [row.operation_key, row.source]), [[first.json.operationKey, 'webhook']], 'still the one operation');
      assert.equal(await signaturesSeen(), signatures);
      // A fresh signature for the same asset is a new request, and is taken (it records nothing new).
      const fresh = await post(body, signedHeaders(body, webhookUrl, String(nowSeconds() + 1)));
      assert.equal(fresh.status, 202, JSON.stringify(fresh.json));
      assert.equal(fresh.json.created, false);
    } finally {
      await resume();
    }
    await eventually('the operation confirmed', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.outcome === 'confirmed', { timeoutMs: 15_000 });
  });

  test('item 19: used signatures are pruned once their window has closed', async () => {
    await bed.pool.query(
      `INSERT INTO cleanup_webhook_signatures (signature, policy, expires_at) VALUES ('stale-signature', $1, now() - interval '1 second')`,
      [MEDIA_POLICY],
    );
    const [assetId] = await seedAssets(bed.pool, 'prune', 1);
    const response = await signedWebhook(assetId!);
    assert.equal(response.status, 202, JSON.stringify(response.json));
    const stale = await bed.pool.query(`SELECT 1 FROM cleanup_webhook_signatures WHERE signature = 'stale-signature'`);
    assert.equal(stale.rowCount, 0, 'an accepted webhook prunes closed windows');
    const kept = await bed.pool.query<{ left_s: number }>(
      `SELECT extract(epoch FROM expires_at - now())::float8 AS left_s FROM cleanup_webhook_signatures WHERE signature <> 'stale-signature' ORDER BY seen_at DESC LIMIT 1`,
    );
    assert.ok(kept.rows[0]!.left_s > 300, `a new signature is kept past its window (${kept.rows[0]!.left_s} s left)`);
    await eventually('the operation confirmed', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.outcome === 'confirmed', { timeoutMs: 15_000 });
  });
});
