import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { type MediaApi } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import {
  assertRetention,
  closeRemoteWorld,
  openRemoteWorld,
  assetStatuses,
  callsByKey,
  errorsLogged,
  ledgerDiagnosis,
  ledgerRows,
  ledgerSummary,
  MEDIA_POLICY,
  seedAssets,
  startSchedulerProcess,
  started,
  startWorkerProcess,
} from '../support/remote-helpers';
import type { TestBed } from '../support/testbed';

/**
 * A worker process SIGKILLed by its own failpoint right after the remote API answered and before
 * the outcome was recorded (docs/design.md invariants 7, 8 and 11). The ledger still says in_flight
 * under the dead worker's lease; the remote has already deleted the asset. Once the lease expires
 * a fresh worker calls again with the SAME Idempotency-Key: the stand-in sees the key twice,
 * executes it once (the second answer is its idempotent replay), and the ledger ends done/confirmed
 * with two cleanup attempts.
 */
const LEASE_MS = 11_000; // the shortest lease allowed: remote.timeoutMs + 10 s
const TIMEOUT_MS = 1_000;
const ASSETS = 3;

describe('remote-delete: worker killed between the remote call and recording its outcome', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    // Concurrency 1: the doomed worker makes exactly one call before it dies.
    ({ bed, api } = await openRemoteWorld('fault_remote_crash', { ratePerSecond: 20, burst: 5, concurrency: 1, batchSize: 10, timeoutMs: TIMEOUT_MS, leaseMs: LEASE_MS }));
  });

  after(() => closeRemoteWorld({ bed, api }));

  test('the operation is retried with the same key after the lease expires; deleted once; ledger done', async () => {
    const ids = await seedAssets(bed.pool, 'crash', ASSETS);
    const scheduler = startSchedulerProcess(bed, 'crash-scheduler');
    const doomed = startWorkerProcess(bed, 'crash-doomed', { REAPER_TEST_FAILPOINT: 'after-remote-call' });
    await Promise.all([started(scheduler, 'scheduler'), started(doomed, 'worker')]);

    const trigger = await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv());
    assert.equal(trigger.code, 0, trigger.stdout);

    const exit = await doomed.exited;
    assert.deepEqual(exit, { code: null, signal: 'SIGKILL' }, 'the worker dies by SIGKILL at its failpoint');
    assert.equal(api.calls.length, 1, 'exactly one call was made before the crash');
    const first = api.calls[0]!;
    assert.equal(first.status, 200);
    assert.equal(first.executed, true, 'the remote deleted the asset before the worker died');
    const key = first.key!;
    const crashedId = first.id;

    // The ledger knows nothing of the answer: the operation is in flight under the dead worker's lease.
    const [atCrash] = await ledgerRows(bed.pool, [crashedId]);
    assert.ok(atCrash, 'the operation is in the ledger');
    assert.equal(atCrash.operation_key, key, 'the call carried the ledger operation key');
    assert.equal(atCrash.state, 'in_flight');
    assert.equal(atCrash.outcome, null);
    assert.equal(atCrash.lease_owner, 'crash-doomed');
    assert.equal(atCrash.attempt_count, 1);
    assert.notEqual(atCrash.payload, null, 'an unconfirmed operation keeps its payload');
    assert.equal((await assetStatuses(bed.pool, [crashedId])).get(crashedId), 'active', 'the row is not marked: the outcome was never recorded');
    const leaseExpiresMs = atCrash.lease_expires_ms!;

    // A fresh worker without the failpoint gets the unacked batch back from the broker.
    const fresh = startWorkerProcess(bed, 'crash-fresh');
    await started(fresh, 'worker');
    await eventually(
      `all ${ASSETS} operations confirmed`,
      async () => (await ledgerSummary(bed.pool))['done/confirmed'] === ASSETS,
      { timeoutMs: 20_000, intervalMs: 200, describe: async () => ({ ...(await ledgerDiagnosis(bed.pool)), calls: api.calls.map((c) => [c.id, c.status]) }) },
    );

    const callsForKey = callsByKey(api).get(key)!;
    assert.equal(callsForKey.length, 2, 'the stand-in saw the crashed key twice');
    assert.ok(
      callsForKey[1]!.startedAt >= leaseExpiresMs,
      `the retry waited for the lease to expire (retry at ${callsForKey[1]!.startedAt}, lease expired at ${Math.round(leaseExpiresMs)})`,
    );
    assert.equal(callsForKey[1]!.executed, false, 'the second call was an idempotent replay, not a second deletion');
    assert.equal(api.executionsByKey().get(key), 1, 'deleted once');
    assert.deepEqual(
      api.calls.filter((call) => call.id === crashedId).map((call) => call.key),
      [key, key],
      'every call for the crashed asset carried the same key',
    );

    const rows = await ledgerRows(bed.pool);
    assert.deepEqual(rows.map((row) => row.asset_id).sort(), ids, 'one operation per asset');
    const crashed = rows.find((row) => row.operation_key === key)!;
    assert.equal(crashed.state, 'done');
    assert.equal(crashed.outcome, 'confirmed');
    assert.equal(crashed.attempt_count, 2, 'two cleanup attempts: the crashed call and the retry');
    assert.ok(crashed.delivery_count >= 2, `the batch was delivered again after the crash (delivery_count ${crashed.delivery_count})`);
    for (const row of rows.filter((r) => r.operation_key !== key)) {
      assert.equal(row.outcome, 'confirmed');
      assert.equal(row.attempt_count, 1, `${row.operation_key}: untouched by the crash, one attempt`);
      assert.equal(api.executionsByKey().get(row.operation_key), 1);
    }
    assertRetention(rows);
    assert.deepEqual([...(await assetStatuses(bed.pool, ids)).values()], ids.map(() => 'deleted'), 'every asset row marked deleted');

    const exits = await Promise.all([scheduler.stop(), fresh.stop()]);
    for (const exit of exits) assert.equal(exit.code, 0);
    assert.deepEqual(errorsLogged([scheduler, fresh]), []);
  });
});
