import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startS3StandIn, type S3StandIn } from '../../tools/s3-stand-in/server';
import { eventually } from '../support/eventually';
import { runReaperCli } from '../support/processes';
import {
  assertRetention,
  assetStatuses,
  closeRemoteWorld,
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
import { auditCounts, objectExists, putObjects, s3Environment, s3PolicyYaml } from '../support/s3-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Object storage: a worker process SIGKILLed by its own failpoint right after the DeleteObjects
 * answer arrived and before any key's outcome was recorded. The store deleted the objects; the
 * ledger still says in_flight under the dead worker's lease. Once the lease expires a fresh worker
 * re-checks the keys in its claim and sends the SAME keys again (deleting an absent key succeeds):
 * nothing is deleted twice, the ledger ends done/confirmed with two attempts, one audit row each.
 */
const LEASE_MS = 11_000; // the shortest lease allowed: remote.timeoutMs + 10 s
const ASSETS = 3;

describe('object storage: worker killed between the DeleteObjects request and recording its outcome', () => {
  let bed: TestBed;
  let stand: S3StandIn;

  before(async () => {
    bed = await makeTestBed('fault_s3_crash');
    stand = await startS3StandIn({ bucket: 'media-bucket' });
    // One request in flight at a time: the doomed worker sends exactly one before it dies.
    bed.writePolicies(s3PolicyYaml({ endpoint: stand.endpoint, requestsPerSecond: 20, keysPerSecond: 1000, concurrency: 1, batchSize: 10, maxKeysPerRequest: 10, timeoutMs: 1000, leaseMs: LEASE_MS }));
  });

  after(async () => {
    await closeRemoteWorld({ bed });
    await stand?.close();
  });

  test('the same keys are sent again after the lease expires; nothing deleted twice; ledger done; one audit row per object', async () => {
    const ids = await seedAssets(bed.pool, 's3crash', ASSETS);
    await putObjects(stand, ids);
    const env = s3Environment(stand);
    const scheduler = startSchedulerProcess(bed, 's3crash-scheduler');
    const doomed = startWorkerProcess(bed, 's3crash-doomed', { ...env, REAPER_TEST_FAILPOINT: 'after-remote-call' });
    await Promise.all([started(scheduler, 'scheduler'), started(doomed, 'worker')]);

    const trigger = await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv());
    assert.equal(trigger.code, 0, trigger.stdout);
    assert.deepEqual(await doomed.exited, { code: null, signal: 'SIGKILL' }, 'the worker dies by SIGKILL at its failpoint');

    const [first, ...others] = stand.deleteCalls();
    assert.equal(others.length, 0, 'exactly one DeleteObjects request before the crash');
    assert.equal(first!.status, 200);
    assert.deepEqual(first!.keys.slice().sort(), ids.map((id) => `media/${id}`), 'all three keys in one request');
    for (const id of ids) assert.equal(await objectExists(stand, id), false, `${id}: deleted by the store before the worker died`);
    const atCrash = await ledgerRows(bed.pool, ids);
    assert.deepEqual(atCrash.map((row) => `${row.state}/${row.lease_owner}/${row.attempt_count}`), ids.map(() => 'in_flight/s3crash-doomed/1'), 'the ledger knows nothing of the answer');
    assert.deepEqual([...(await assetStatuses(bed.pool, ids)).values()], ids.map(() => 'active'), 'no row settled');
    const leaseExpiresMs = Math.max(...atCrash.map((row) => row.lease_expires_ms!));

    const fresh = startWorkerProcess(bed, 's3crash-fresh', env);
    await started(fresh, 'worker');
    await eventually(`all ${ASSETS} operations confirmed`, async () => (await ledgerSummary(bed.pool))['done/confirmed'] === ASSETS, {
      timeoutMs: 25_000,
      intervalMs: 200,
      describe: async () => ({ ...(await ledgerDiagnosis(bed.pool)), calls: stand.deleteCalls().map((call) => [call.keys.length, call.status]) }),
    });

    const calls = stand.deleteCalls();
    assert.equal(calls.length, 2, 'one retry request');
    assert.deepEqual(calls[1]!.keys.slice().sort(), first!.keys.slice().sort(), 'the retry carries the same keys');
    assert.ok(calls[1]!.arrivedAt >= leaseExpiresMs - 5, `the retry waited for the leases to expire (retry at ${calls[1]!.arrivedAt}, lease ${Math.round(leaseExpiresMs)})`);
    const rows = await ledgerRows(bed.pool, ids);
    assert.deepEqual(rows.map((row) => `${row.state}/${row.outcome}/${row.attempt_count}`), ids.map(() => 'done/confirmed/2'), 'two attempts: the crashed request and the retry');
    for (const row of rows) assert.ok(row.delivery_count >= 2, `${row.operation_key}: delivered again after the crash`);
    assertRetention(rows);
    const audits = await auditCounts(bed.pool);
    assert.deepEqual(ids.map((id) => audits.get(id)), ids.map(() => 1), 'one audit row per deleted object');
    assert.deepEqual([...(await assetStatuses(bed.pool, ids)).values()], ids.map(() => 'deleted'), 'every asset row settled');

    const exits = await Promise.all([scheduler.stop(), fresh.stop()]);
    for (const exit of exits) assert.equal(exit.code, 0);
    assert.deepEqual(errorsLogged([scheduler, fresh]), []);
  });
});
