import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { type MediaApi } from '../../tools/media-api/server';
import { ODD_IDS } from '../support/odd-ids';
import { runReaperCli, type ReaperProcess } from '../support/processes';
import {
  assertRetention,
  assetStatuses,
  closeRemoteWorld,
  currentKeyOf,
  ledgerDiagnosis,
  ledgerRows,
  MEDIA_POLICY,
  openRemoteWorld,
  startSchedulerProcess,
  started,
  startWorkerProcess,
} from '../support/remote-helpers';
import type { TestBed } from '../support/testbed';
import { stopAllCleanly } from '../support/fixtures';

/**
 * Issue 7 item 3, end to end: assets whose ids are `.`, `..`, `a/b`, `%2F`, `x?y#z`, a space, `€`,
 * CJK and friends, deleted by a real scheduler and worker through the media-assets policy
 * (path /assets/{id}). Each one's DELETE reaches exactly its own address at the stand-in, once,
 * with its own Idempotency-Key; nothing lands on another route (a 404 there would have been taken
 * for "already deleted"); the ledger says confirmed and the row says deleted. Nothing is
 * uncertain or gave up (a header that cannot be sent used to throw inside fetch).
 */
describe('remote-delete: ids that are not URL-safe', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    ({ bed, api } = await openRemoteWorld('remote_odd_ids', { ratePerSecond: 50, burst: 20, concurrency: 4, batchSize: 5, timeoutMs: 2000, leaseMs: 15_000 }));
  });

  after(() => closeRemoteWorld({ bed, api }));

  test('every asset is deleted at its own address, once, and the ledger confirms it', async () => {
    await bed.pool.query(
      `INSERT INTO media_assets (asset_id, status, retention_expires_at, url, metadata)
       SELECT id, 'active', now() - interval '1 hour' + random() * interval '1 millisecond', 'https://media.example/x.mp4', '{}'::jsonb
       FROM unnest($1::text[]) AS id`,
      [ODD_IDS],
    );
    // A neighbour at the address '..' or '.' would collapse to: it must not be touched.
    await bed.pool.query(`INSERT INTO media_assets (asset_id, status, retention_expires_at) VALUES ('bystander', 'active', now() + interval '30 days')`);
    const keys = new Map<string, string>();
    for (const id of ODD_IDS) keys.set(id, await currentKeyOf(bed.pool, id));

    const processes: ReaperProcess[] = [startSchedulerProcess(bed, 'odd-scheduler'), startWorkerProcess(bed, 'odd-worker')];
    await Promise.all([started(processes[0]!, 'scheduler'), started(processes[1]!, 'worker')]);
    const triggered = await runReaperCli(['trigger', MEDIA_POLICY, '--wait', '--timeout', '30', '--json'], bed.processEnv());
    assert.equal(triggered.code, 0, triggered.stdout);
    await eventually('every operation finished', async () => (await ledgerRows(bed.pool, ODD_IDS)).every((row) => row.state === 'done'), {
      timeoutMs: 20_000,
      describe: () => ledgerDiagnosis(bed.pool),
    });

    const rows = await ledgerRows(bed.pool, ODD_IDS);
    assert.deepEqual(
      rows.map((row) => [row.asset_id, row.operation_key, row.outcome, row.last_result]).sort(),
      ODD_IDS.map((id) => [id, keys.get(id)!, 'confirmed', 'HTTP 200']).sort(),
      'one confirmed operation per asset, confirmed by a 200 of a real deletion (not a 404 of some other route)',
    );
    assertRetention(rows);
    assert.deepEqual(
      api.calls.map((call) => [call.id, call.key, call.status, call.executed]).sort(),
      ODD_IDS.map((id) => [id, keys.get(id)!, 200, true]).sort(),
      'each asset called once, at its own address, with its own key; no other call',
    );
    assert.deepEqual(api.deletedIds(), new Set(ODD_IDS));
    for (const id of ODD_IDS) assert.equal(api.executionsByKey().get(keys.get(id)!), 1, `${id}: executed once`);
    const statuses = await assetStatuses(bed.pool, [...ODD_IDS, 'bystander']);
    for (const id of ODD_IDS) assert.equal(statuses.get(id), 'deleted', `${id}: the row says deleted`);
    assert.equal(statuses.get('bystander'), 'active');

    await stopAllCleanly(processes);
  });
});
