import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp, { type ChannelModel } from 'amqplib';
import pino from 'pino';
import { fixedConnection, ConfirmingPublisher } from '../../shared/amqp/publisher';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { parsePolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import { decodeBatch, encodeBatch, type BatchV1 } from '../../shared/contracts/batch';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { ledgerFinish, remoteBatchesKeep } from '../../shared/db/queries/ledger';
import { makeHttpRemoteClient } from '../../shared/remote/client';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeRemoteDeleteHandler } from '../../services/worker/handlers/remote-delete';
import type { BatchHandler, HandlerContext } from '../../services/worker/handlers/types';
import { CARRY_STALE_MS, sweepPolicy } from '../../services/worker/ledger-sweeper';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { openTestBroker, type TestBroker } from '../support/broker';
import { MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * A batch parked in the ledger whose operations another batch finished (the chaos run's "stuck 3"):
 * two runs published the same asset (the second scanned before the first's batch was recorded);
 * batch A recorded and claimed it, its worker froze; batch B found it in flight under A's live lease
 * and was parked (acked, no receipt). A's claim then confirmed it. Nothing pending is left for the
 * ledger sweeper to pick, so B was never sent again: no receipt, and its run stayed `published`.
 * The sweeper now sends such a kept batch (no open operation left) again; its delivery writes the receipt.
 * The kept message names its ids as its publisher spelled them (`007` of a bigint key): the look
 * reads them through the key's type, as the ledger recorded them (issue 40).
 */
describe('remote-delete: a parked batch whose operations another batch finished still gets its receipt', () => {
  const NUMBERED = 'media-numbered';
  let bed: TestBed;
  let api: MediaApi;
  const policies = new Map<string, { policy: RemoteDeletePolicy; target: ResolvedTarget; handle: BatchHandler }>();

  before(async () => {
    bed = await makeTestBed('remote_parked_orphan');
    api = await startMediaApi();
    await bed.pool.query(`CREATE TABLE media_numbered (asset_id bigint PRIMARY KEY, status text NOT NULL, retention_expires_at timestamptz NOT NULL)`);
    const mediaYaml = mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 200, burst: 50, concurrency: 8, batchSize: 10, timeoutMs: 2000 });
    const numberedYaml = mediaYaml
      .replace('policies:\n', '')
      .replace(`name: ${MEDIA_POLICY}`, `name: ${NUMBERED}`)
      .replace('table: media_assets', 'table: media_numbered')
      .replace('    markConfirmed: { status: deleted }\n', '');
    const yaml = `${mediaYaml}${numberedYaml}`;
    bed.writePolicies(yaml); // the broker objects of the policies are deleted by bed.close()
    for (const policy of parsePolicies(yaml, 'test-policies.yaml', {}).values()) {
      const remote = policy as RemoteDeletePolicy;
      const target = await targetResolve(bed.pool, remote);
      policies.set(remote.name, { policy: remote, target, handle: makeRemoteDeleteHandler(remote, target, makeHttpRemoteClient(remote.remote)) });
    }
  });

  after(async () => {
    await api?.close();
    await bed?.close();
  });

  const context = (): HandlerContext => ({ pool: bed.pool, workerId: 'in-process-worker', log: pino({ level: 'silent' }), metrics: makeMetrics(), deliveryCount: 1, failpoint: () => undefined });
  const receiptOf = async (batchId: string) => (await bed.pool.query(`SELECT deleted FROM cleanup_batches WHERE batch_id = $1`, [batchId])).rows[0] as { deleted: number } | undefined;

  /**
   * A recorded the row's operation and froze holding its claim; B, naming the row as `spelledInB`,
   * was parked behind it; A's claim confirmed. The sweeper must send B again, and B's delivery
   * writes its receipt.
   */
  async function parkedBehindFinishedClaim(policyName: string, row: { table: string; id: string; spelledInB: string }): Promise<void> {
    const { policy, target, handle } = policies.get(policyName)!;
    const connection: ChannelModel = await amqp.connect(bed.amqpUrl);
    const broker: TestBroker = await openTestBroker(bed.amqpUrl);
    try {
      const channel = await connection.createChannel();
      await assertTopology(channel, makeTopology({ prefix: bed.prefix, policies: [policyName], deliveryLimit: 20 }));
      await channel.close();
      const names = brokerNames(bed.prefix);
      const { key, observedExpiry } = (
        await bed.pool.query<{ key: string; observedExpiry: string }>(
          `SELECT $1 || ':' || asset_id::text || ':' || reaper_iso(retention_expires_at) AS key, reaper_iso(retention_expires_at) AS "observedExpiry"
           FROM ${row.table} WHERE asset_id::text = $2`,
          [policyName, row.id],
        )
      ).rows[0]!;
      const cutoff = (await bed.pool.query<{ now: string }>(`SELECT reaper_iso(clock_timestamp()) AS now`)).rows[0]!.now;
      const batchOf = (run: number, id: string): BatchV1 => ({
        version: 1,
        runId: `00000000-0000-4000-8000-00000000000${run}`,
        batchId: `orphan-test:${policyName}:run${run}`,
        policy: policyName,
        cutoff,
        items: [{ id, observedExpiry }],
      });
      const [a, b] = [batchOf(1, row.id), batchOf(2, row.spelledInB)];
      // A recorded the operation and its worker claimed it, then froze (a live lease, attempt 1).
      await bed.pool.query(
        `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source, state, lease_owner, lease_expires_at, attempt_count, batch_id, claim_batch_id, last_delivered_at)
         SELECT $1, $2, asset_id::text, retention_expires_at, 'scan', 'in_flight', 'frozen-worker', clock_timestamp() + interval '20 seconds', 1, $4, $4, clock_timestamp()
         FROM ${row.table} WHERE asset_id::text = $3`,
        [key, policyName, row.id, a.batchId],
      );
      await remoteBatchesKeep(bed.pool, { batchId: a.batchId, policy: policyName, content: encodeBatch(a) });

      const parked = await handle(b, context());
      assert.equal(parked.kind, 'done', JSON.stringify(parked));
      assert.equal(await receiptOf(b.batchId), undefined, 'B waits: its operation is in flight under A\'s claim');

      // A's worker resumes and confirms under its own claim (its receipt is A's business).
      assert.equal(await ledgerFinish(bed.pool, { operationKey: key, owner: 'frozen-worker', attempt: 1, outcome: 'confirmed', lastResult: 'HTTP 200' }), true);
      // Kept longer than a carried copy may take (what a real run waits; moved back, not slept).
      await bed.pool.query(`UPDATE cleanup_remote_batches SET created_at = created_at - $2 * interval '1 millisecond' WHERE batch_id = $1`, [b.batchId, CARRY_STALE_MS + 1_000]);

      const publisher = new ConfirmingPublisher(fixedConnection(connection), 5_000);
      await sweepPolicy({ pool: bed.pool, publisher, names, registry: makeMetrics().registry }, policy, target);
      const sent = (await broker.drain(names.workQueue(policyName))).map((message) => {
        const decoded = decodeBatch(message.content);
        assert.ok(decoded.ok);
        return decoded.batch as BatchV1;
      });
      const again = sent.find((batch) => batch.batchId === b.batchId);
      assert.ok(again, `the sweeper sent B again (sent: ${JSON.stringify(sent.map((batch) => batch.batchId))})`);
      assert.equal(again.runId, b.runId, 'as published: same run');
      const settled = await handle(again, context());
      assert.equal(settled.kind, 'done', JSON.stringify(settled));
      assert.deepEqual(await receiptOf(b.batchId), { deleted: 0 }, 'B has its receipt (the confirmation is A\'s)');
      assert.equal((await bed.pool.query(`SELECT 1 FROM cleanup_remote_batches WHERE batch_id = $1`, [b.batchId])).rowCount, 0, 'B is forgotten');

      // Once its receipt is written, nothing more is sent.
      await sweepPolicy({ pool: bed.pool, publisher, names, registry: makeMetrics().registry }, policy, target);
      assert.deepEqual((await broker.drain(names.workQueue(policyName))).map((message) => message.properties.messageId), []);
    } finally {
      await broker.close();
      await connection.close();
    }
  }

  test('the ledger sweeper sends the orphaned batch again and its receipt is written', async () => {
    const [assetId] = await seedAssets(bed.pool, 'orphan', 1);
    await parkedBehindFinishedClaim(MEDIA_POLICY, { table: 'media_assets', id: assetId!, spelledInB: assetId! });
  });

  test('a parked batch naming its row as `007` (bigint key 7) is found by its canonical key and sent again', async () => {
    await bed.pool.query(`INSERT INTO media_numbered (asset_id, status, retention_expires_at) VALUES (7, 'active', now() - interval '1 hour')`);
    await parkedBehindFinishedClaim(NUMBERED, { table: 'media_numbered', id: '7', spelledInB: '007' });
  });
});
