import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { runReaperCli, type ReaperProcess } from '../support/processes';
import {
  assertRetention,
  assetStatuses,
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
 * docs/design.md invariant 7: the operation key is derived from the retention decision
 * ('<policy>:<id>:<observed expiry>'). An asset deleted, then restored and expired again, is a NEW
 * decision: a new key, a new operation, a second deletion, while the first operation stays done as
 * it was. And the other side of it: an asset renewed while its operation still waits is not
 * deleted (the pending operation is superseded, no call is made).
 */
describe('remote-delete: restored and renewed assets', () => {
  let bed: TestBed;
  let api: MediaApi;
  let processes: ReaperProcess[] = [];

  before(async () => {
    bed = await makeTestBed('remote_restore');
    api = await startMediaApi();
    bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 }));
    processes = [startSchedulerProcess(bed, 'restore-scheduler'), startWorkerProcess(bed, 'restore-worker')];
    await Promise.all([started(processes[0]!, 'scheduler'), started(processes[1]!, 'worker')]);
  });

  after(async () => {
    try {
      await stopAllCleanly(processes);
    } finally {
      await closeRemoteWorld({ bed, api });
    }
  });

  /** Runs the policy and waits until the run completed (every batch settled). */
  async function runToCompletion(): Promise<void> {
    const result = await runReaperCli(['trigger', MEDIA_POLICY, '--wait', '--timeout', '30', '--json'], bed.processEnv());
    assert.equal(result.code, 0, result.stdout);
  }

  const confirmedKeys = async (assetId: string) =>
    (await ledgerRows(bed.pool, [assetId])).filter((row) => row.outcome === 'confirmed').map((row) => row.operation_key);

  test('deleted, restored with a new expiry, expired again: a new key, deleted again; the first operation stays done', async () => {
    const [assetId] = await seedAssets(bed.pool, 'restored', 1);
    const firstKey = await currentKeyOf(bed.pool, assetId!);
    await runToCompletion();
    await eventually('the first deletion confirmed', async () => (await confirmedKeys(assetId!)).length === 1);
    const [firstDone] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(firstDone!.operation_key, firstKey);
    assert.equal((await assetStatuses(bed.pool, [assetId!])).get(assetId!), 'deleted');
    assert.equal(api.executionsByKey().get(firstKey), 1);

    // A run now finds nothing: the row says deleted. No call, no new operation.
    await runToCompletion();
    assert.equal(api.calls.length, 1, 'nothing to do for a deleted asset');

    // Restored: the remote has it again, the row is active again and has expired again (a new expiry, microseconds included).
    api.restore(assetId!);
    await bed.pool.query(
      `UPDATE media_assets SET status = 'active', retention_expires_at = now() - interval '1 second' - random() * interval '1 millisecond', updated_at = now()
       WHERE asset_id = $1`,
      [assetId],
    );
    const secondKey = await currentKeyOf(bed.pool, assetId!);
    assert.notEqual(secondKey, firstKey, 'a new retention decision has a new key');

    await runToCompletion();
    await eventually('the second deletion confirmed', async () => (await confirmedKeys(assetId!)).length === 2, {
      describe: () => ledgerRows(bed.pool, [assetId!]),
    });

    const rows = await ledgerRows(bed.pool, [assetId!]);
    assert.deepEqual(rows.map((row) => row.operation_key).sort(), [firstKey, secondKey].sort(), 'two operations, one per retention decision');
    assert.deepEqual(rows.find((row) => row.operation_key === firstKey), firstDone, 'the first operation stays done, untouched');
    const second = rows.find((row) => row.operation_key === secondKey)!;
    assert.equal(second.state, 'done');
    assert.equal(second.outcome, 'confirmed');
    assertRetention(rows);

    assert.deepEqual(
      api.calls.filter((call) => call.id === assetId).map((call) => [call.key, call.status, call.executed]),
      [
        [firstKey, 200, true],
        [secondKey, 200, true],
      ],
      'the stand-in deleted the asset twice, once per key (not an idempotent replay of the first key)',
    );
    assert.equal(api.executionsByKey().get(secondKey), 1);
    assert.ok(api.deletedIds().has(assetId!));
    assert.equal((await assetStatuses(bed.pool, [assetId!])).get(assetId!), 'deleted');
  });

  test('an asset renewed while its operation waits (paused) is not deleted: the operation is superseded, no call', async () => {
    const [assetId] = await seedAssets(bed.pool, 'renewed', 1);
    const key = await currentKeyOf(bed.pool, assetId!);
    const callsBefore = api.calls.length;
    assert.equal((await runReaperCli(['pause', MEDIA_POLICY], bed.processEnv())).code, 0);
    try {
      assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);
      await eventually('the operation recorded and waiting', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.state === 'pending');
      // Renewed: the retention decision no longer holds.
      await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '30 days' WHERE asset_id = $1`, [assetId]);
    } finally {
      assert.equal((await runReaperCli(['resume', MEDIA_POLICY], bed.processEnv())).code, 0);
    }
    await eventually('the waiting operation to be finished', async () => (await ledgerRows(bed.pool, [assetId!]))[0]?.state === 'done', {
      timeoutMs: 15_000,
      describe: () => ledgerRows(bed.pool, [assetId!]),
    });
    const [row] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(row!.operation_key, key);
    assert.equal(row!.outcome, 'superseded');
    assert.equal(row!.attempt_count, 0, 'no cleanup attempt');
    assert.equal(callsByKey(api).get(key), undefined, 'no call for a renewed asset');
    assert.equal(api.calls.length, callsBefore);
    assert.equal((await assetStatuses(bed.pool, [assetId!])).get(assetId!), 'active', 'the renewed asset is kept');
  });
});
