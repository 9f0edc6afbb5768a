import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { signWebhook } from '../../services/scheduler/webhooks';
import { eventually } from '../support/eventually';
import { startMediaApi, type MediaApi } from '../support/media-api';
import { assertNoLeakedProcesses, runReaperCli, type ReaperProcess } from '../support/processes';
import {
  assertRetention,
  callsByKey,
  currentKeyOf,
  errorsLogged,
  ledgerRows,
  MEDIA_POLICY,
  mediaPolicyYaml,
  seedAssets,
  startSchedulerProcess,
  started,
  startWorkerProcess,
  stopStarted,
} from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * POST /webhooks/<policy> on the scheduler (DESIGN.md "HTTP"; issue: webhooks converge on the same
 * key as the scan). A webhook and a scan for the same asset make ONE operation, whichever comes
 * first, and the remote is called once. A wrong signature, a tampered body, a missing signature or
 * a timestamp more than 5 minutes off is refused with 401 and changes nothing: no ledger row, no run.
 */
const SECRET = 'webhook-secret-for-tests-0123456789';

describe('remote-delete: webhooks', () => {
  let bed: TestBed;
  let api: MediaApi;
  let processes: ReaperProcess[] = [];
  let webhookUrl = '';

  before(async () => {
    bed = await makeTestBed('remote_webhook');
    api = await startMediaApi();
    bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 }));
    const scheduler = startSchedulerProcess(bed, 'webhook-scheduler', { HTTP_PORT: '0', REAPER_WEBHOOK_SECRET: SECRET });
    const worker = startWorkerProcess(bed, 'webhook-worker');
    processes = [scheduler, worker];
    const line = await scheduler.waitForLine('scheduler started', (l) => l.msg === 'scheduler started');
    assert.ok(Number(line.httpPort) > 0, `the scheduler reports its HTTP port (${String(line.httpPort)})`);
    webhookUrl = `http://127.0.0.1:${String(line.httpPort)}/webhooks/${MEDIA_POLICY}`;
    await started(worker, 'worker');
  });

  after(async () => {
    try {
      const exits = await Promise.all(processes.map((p) => p.stop()));
      for (const [index, exit] of exits.entries()) assert.equal(exit.code, 0, `${processes[index]!.label} drains and exits 0`);
      assert.deepEqual(errorsLogged(processes), []);
    } finally {
      try {
        await stopStarted();
        await assertNoLeakedProcesses();
      } finally {
        await api?.close();
        await bed?.close();
      }
    }
  });

  const nowSeconds = () => Math.floor(Date.now() / 1000);

  async function post(body: string, headers: Record<string, string>): Promise<{ status: number; json: Record<string, unknown> }> {
    const response = await fetch(webhookUrl, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body });
    return { status: response.status, json: (await response.json()) as Record<string, unknown> };
  }

  /** A correctly signed webhook for `id`. */
  function signedWebhook(id: string): Promise<{ status: number; json: Record<string, unknown> }> {
    const body = JSON.stringify({ id });
    const timestamp = String(nowSeconds());
    return post(body, { 'x-reaper-timestamp': timestamp, 'x-reaper-signature': signWebhook(SECRET, timestamp, body) });
  }

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
    const cases: Array<[string, Record<string, string>, string?]> = [
      ['signed with another secret', { 'x-reaper-timestamp': now, 'x-reaper-signature': signWebhook('some-other-secret-0123456789', now, body) }],
      ['signature of another body', { 'x-reaper-timestamp': now, 'x-reaper-signature': signWebhook(SECRET, now, JSON.stringify({ id: 'someone-else' })) }],
      ['signature over another timestamp', { 'x-reaper-timestamp': now, 'x-reaper-signature': signWebhook(SECRET, String(Number(now) - 1), body) }],
      ['signature missing', { 'x-reaper-timestamp': now }],
      ['signature not hex of HMAC', { 'x-reaper-timestamp': now, 'x-reaper-signature': 'sha256=deadbeef' }],
      ['timestamp 6 minutes old (correctly signed)', { 'x-reaper-timestamp': old, 'x-reaper-signature': signWebhook(SECRET, old, body) }],
      ['timestamp 6 minutes ahead (correctly signed)', { 'x-reaper-timestamp': future, 'x-reaper-signature': signWebhook(SECRET, future, body) }],
      ['timestamp missing', { 'x-reaper-signature': signWebhook(SECRET, now, body) }],
    ];
    for (const [name, headers] of cases) {
      const response = await post(body, headers);
      assert.equal(response.status, 401, `${name}: 401 (got ${response.status} ${JSON.stringify(response.json)})`);
    }
    assert.equal(await ledgerCount(), ledgerBefore, 'no ledger row');
    assert.equal(await runCount(), runsBefore, 'no run');

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
});
