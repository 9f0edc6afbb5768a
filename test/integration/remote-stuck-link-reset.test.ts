import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import amqp, { type ChannelModel } from 'amqplib';
import type pg from 'pg';
import pino from 'pino';
import { fixedConnection, ConfirmingPublisher } from '../../shared/amqp/publisher';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { parsePolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import type { BatchV1 } from '../../shared/contracts/batch';
import { makePool } from '../../shared/db/pool';
import { ledgerReturnExpiredLeases } from '../../shared/db/queries/ledger';
import { runsSettlePublished } from '../../shared/db/queries/runs';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeHttpRemoteClient } from '../../shared/remote/client';
import { classifyHandlerError } from '../../services/worker/errors';
import { makeRemoteDeleteHandler } from '../../services/worker/handlers/remote-delete';
import type { BatchHandler, HandlerContext } from '../../services/worker/handlers/types';
import { CARRY_STALE_MS, sweepPolicy } from '../../services/worker/ledger-sweeper';
import type { BatchResult } from '../../services/worker/results';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { openTestBroker, type TestBroker } from '../support/broker';
import { MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { TcpProxy } from '../support/tcp-proxy';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 43, the chaos "stuck 1" (seed 1304545059, 2026-12-02: a run of the HTTP remote policy
 * stayed `published` through the 180 s settle with nothing lost, no operation open and the queues
 * empty): the interleaving of that run's faults that leaves a remote run `published` with its
 * work done by another batch, replayed step by step with the real fault.
 *
 *  1. Run 1's batch B calls the API (the asset is deleted) and records the confirmation; the
 *     PostgreSQL link is reset mid-statement (chaos `pg-link-reset`, its replies held after
 *     `UPDATE cleanup_ledger`): the transaction never commits, the operation stays in flight under
 *     B's claim, and the delivery fails as "database unavailable" (given back to the broker).
 *  2. Run 2 scanned the asset before B's delivery recorded it, so its batch C carries it too: C
 *     finds the operation in flight under B's live lease and is parked (acked, kept, no receipt).
 *  3. B comes back from the broker and is parked behind its own dead claim (acked, no receipt).
 *  4. The lease runs out; the reclaimer gives the operation back; the ledger sweeper sends B's kept
 *     message; B calls again with the same key (the API replays its answer: deleted once) and
 *     writes its receipt: run 1 completes.
 *  5. C's operation was finished by B's claim: nothing pending names C, so without the sweeper's
 *     orphan look (526cbbd, 2026-12-01: a kept batch none of whose operations is open is sent again
 *     once kept 30 s) C never gets a receipt and run 2 stays `published` (until incompleteAfter,
 *     an hour). With it, C is sent again, its delivery writes the receipt, run 2 completes.
 * Timers (the lease, the 30 s a kept batch waits) are moved back in the database, not slept.
 */
describe('remote-delete: a confirmation cut by a PostgreSQL link reset, and a later run carrying the same asset: both runs complete', () => {
  let bed: TestBed;
  let api: MediaApi;
  let proxy: TcpProxy;
  /** Worker 1's pool goes through the fault proxy; worker 2's goes straight to PostgreSQL. Both log in as the worker role. */
  let cut: pg.Pool;
  let direct: pg.Pool;
  let policy: RemoteDeletePolicy;
  let target: ResolvedTarget;
  let handle: BatchHandler;

  before(async () => {
    bed = await makeTestBed('remote_stuck_link');
    api = await startMediaApi();
    const yaml = mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 200, burst: 50, concurrency: 8, batchSize: 10, timeoutMs: 2000 });
    bed.writePolicies(yaml);
    policy = parsePolicies(yaml, 'test-policies.yaml', {}).get(MEDIA_POLICY) as RemoteDeletePolicy;
    target = await targetResolve(bed.pool, policy);
    handle = makeRemoteDeleteHandler(policy, target, makeHttpRemoteClient(policy.remote));
    const workerUrl = bed.as(bed.env(), 'worker').databaseUrl;
    const database = new URL(workerUrl);
    proxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
    cut = makePool(proxy.urlFor(workerUrl), 2, 'reaper-worker');
    cut.on('error', () => undefined); // the reset link's idle client reports here; the test reads the delivery's own error
    direct = makePool(workerUrl, 2, 'reaper-worker');
  });

  after(async () => {
    await cut?.end().catch(() => undefined); // a client of the reset link may already be gone
    await direct?.end();
    await proxy?.close();
    await api?.close();
    await bed?.close();
  });

  const context = (pool: pg.Pool, workerId: string): HandlerContext => ({
    pool,
    workerId,
    log: pino({ level: 'silent' }),
    metrics: makeMetrics(),
    deliveryCount: 1,
    failpoint: () => undefined,
  });
  /** One delivery as deliveries.ts takes it: a handler's throw is classified. */
  const deliver = (batch: BatchV1, pool: pg.Pool, workerId: string): Promise<BatchResult> => handle(batch, context(pool, workerId)).catch(classifyHandlerError);
  const receiptOf = async (batchId: string) => (await bed.pool.query<{ deleted: number }>(`SELECT deleted FROM cleanup_batches WHERE batch_id = $1`, [batchId])).rows[0];
  const kept = async (batchId: string) => (await bed.pool.query(`SELECT 1 FROM cleanup_remote_batches WHERE batch_id = $1`, [batchId])).rowCount === 1;
  const runState = async (runId: string) => (await bed.pool.query<{ state: string }>(`SELECT state FROM cleanup_runs WHERE run_id = $1`, [runId])).rows[0]!.state;
  /** The scheduler's completion pass (its own statement), as often as a test step needs. */
  const settleRuns = () => runsSettlePublished(bed.pool, { limit: 10, incompleteAfterMs: 3_600_000 });

  test('B is sent again after its lease and C as an orphan: each writes its receipt, both runs complete, the asset deleted once', async () => {
    const connection: ChannelModel = await amqp.connect(bed.amqpUrl);
    const broker: TestBroker = await openTestBroker(bed.amqpUrl);
    try {
      const channel = await connection.createChannel();
      await assertTopology(channel, makeTopology({ prefix: bed.prefix, policies: [MEDIA_POLICY], deliveryLimit: 20 }));
      await channel.close();
      const names = brokerNames(bed.prefix);
      const publisher = new ConfirmingPublisher(fixedConnection(connection), 5_000);
      const sweep = async (): Promise<string[]> => {
        await sweepPolicy({ pool: direct, publisher, names, registry: makeMetrics().registry }, policy, target);
        return (await broker.drain(names.workQueue(MEDIA_POLICY))).map((message) => message.properties.messageId as string);
      };

      const [assetId] = await seedAssets(bed.pool, 'cut', 1);
      const { key, observedExpiry, cutoff } = (
        await bed.pool.query<{ key: string; observedExpiry: string; cutoff: string }>(
          `SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at) AS key, reaper_iso(retention_expires_at) AS "observedExpiry",
                  reaper_iso(clock_timestamp()) AS cutoff
           FROM media_assets WHERE asset_id = $2`,
          [MEDIA_POLICY, assetId],
        )
      ).rows[0]!;
      // Two published runs of the policy, one batch each, both carrying the asset (as the
      // scheduler leaves them: the batch ids its checkpoint recorded are what completion waits for).
      const batchOf = (runId: string, name: string): BatchV1 => ({
        version: 1,
        runId,
        batchId: `${runId}:${name}`,
        policy: MEDIA_POLICY,
        cutoff,
        items: [{ id: assetId!, observedExpiry }],
      });
      const [b, c] = [batchOf(randomUUID(), 'B'), batchOf(randomUUID(), 'C')];
      for (const batch of [b, c]) {
        await bed.pool.query(
          `INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, state, published_at, candidates, batches_confirmed)
           VALUES ($1, $2, 'cron', clock_timestamp(), $3, 'published', clock_timestamp(), 1, 1)`,
          [batch.runId, MEDIA_POLICY, cutoff],
        );
        await bed.pool.query(`INSERT INTO cleanup_run_batches (batch_id, run_id) VALUES ($1, $2)`, [batch.batchId, batch.runId]);
      }

      // 1. B on worker 1: the call is made, the confirmation's transaction is cut mid-statement.
      const reset = proxy.holdRepliesAfter(/UPDATE cleanup_ledger SET state = 'done'/).then((link) => proxy.reset(link));
      const first = await deliver(b, cut, 'worker-1');
      await reset;
      assert.equal(first.kind, 'unknown', JSON.stringify(first));
      assert.equal(first.kind === 'unknown' && first.databaseUnavailable, true, `an outage: the worker pauses and gives B back (${JSON.stringify(first)})`);
      assert.equal(api.executionsByKey().get(key), 1, 'the API deleted the asset');
      const inFlight = (await bed.pool.query<{ state: string; lease_owner: string; claim_batch_id: string }>(`SELECT state, lease_owner, claim_batch_id FROM cleanup_ledger WHERE operation_key = $1`, [key])).rows[0];
      assert.deepEqual(inFlight, { state: 'in_flight', lease_owner: 'worker-1', claim_batch_id: b.batchId }, 'the confirmation never committed: in flight under B\'s claim');

      // 2. C (run 2) on worker 2: parked behind B's live lease.
      const parkedC = await deliver(c, direct, 'worker-2');
      assert.equal(parkedC.kind, 'done', JSON.stringify(parkedC));
      assert.equal(await receiptOf(c.batchId), undefined, 'C parked: no receipt');
      assert.equal(await kept(c.batchId), true, 'C kept');
      // 3. B back from the broker (worker 1 consumes again once SELECT 1 answers): parked behind its own claim.
      const parkedB = await deliver(b, cut, 'worker-1');
      assert.equal(parkedB.kind, 'done', JSON.stringify(parkedB));
      assert.equal(await receiptOf(b.batchId), undefined, 'B parked: no receipt');
      await settleRuns();
      assert.deepEqual([await runState(b.runId), await runState(c.runId)], ['published', 'published']);
      assert.deepEqual(await sweep(), [], 'nothing to send while the operation is in flight under a live lease');

      // 4. The lease runs out (moved back, not slept): the reclaimer gives the operation back and
      // the sweeper sends B's kept message, which calls again with the same key.
      await bed.pool.query(`UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE operation_key = $1`, [key]);
      assert.equal(await ledgerReturnExpiredLeases(direct), 1, 'the reclaimer gave the operation back');
      assert.deepEqual(await sweep(), [b.batchId], 'the sweeper sends B (the operation is recorded under B)');
      const doneB = await deliver(b, direct, 'worker-2');
      assert.equal(doneB.kind, 'done', JSON.stringify(doneB));
      assert.deepEqual(await receiptOf(b.batchId), { deleted: 1 }, 'B has its receipt, with its own confirmation');
      assert.equal(api.executionsByKey().get(key), 1, 'the second call was answered from the idempotency record: deleted once');
      await settleRuns();
      assert.equal(await runState(b.runId), 'completed', 'run 1 completes');

      // 5. C: kept, its operation finished by B's claim. Once kept longer than a carried copy may
      // take (moved back), the sweeper sends it again; its delivery writes the receipt.
      await bed.pool.query(`UPDATE cleanup_remote_batches SET created_at = created_at - $2 * interval '1 millisecond' WHERE batch_id = $1`, [c.batchId, CARRY_STALE_MS + 1_000]);
      const sentAgain = await sweep();
      await settleRuns();
      assert.deepEqual(sentAgain, [c.batchId], `the sweeper sends the orphaned C again (run 2 is ${await runState(c.runId)})`);
      const doneC = await deliver(c, direct, 'worker-2');
      assert.equal(doneC.kind, 'done', JSON.stringify(doneC));
      assert.deepEqual(await receiptOf(c.batchId), { deleted: 0 }, 'C has its receipt (the confirmation is B\'s)');
      await settleRuns();
      assert.deepEqual([await runState(b.runId), await runState(c.runId)], ['completed', 'completed'], 'both runs complete');
      assert.equal((await bed.pool.query<{ status: string }>(`SELECT status FROM media_assets WHERE asset_id = $1`, [assetId])).rows[0]!.status, 'deleted');
      assert.deepEqual(await sweep(), [], 'nothing more is sent');
    } finally {
      await broker.close();
      await connection.close();
    }
  });
});
