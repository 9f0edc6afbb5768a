import assert from 'node:assert/strict';
import { after, before, beforeEach, describe, test } from 'node:test';
import pg from 'pg';
import pino from 'pino';
import { admitAndClaim } from '../../shared/admission/controller';
import { parsePolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import { encodeBatch, type BatchV1 } from '../../shared/contracts/batch';
import { admissionSetPaused } from '../../shared/db/queries/admission';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { ledgerFinish, ledgerReschedule, ledgerSweepPick, remoteBatchesKeep } from '../../shared/db/queries/ledger';
import { makeHttpRemoteClient } from '../../shared/remote/client';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeRemoteDeleteHandler } from '../../services/worker/handlers/remote-delete';
import type { BatchHandler, HandlerContext } from '../../services/worker/handlers/types';
import type { BatchResult } from '../../services/worker/results';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { callsByKey, currentKeyOf, ledgerRows, MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { TcpProxy } from '../support/tcp-proxy';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The remote-delete handler and its ledger statements, in this process against the real
 * PostgreSQL and the stand-in media API (issue 7):
 *  - item 1: a batch whose cutoff lies in the future records nothing and calls nothing for rows
 *    that have not expired yet (least(cutoff, now) when recording AND in the claim's re-check);
 *  - item 2: an asset renewed after its operation was recorded is never called, also when the
 *    operation sits in flight under an expired lease (the claim itself re-checks the row and
 *    supersedes, in the same statement);
 *  - item 7: completion is fenced by the attempt number as well as the owner, so two processes
 *    with the same REAPER_WORKER_ID cannot finish each other's claims;
 *  - item 17: a batch receipt counts only the confirmations its own claims made;
 *  - item 10: an operation whose carrying copy was lost is found again by the ledger sweeper.
 */
describe('remote-delete: the claim re-checks, fences and counts', () => {
  let bed: TestBed;
  let api: MediaApi;
  let policy: RemoteDeletePolicy;
  let target: ResolvedTarget;
  let handle: BatchHandler;
  let sequence = 0;

  before(async () => {
    bed = await makeTestBed('remote_ledger_claims');
    api = await startMediaApi();
    const policies = parsePolicies(
      mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 200, burst: 50, concurrency: 8, batchSize: 10, timeoutMs: 2000 }),
      'test-policies.yaml',
      {},
    );
    policy = policies.get(MEDIA_POLICY) as RemoteDeletePolicy;
    target = await targetResolve(bed.pool, policy);
    handle = makeRemoteDeleteHandler(policy, target, makeHttpRemoteClient(policy.remote));
  });

  after(async () => {
    await api?.close();
    await bed?.close();
  });

  beforeEach(async () => {
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], false, new Map([[MEDIA_POLICY, 50]]));
  });

  function context(workerId = 'in-process-worker'): HandlerContext {
    return {
      pool: bed.pool,
      workerId,
      log: pino({ level: 'silent' }),
      metrics: makeMetrics(),
      deliveryCount: 1,
      failpoint: () => undefined,
    };
  }

  async function expiryOf(assetId: string): Promise<string> {
    return (await bed.pool.query<{ e: string }>(`SELECT reaper_iso(retention_expires_at) AS e FROM media_assets WHERE asset_id = $1`, [assetId])).rows[0]!.e;
  }

  async function batchOf(assetIds: readonly string[], cutoff?: string): Promise<BatchV1> {
    sequence += 1;
    const now = (await bed.pool.query<{ now: string }>(`SELECT reaper_iso(clock_timestamp()) AS now`)).rows[0]!.now;
    return {
      version: 1,
      runId: '00000000-0000-4000-8000-' + String(sequence).padStart(12, '0'),
      batchId: `claims-test:${sequence}`,
      policy: MEDIA_POLICY,
      cutoff: cutoff ?? now,
      items: await Promise.all(assetIds.map(async (id) => ({ id, observedExpiry: await expiryOf(id) }))),
    };
  }

  async function receipt(batchId: string): Promise<{ items: number; deleted: number; noop: number } | undefined> {
    return (await bed.pool.query<{ items: number; deleted: number; noop: number }>(`SELECT items, deleted, noop FROM cleanup_batches WHERE batch_id = $1`, [batchId]))
      .rows[0];
  }

  const callsFor = (assetId: string) => api.calls.filter((call) => call.id === assetId);

  test('item 1: a batch with a cutoff a year ahead records nothing and calls nothing for assets not expired yet', async () => {
    const [live] = await seedAssets(bed.pool, 'future', 1);
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '1 hour' WHERE asset_id = $1`, [live]);
    const yearAhead = (await bed.pool.query<{ c: string }>(`SELECT reaper_iso(clock_timestamp() + interval '1 year') AS c`)).rows[0]!.c;
    const batch = await batchOf([live!], yearAhead);
    const result = await handle(batch, context());
    assert.equal(result.kind, 'done', JSON.stringify(result));
    assert.deepEqual(await ledgerRows(bed.pool, [live!]), [], 'no operation recorded for an unexpired asset');
    assert.deepEqual(callsFor(live!), [], 'no call');
    assert.equal((await bed.pool.query(`SELECT status FROM media_assets WHERE asset_id = $1`, [live])).rows[0].status, 'active');
  });

  test('item 1: an operation that exists for an unexpired asset (forged or recorded by a buggy publisher) is not claimed under a future cutoff', async () => {
    const [live] = await seedAssets(bed.pool, 'forged', 1);
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '1 hour' WHERE asset_id = $1`, [live]);
    const key = await currentKeyOf(bed.pool, live!);
    await bed.pool.query(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source) SELECT $1, $2, asset_id, retention_expires_at, 'scan' FROM media_assets WHERE asset_id = $3`,
      [key, MEDIA_POLICY, live],
    );
    const yearAhead = (await bed.pool.query<{ c: string }>(`SELECT reaper_iso(clock_timestamp() + interval '1 year') AS c`)).rows[0]!.c;
    await handle(await batchOf([live!], yearAhead), context());
    const [row] = await ledgerRows(bed.pool, [live!]);
    assert.equal(row!.outcome, 'superseded', `not eligible now: finished without a call (${JSON.stringify(row)})`);
    assert.equal(row!.attempt_count, 0);
    assert.deepEqual(callsFor(live!), [], 'no call for an asset that has not expired');
  });

  test('item 2: renewed while its batch waits (paused), the operation is superseded by the claim and never called', async () => {
    const [assetId] = await seedAssets(bed.pool, 'renewed-waiting', 1);
    const batch = await batchOf([assetId!]);
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], true, new Map([[MEDIA_POLICY, 50]]));
    const parked = await handle(batch, context());
    assert.equal(parked.kind, 'done', 'paused: the batch is parked in the ledger, not cycled through the broker');
    assert.equal((await ledgerRows(bed.pool, [assetId!]))[0]!.state, 'pending');
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '30 days' WHERE asset_id = $1`, [assetId]);
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], false, new Map([[MEDIA_POLICY, 50]]));
    const result = await handle(batch, context());
    assert.equal(result.kind, 'done', JSON.stringify(result));
    const [row] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(row!.outcome, 'superseded');
    assert.equal(row!.attempt_count, 0);
    assert.deepEqual(callsFor(assetId!), []);
  });

  test('item 2: renewed while its operation was in flight under a lease that then expired: re-checked, superseded, never called again', async () => {
    const [assetId] = await seedAssets(bed.pool, 'renewed-leased', 1);
    const batch = await batchOf([assetId!]);
    await bed.pool.query(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source, state, lease_owner, lease_expires_at, attempt_count, batch_id)
       SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at), $1, asset_id, retention_expires_at, 'scan', 'in_flight', 'a-worker-that-died',
              clock_timestamp() - interval '1 second', 1, $3
       FROM media_assets WHERE asset_id = $2`,
      [MEDIA_POLICY, assetId, batch.batchId],
    );
    // Renewed while the dead worker's lease ran out (its call, if any, had not reached the remote).
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '30 days' WHERE asset_id = $1`, [assetId]);
    const result = await handle(batch, context());
    assert.equal(result.kind, 'done', JSON.stringify(result));
    const [row] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(row!.state, 'done');
    assert.equal(row!.outcome, 'superseded', 'the expired lease is re-checked before any new call');
    assert.equal(row!.attempt_count, 1, 'no further attempt');
    assert.equal(row!.lease_owner, null);
    assert.deepEqual(callsFor(assetId!), [], 'no call for the renewed asset');
  });

  test('item 7: two processes with the same worker id cannot finish or reschedule each other\'s claims', async () => {
    const [assetId] = await seedAssets(bed.pool, 'same-id', 1);
    const batch = await batchOf([assetId!]);
    const key = await currentKeyOf(bed.pool, assetId!);
    await bed.pool.query(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source, batch_id)
       SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at), $1, asset_id, retention_expires_at, 'scan', $3 FROM media_assets WHERE asset_id = $2`,
      [MEDIA_POLICY, assetId, batch.batchId],
    );
    const request = { keys: [key], owner: 'same-worker-id', cutoff: batch.cutoff, batchId: batch.batchId };
    const first = await admitAndClaim(bed.pool, policy, target, request);
    assert.equal(first.claimed.length, 1);
    assert.equal(first.claimed[0]!.attemptCount, 1);
    // The first process froze past its lease; the second, started with the same REAPER_WORKER_ID, claims again.
    await bed.pool.query(`UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 millisecond' WHERE operation_key = $1`, [key]);
    const second = await admitAndClaim(bed.pool, policy, target, request);
    assert.equal(second.claimed.length, 1);
    assert.equal(second.claimed[0]!.attemptCount, 2);

    const stale = { operationKey: key, owner: 'same-worker-id', attempt: 1 };
    assert.equal(await ledgerReschedule(bed.pool, { ...stale, delayMs: 0, lastResult: 'uncertain' }), false, 'the first claim cannot reschedule the second');
    assert.equal(await ledgerFinish(bed.pool, { ...stale, outcome: 'confirmed', lastResult: 'HTTP 200' }), false, 'the first claim cannot finish the second');
    const [during] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(during!.state, 'in_flight', 'the second claim stands');
    assert.equal(during!.attempt_count, 2);
    assert.equal(await ledgerFinish(bed.pool, { ...stale, attempt: 2, outcome: 'confirmed', lastResult: 'HTTP 200' }), true, 'the current claim finishes');
  });

  test('item 17: a batch receipt counts only the confirmations made by its own claims', async () => {
    const [shared, onlyA, onlyB] = await seedAssets(bed.pool, 'receipts', 3);
    const batchA = await batchOf([shared!, onlyA!]);
    const batchB = await batchOf([shared!, onlyB!]);
    const a = await handle(batchA, context());
    assert.equal(a.kind, 'done', JSON.stringify(a));
    const b = await handle(batchB, context());
    assert.equal(b.kind, 'done', JSON.stringify(b));
    assert.deepEqual(await receipt(batchA.batchId), { items: 2, deleted: 2, noop: 0 }, 'A confirmed both of its assets');
    assert.deepEqual(await receipt(batchB.batchId), { items: 2, deleted: 1, noop: 1 }, 'B confirmed only its own: the shared one was confirmed by A');
    assert.equal(callsByKey(api).get(await keyOfDone(shared!))?.length, 1, 'the shared asset was called once');
    const counted = (r: BatchResult) => (r.kind === 'done' ? r.deleted : -1);
    assert.equal(counted(a) + counted(b), 3, 'deletions counted once in all');
  });

  async function keyOfDone(assetId: string): Promise<string> {
    return (await ledgerRows(bed.pool, [assetId]))[0]!.operation_key;
  }

  test('item 10: an operation whose carrying copy was lost (due, not delivered for a while) is picked by the ledger sweeper', async () => {
    const [lost] = await seedAssets(bed.pool, 'lost-copy', 1);
    const batch = await batchOf([lost!]);
    await bed.pool.query(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source, batch_id, last_delivered_at)
       SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at), $1, asset_id, retention_expires_at, 'scan', $3, clock_timestamp() FROM media_assets WHERE asset_id = $2`,
      [MEDIA_POLICY, lost, batch.batchId],
    );
    const pick = async () => {
      const client = await bed.pool.connect();
      try {
        await client.query('BEGIN');
        const picked = await ledgerSweepPick(client, { policy: MEDIA_POLICY, ratePerSecond: 200, aheadMs: 3000, staleMs: 30_000, limit: 100 });
        await client.query('ROLLBACK');
        return (picked?.picked ?? []).map((candidate) => candidate.assetId);
      } finally {
        client.release();
      }
    };
    assert.ok(!(await pick()).includes(lost!), 'a copy carries it: not picked');
    await bed.pool.query(`UPDATE cleanup_ledger SET last_delivered_at = clock_timestamp() - interval '31 seconds' WHERE asset_id = $1`, [lost]);
    assert.ok((await pick()).includes(lost!), 'its copy is presumed lost: picked');
  });

  test("the sweeper's pick reads a parked batch's message once, however many of its operations it picks (as the wire shows)", async () => {
    // Its own policy name: the pick sees only this batch's operations.
    const policyName = 'sweep-pick-once';
    const assets = await seedAssets(bed.pool, 'kept-once', 400);
    const batch = { ...(await batchOf(assets)), policy: policyName };
    const content = encodeBatch(batch);
    await remoteBatchesKeep(bed.pool, { batchId: batch.batchId, policy: policyName, content });
    await bed.pool.query(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source, batch_id)
       SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at), $1, asset_id, retention_expires_at, 'scan', $3 FROM media_assets WHERE asset_id = ANY($2::text[])`,
      [policyName, assets, batch.batchId],
    );
    const database = new URL(bed.databaseUrl);
    const proxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
    const pool = new pg.Pool({ connectionString: proxy.urlFor(bed.databaseUrl), max: 1 });
    try {
      const client = await pool.connect();
      let pick: Awaited<ReturnType<typeof ledgerSweepPick>>;
      let down: number;
      try {
        await client.query('BEGIN');
        const downBefore = [...proxy.links].reduce((sum, link) => sum + link.bytesDown, 0);
        pick = await ledgerSweepPick(client, { policy: policyName, ratePerSecond: 10_000, aheadMs: 3000, staleMs: 30_000, limit: 1000 });
        down = [...proxy.links].reduce((sum, link) => sum + link.bytesDown, 0) - downBefore;
        await client.query('ROLLBACK');
      } finally {
        // Released whatever failed: a client left checked out holds pool.end() below (issue 43).
        client.release(true);
      }
      // Once: the message plus ~200 bytes an operation's row (~110 KB here). Joined per operation it
      // was 400 times the message (~11 MB).
      const bound = 2 * content.length + 400 * 300;
      assert.ok(down < bound, `the server sent ${down} bytes for a ${content.length}-byte message and 400 operations (bound ${bound})`);
      assert.equal(pick?.picked.length, 400, 'every operation of the parked batch is picked');
      assert.deepEqual([...(pick?.kept.keys() ?? [])], [batch.batchId]);
      assert.ok(pick?.kept.get(batch.batchId)?.equals(content), 'its message as kept');
    } finally {
      await pool.end();
      await proxy.close();
    }
  });
});
