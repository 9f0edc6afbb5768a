import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { startS3StandIn, type S3StandIn } from '../../tools/s3-stand-in/server';
import { eventually } from '../support/eventually';
import { batchReceipt, bedAndBrokerSuite, publishBatch, startInProcessWorker, type BedAndBroker } from '../support/fixtures';
import { holdRemoteBatchKeeps, releaseHeldLocks, workersWaitingOnBatchKeep } from '../support/locks';
import { ledgerDiagnosis, ledgerRows, ledgerSummary, MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { batchFor, S3_BUCKET, s3Environment, s3PolicyYaml } from '../support/s3-helpers';

/**
 * The bookkeeping gate (services/worker/bookkeeping-gate.ts) as the remote handlers use it: a
 * worker whose pool has two connections, a batch at the head of the line that has made its first
 * call, and two later deliveries whose bookkeeping (recordRemoteBatch) cannot finish. With the
 * gate, one of them waits on a connection and the other in the gate, so the head batch still has
 * a connection for its outcome and its next admission ask, and its next call reaches the remote
 * while the later ones are still held. Without it, the two later deliveries hold both connections
 * and the head batch makes no call until they are let go.
 *
 * What holds the later deliveries: their batch ids' rows of cleanup_remote_batches, inserted by
 * the test and not committed (test/support/locks.ts holdRemoteBatchKeeps). recordRemoteBatch's
 * last statement (remoteBatchesKeep) waits for them; nothing the head batch does from its
 * admission on waits for them.
 *
 * No step depends on how fast anything runs. The head batch's first call is held at the remote
 * until the test lets it go, so the head batch needs a connection again exactly then. Before
 * that, the test knows both later deliveries have been given to their handler: after them it
 * publishes a message that is not a batch, and waits until the worker has dead-lettered it. The
 * broker hands one queue's messages to the worker's consumer in order and amqplib calls the
 * consumer in that order; a delivery reaches the gate (or, without it, the pool's queue, which
 * is first come first served) with no I/O on the way (these policies have no expiry events: the
 * outbox check asks nothing), so both later deliveries are there before the marker's dead-letter
 * publish leaves, long before the held answer can come back. The one bound in play is the head
 * batch's own hold (HOLD_BATCH_MAX_MS, 8 s from its delivery to its next call; under 1 s here).
 *
 * Checked by calling recordRemoteBatch without `bookkeeping.run` in each handler: that handler's
 * test then fails at "the head batch's next call" (both later deliveries wait on a connection).
 * The gate around the line reads (ledgerDueSummary) is not what this holds: a plain read of
 * cleanup_ledger waits only for a lock that would hold the admission's claim as well.
 */

/** The pool of the worker under test: the gate lets one delivery's bookkeeping run at a time. */
const POOL_SIZE = 2;
/** The later deliveries: more than the gate's slots, as many as the pool's connections. */
const LATER_BATCHES = 2;

/** The remote as the scenario drives it: its answers held until letGo(), and the calls (requests) that reached it. */
interface HeldRemote {
  hold(): void;
  /** Stops holding answers and sends the held ones. */
  letGo(): void;
  arrived(): number;
}

/**
 * The scenario, for the policy of the bed's current policies file: `headItems` operations in the
 * head batch, one per later batch; the policy makes one call (request) per operation, one at a time.
 */
async function headBatchGoesOnWhileBookkeepingWaits(world: BedAndBroker, remote: HeldRemote, headItems: number): Promise<void> {
  const { bed, broker, names } = world;
  const headAssets = await seedAssets(bed.pool, 'head', headItems);
  const laterAssets = await Promise.all(Array.from({ length: LATER_BATCHES }, (_, i) => seedAssets(bed.pool, `later-${i}`, 1)));
  const worker = await startInProcessWorker(bed, {
    REAPER_DB_POOL_SIZE: String(POOL_SIZE),
    // The held deliveries wait for the test, not for the default 5 s lock timeout.
    REAPER_LOCK_TIMEOUT_MS: '60000',
    REAPER_WORKER_ID: `gate-${randomUUID().slice(0, 8)}`,
  });
  const progress = async () => ({ ...(await ledgerDiagnosis(bed.pool)), arrived: remote.arrived(), waitingOnKeep: await workersWaitingOnBatchKeep(bed.pool) });
  try {
    remote.hold();
    const head = await batchFor(bed.pool, headAssets);
    await publishBatch(broker, names, head);
    // Recorded, its place in line read, admitted: it now needs a connection for nothing but the rate's path.
    await eventually("the head batch's first call to reach the remote", () => remote.arrived() === 1, { intervalMs: 20, describe: progress });

    const later = await Promise.all(laterAssets.map((assets) => batchFor(bed.pool, assets)));
    const keeps = await holdRemoteBatchKeeps(bed.pool, later);
    for (const batch of later) await publishBatch(broker, names, batch);
    await broker.publish(names.workExchange, MEDIA_POLICY, 'not a batch', { messageId: `marker-${randomUUID()}` });
    await eventually(
      "the marker dead-lettered (every later delivery handed to its handler) and a later delivery's bookkeeping waiting on the held rows",
      async () => (await broker.messageCount(names.deadLetterQueue)) === 1 && (await workersWaitingOnBatchKeep(bed.pool)) >= 1,
      { intervalMs: 20, describe: progress },
    );

    remote.letGo();
    // With the gate it comes within milliseconds; the bound only ends a failure before the head batch's 8 s hold would.
    await eventually("the head batch's next call to reach the remote while the later deliveries' bookkeeping is held", () => remote.arrived() >= 2, {
      timeoutMs: 5_000,
      intervalMs: 20,
      describe: progress,
    });
    assert.equal(await workersWaitingOnBatchKeep(bed.pool), POOL_SIZE - 1, 'one later delivery waits on a connection, the other in the gate');
    assert.deepEqual(
      (await ledgerRows(bed.pool)).map((row) => row.asset_id),
      headAssets,
      'the later batches are not recorded yet: only the head batch has operations',
    );

    await keeps.release();
    const operations = headItems + LATER_BATCHES;
    await eventually(`all ${operations} operations confirmed`, async () => (await ledgerSummary(bed.pool))['done/confirmed'] === operations, { describe: progress });
    for (const batch of [head, ...later]) {
      await eventually(`the receipt of ${batch.batchId}`, () => batchReceipt(bed.pool, batch.batchId), { describe: progress });
    }
    assert.equal(remote.arrived(), operations, 'one call (request) per operation');
  } finally {
    // Whatever failed: the held deliveries and answers go on, so the worker drains and stops.
    await releaseHeldLocks();
    remote.letGo();
    await worker.stop();
  }
}

describe('remote-delete (HTTP): the head batch calls on while later deliveries record', () => {
  const world = bedAndBrokerSuite('remote_bookkeeping_gate_http', { first: releaseHeldLocks });
  let api: MediaApi | undefined;
  before(async () => {
    api = await startMediaApi();
    // One call at a time, so the head batch's next one waits for the held answer; a rate far above what is used.
    world.bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 4, concurrency: 1, timeoutMs: 10_000, leaseMs: 20_000 }));
  });
  after(() => api?.close());

  test("the head batch's next call reaches the API while two later deliveries' bookkeeping waits", async () => {
    const stand = api!;
    await headBatchGoesOnWhileBookkeepingWaits(
      world,
      {
        hold: () => stand.configure({ hold: true }),
        letGo: () => {
          stand.configure({ hold: false });
          stand.release();
        },
        arrived: () => stand.calls.length,
      },
      3,
    );
  });
});

describe('remote-delete (object storage): the head batch sends on while later deliveries record', () => {
  const world = bedAndBrokerSuite('remote_bookkeeping_gate_s3', { first: releaseHeldLocks });
  let stand: S3StandIn | undefined;
  const savedEnv = { ...process.env };
  before(async () => {
    stand = await startS3StandIn({ bucket: S3_BUCKET });
    // The SDK's default credential chain reads the environment: the stand-in's development pair.
    Object.assign(process.env, s3Environment(stand));
    // One key per request and one request at a time, so the head batch's next request waits for the held answer.
    world.bed.writePolicies(s3PolicyYaml({ endpoint: stand.endpoint, requestsPerSecond: 20, keysPerSecond: 20, concurrency: 1, maxKeysPerRequest: 1, timeoutMs: 10_000, leaseMs: 20_000 }));
  });
  after(async () => {
    process.env = savedEnv;
    await stand?.close();
  });

  test("the head batch's next request reaches the store while two later deliveries' bookkeeping waits", async () => {
    const store = stand!;
    await headBatchGoesOnWhileBookkeepingWaits(
      world,
      {
        hold: () => (store.holdAnswers = true),
        letGo: () => {
          store.holdAnswers = false;
          store.releaseAnswers();
        },
        arrived: () => store.deleteCalls().length,
      },
      2,
    );
  });
});
