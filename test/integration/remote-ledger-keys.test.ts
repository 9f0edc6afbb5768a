import assert from 'node:assert/strict';
import { after, before, beforeEach, describe, test } from 'node:test';
import amqp, { type ChannelModel } from 'amqplib';
import pg from 'pg';
import pino from 'pino';
import { admitAndClaim } from '../../shared/admission/controller';
import { fixedConnection, ConfirmingPublisher } from '../../shared/amqp/publisher';
import { assertTopology, brokerNames, makeTopology } from '../../shared/amqp/topology';
import { parsePolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import { decodeBatch, type BatchV1 } from '../../shared/contracts/batch';
import { admissionOverrideSet, admissionSetPaused } from '../../shared/db/queries/admission';
import { targetBacklogRead } from '../../shared/db/queries/backlog';
import { expiringRowsDeleteGroupIfStillExpired, expiringRowsScanPage } from '../../shared/db/queries/expiring-rows';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { holdsAdd, holdsRemove } from '../../shared/db/queries/holds';
import { makeHttpRemoteClient } from '../../shared/remote/client';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeRemoteDeleteHandler } from '../../services/worker/handlers/remote-delete';
import type { BatchHandler, HandlerContext } from '../../services/worker/handlers/types';
import { sweepPolicy } from '../../services/worker/ledger-sweeper';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { currentKeyOf, MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

const NUMBERED = 'media-numbered';
const SWEPT = 'media-swept';

/**
 * The remote-delete ledger, second round (issue 17), in this process against the real PostgreSQL,
 * RabbitMQ and the stand-in media API:
 *  - item 2: holds, operation keys and audit use the row's canonical key text (a bigint key named
 *    `007` is row 7), and the settle step re-checks holds;
 *  - item 3: an operation superseded because its guard changed is re-opened when the guard
 *    changes back, and the oldest-eligible gauge counts the row meanwhile;
 *  - item 11: a confirmation under a stale lease still writes its audit row (once per operation),
 *    and so does one whose recording transaction failed (issue 40 item 8);
 *    the ledger sweeper paces by the live admission override, not the file's rate.
 */
describe('remote-delete ledger: canonical keys, re-opened decisions, complete audit', () => {
  let bed: TestBed;
  let api: MediaApi;
  let media: RemoteDeletePolicy;
  let numbered: RemoteDeletePolicy;
  let swept: RemoteDeletePolicy;
  const targets = new Map<string, ResolvedTarget>();
  const handlers = new Map<string, BatchHandler>();
  let sequence = 0;

  before(async () => {
    bed = await makeTestBed('remote_ledger_keys');
    api = await startMediaApi();
    await bed.pool.query(`CREATE TABLE media_numbered (asset_id bigint PRIMARY KEY, status text NOT NULL, retention_expires_at timestamptz NOT NULL)`);
    const audited = '    audit: { enabled: true, retainDays: 7 }\n';
    const mediaYaml = `${mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 200, burst: 50, concurrency: 8, batchSize: 10, timeoutMs: 5000, leaseMs: 15000 })}${audited}`;
    const numberedYaml = mediaYaml
      .replace('policies:\n', '')
      .replace(`name: ${MEDIA_POLICY}`, `name: ${NUMBERED}`)
      .replace('table: media_assets', 'table: media_numbered')
      .replace('    markConfirmed: { status: deleted }\n', '');
    const sweptYaml = mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 1, burst: 1, concurrency: 1, batchSize: 5 })
      .replace('policies:\n', '')
      .replace(`name: ${MEDIA_POLICY}`, `name: ${SWEPT}`);
    const yaml = `${mediaYaml}${numberedYaml}${sweptYaml}`;
    bed.writePolicies(yaml); // the broker objects of these policies are deleted by bed.close()
    const policies = parsePolicies(yaml, 'test-policies.yaml', {});
    media = policies.get(MEDIA_POLICY) as RemoteDeletePolicy;
    numbered = policies.get(NUMBERED) as RemoteDeletePolicy;
    swept = policies.get(SWEPT) as RemoteDeletePolicy;
    for (const policy of [media, numbered, swept]) {
      const target = await targetResolve(bed.pool, policy);
      targets.set(policy.name, target);
      handlers.set(policy.name, makeRemoteDeleteHandler(policy, target, makeHttpRemoteClient(policy.remote)));
    }
  });

  after(async () => {
    await api?.close();
    await bed?.close();
  });

  beforeEach(async () => {
    api.configure({ hold: false });
    await admissionSetPaused(bed.pool, [MEDIA_POLICY, NUMBERED], false, new Map([[MEDIA_POLICY, 50], [NUMBERED, 50]]));
  });

  function context(workerId = 'in-process-worker'): HandlerContext {
    return { pool: bed.pool, workerId, log: pino({ level: 'silent' }), metrics: makeMetrics(), deliveryCount: 1, failpoint: () => undefined };
  }

  const handle = (batch: BatchV1, workerId?: string) => handlers.get(batch.policy)!(batch, context(workerId));
  const databaseNow = async () => (await bed.pool.query<{ now: string }>(`SELECT reaper_iso(clock_timestamp()) AS now`)).rows[0]!.now;

  function batchOf(policy: string, items: BatchV1['items'], cutoff: string): BatchV1 {
    sequence += 1;
    return {
      version: 1,
      runId: '00000000-0000-4000-8000-' + String(sequence).padStart(12, '0'),
      batchId: `keys-test:${sequence}`,
      policy,
      cutoff,
      items,
    };
  }

  /** What the next run of `policy` publishes: its keyset scan as of now (holds and recorded decisions left out). */
  async function nextRunBatch(policy: string): Promise<BatchV1> {
    const cutoff = await databaseNow();
    const items = await expiringRowsScanPage(bed.pool, targets.get(policy)!, { cutoff, after: null, limit: 100, unrecordedFor: policy });
    return batchOf(policy, items, cutoff);
  }

  async function numberedRow(id: number, expiredAgo = '1 hour'): Promise<string> {
    const result = await bed.pool.query<{ e: string }>(
      `INSERT INTO media_numbered (asset_id, status, retention_expires_at)
       VALUES ($1, 'active', now() - $2::interval + random() * interval '1 millisecond') RETURNING reaper_iso(retention_expires_at) AS e`,
      [id, expiredAgo],
    );
    return result.rows[0]!.e;
  }

  async function ledgerOf(policy: string): Promise<Array<{ operation_key: string; asset_id: string; state: string; outcome: string | null; last_result: string | null }>> {
    return (
      await bed.pool.query(`SELECT operation_key, asset_id, state, outcome, last_result FROM cleanup_ledger WHERE policy = $1 ORDER BY operation_key`, [policy])
    ).rows;
  }

  async function auditOf(policy: string, key: string): Promise<Array<{ key: string; operation_key: string; outcome: string }>> {
    return (await bed.pool.query(`SELECT key, operation_key, outcome FROM cleanup_audit WHERE policy = $1 AND key = $2`, [policy, key])).rows;
  }

  const rowExists = async (table: string, id: string) =>
    ((await bed.pool.query(`SELECT 1 FROM ${table} WHERE asset_id::text = $1`, [id])).rowCount ?? 0) === 1;

  test('item 2: a batch naming 007 while 7 is held makes no call and no second operation key; after the hold, it deletes row 7 under its canonical key', async () => {
    const expiry = await numberedRow(7);
    const canonicalKey = `${NUMBERED}:7:${expiry}`;
    // The scan recorded row 7 while admission was paused: its operation waits in the ledger.
    await admissionSetPaused(bed.pool, [NUMBERED], true, new Map([[NUMBERED, 50]]));
    assert.equal((await handle(batchOf(NUMBERED, [{ id: '7', observedExpiry: expiry }], await databaseNow()))).kind, 'done');
    assert.deepEqual((await ledgerOf(NUMBERED)).map((row) => [row.operation_key, row.state]), [[canonicalKey, 'pending']]);
    await holdsAdd(bed.pool, targets.get(NUMBERED)!, { ids: ['7'], reason: 'legal hold', until: null, createdBy: 'test' });
    await admissionSetPaused(bed.pool, [NUMBERED], false, new Map([[NUMBERED, 50]]));

    // Another producer spells the same key "007".
    const spelledAgain = batchOf(NUMBERED, [{ id: '007', observedExpiry: expiry }], await databaseNow());
    assert.equal((await handle(spelledAgain)).kind, 'done');
    assert.deepEqual(api.calls.filter((call) => ['7', '007'].includes(call.id)), [], 'no remote call for a held row, whatever the spelling');
    const held = await ledgerOf(NUMBERED);
    assert.deepEqual(held.map((row) => [row.operation_key, row.asset_id, row.outcome]), [[canonicalKey, '7', 'held']], 'one operation for one retention decision');

    await holdsRemove(bed.pool, targets.get(NUMBERED)!, ['7']);
    assert.equal((await handle(spelledAgain)).kind, 'done');
    assert.deepEqual(api.calls.filter((call) => ['7', '007'].includes(call.id)).map((call) => [call.id, call.key]), [['7', canonicalKey]], 'called once, with the canonical id and key');
    assert.deepEqual((await ledgerOf(NUMBERED)).map((row) => [row.operation_key, row.outcome]), [[canonicalKey, 'confirmed']]);
    assert.equal(await rowExists('media_numbered', '7'), false, 'row 7 deleted');
    assert.deepEqual(await auditOf(NUMBERED, '7'), [{ key: '7', operation_key: canonicalKey, outcome: 'confirmed' }]);
  });

  test('item 2, row-delete: the DELETE and its audit use the row\'s key text too (007 is row 7, held by the hold on 7)', async () => {
    await bed.pool.query(`CREATE TABLE rows_numbered (id bigint PRIMARY KEY, status text NOT NULL, expires_at timestamptz NOT NULL)`);
    const target = await targetResolve(bed.pool, { name: 'rows-numbered', table: 'rows_numbered', key: 'id', expiresAt: 'expires_at', guard: { status: 'held' } });
    const expiry = (
      await bed.pool.query<{ e: string }>(`INSERT INTO rows_numbered VALUES (7, 'held', now() - interval '1 hour') RETURNING reaper_iso(expires_at) AS e`)
    ).rows[0]!.e;
    await holdsAdd(bed.pool, target, { ids: ['7'], reason: 'legal hold', until: null, createdBy: 'test' });
    const deleteNamed = async (id: string, batchId: string) =>
      expiringRowsDeleteGroupIfStillExpired(bed.pool, target, {
        policy: 'rows-numbered',
        workerId: 'test',
        audit: { policyVersion: 'v-test' },
        batches: [{ batchId, runId: '00000000-0000-4000-8000-00000000aaaa', cutoff: await databaseNow(), items: [{ id, observedExpiry: expiry }] }],
      });
    assert.equal((await deleteNamed('007', 'rows:1')).batches[0]!.deleted, 0, 'held under any spelling');
    assert.equal((await bed.pool.query('SELECT 1 FROM rows_numbered WHERE id = 7')).rowCount, 1, 'row 7 kept');
    await holdsRemove(bed.pool, target, ['007']);
    assert.equal((await deleteNamed('007', 'rows:2')).batches[0]!.deleted, 1);
    assert.deepEqual(await auditOf('rows-numbered', '7'), [{ key: '7', operation_key: null, outcome: 'deleted' }], 'audited under the canonical key');
  });

  test('item 2: a hold placed while the call is in flight keeps the row: the settle step leaves it, the operation ends held, and the next run after the hold settles it', async () => {
    const expiry = await numberedRow(8);
    const key = `${NUMBERED}:8:${expiry}`;
    api.configure({ hold: true });
    const running = handle(batchOf(NUMBERED, [{ id: '8', observedExpiry: expiry }], await databaseNow()));
    await eventually('the call for row 8 reached the remote', () => api.heldCalls().some((call) => call.id === '8'));
    await holdsAdd(bed.pool, targets.get(NUMBERED)!, { ids: ['8'], reason: 'placed during the call', until: null, createdBy: 'test' });
    api.configure({ hold: false });
    api.release();
    assert.equal((await running).kind, 'done');

    assert.equal(await rowExists('media_numbered', '8'), true, 'the held row is not deleted by the confirming transaction');
    const [op] = await ledgerOf(NUMBERED).then((rows) => rows.filter((row) => row.asset_id === '8'));
    assert.equal(op!.outcome, 'held', JSON.stringify(op));
    assert.match(op!.last_result ?? '', /row kept: legal hold/);
    assert.equal((await auditOf(NUMBERED, '8')).length, 1, 'the remote deletion happened: audited');

    await holdsRemove(bed.pool, targets.get(NUMBERED)!, ['8']);
    const next = await nextRunBatch(NUMBERED);
    assert.deepEqual(next.items.map((item) => item.id), ['8'], 'the next run finds the row again');
    assert.equal((await handle(next)).kind, 'done');
    assert.equal(await rowExists('media_numbered', '8'), false, 'settled once the hold is gone');
    assert.equal(api.executionsByKey().get(key), 1, 'the object was deleted once; the retry used the same key');
    assert.equal((await auditOf(NUMBERED, '8')).length, 1, 'still one audit row for one deletion');
  });

  test('item 3: superseded because the guard changed, re-opened when it changes back: the gauge counts the row meanwhile, the next run deletes it', async () => {
    const [assetId] = await seedAssets(bed.pool, 'flipped', 1);
    // Older than anything else in this file: the gauge's oldest age is this row's while it waits.
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = retention_expires_at - interval '2 days' WHERE asset_id = $1`, [assetId]);
    const key = await currentKeyOf(bed.pool, assetId!);
    const first = await nextRunBatch(MEDIA_POLICY);
    assert.ok(first.items.some((item) => item.id === assetId));
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], true, new Map([[MEDIA_POLICY, 50]]));
    await handle(first);
    await bed.pool.query(`UPDATE media_assets SET status = 'archived' WHERE asset_id = $1`, [assetId]);
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], false, new Map([[MEDIA_POLICY, 50]]));
    await handle(first);
    const superseded = (await ledgerOf(MEDIA_POLICY)).find((row) => row.operation_key === key)!;
    assert.equal(superseded.outcome, 'superseded');

    await bed.pool.query(`UPDATE media_assets SET status = 'active' WHERE asset_id = $1`, [assetId]);
    const gauge = await targetBacklogRead(bed.pool, targets.get(MEDIA_POLICY)!);
    assert.ok(gauge.oldestEligibleAgeSeconds > 2 * 86_400, `the oldest-eligible gauge counts the row again (${gauge.oldestEligibleAgeSeconds} s)`);
    const next = await nextRunBatch(MEDIA_POLICY);
    assert.deepEqual(next.items.map((item) => item.id), [assetId], 'the next run publishes it again');
    assert.equal((await handle(next)).kind, 'done');
    const done = (await ledgerOf(MEDIA_POLICY)).filter((row) => row.asset_id === assetId);
    assert.deepEqual(done.map((row) => [row.operation_key, row.outcome]), [[key, 'confirmed']], 'the same operation, re-opened and confirmed');
    assert.equal((await bed.pool.query(`SELECT status FROM media_assets WHERE asset_id = $1`, [assetId])).rows[0].status, 'deleted');
    assert.ok((await targetBacklogRead(bed.pool, targets.get(MEDIA_POLICY)!)).oldestEligibleAgeSeconds < 2 * 86_400, 'no longer counted once deleted');
  });

  test('item 11: a call the remote confirmed under a stale lease, whose operation was superseded meanwhile, has its audit row (and only one)', async () => {
    const [assetId] = await seedAssets(bed.pool, 'stale-confirmed', 1);
    const key = await currentKeyOf(bed.pool, assetId!);
    api.configure({ hold: true });
    const batch = await nextRunBatch(MEDIA_POLICY);
    const running = handle(batch, 'frozen-worker');
    await eventually('the call reached the remote', () => api.heldCalls().some((call) => call.id === assetId));
    // The worker's lease runs out while the call is in flight, the guard changes, and another
    // worker's claim supersedes the operation.
    await bed.pool.query(`UPDATE media_assets SET status = 'archived' WHERE asset_id = $1`, [assetId]);
    await bed.pool.query(`UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 millisecond' WHERE operation_key = $1`, [key]);
    // The operation must end superseded by a newer claim. In a whole npm test under load
    // (2026-12-06) this claim itself read superseded 0: the frozen worker asks again for its batch's
    // due operations a moment after its first claim (after its next token's wait, to learn that
    // nothing more is due), and on a loaded machine that ask can land after the lease's end above;
    // it then supersedes the operation itself, or holds it locked so this claim skips it. (500 ms
    // between the lease's end and this claim did not reproduce it: the worker's ask is the late
    // one.) So the assertion is on the ledger's outcome, whichever claim wrote it; it fails if none does.
    await admitAndClaim(bed.pool, media, targets.get(MEDIA_POLICY)!, { keys: [key], owner: 'other-worker', cutoff: batch.cutoff, batchId: 'other-batch' });
    await eventually('the operation superseded by a newer claim', async () => (await ledgerOf(MEDIA_POLICY)).find((row) => row.operation_key === key)?.outcome === 'superseded');
    api.configure({ hold: false });
    api.release();
    assert.equal((await running).kind, 'done');
    assert.equal(api.executionsByKey().get(key), 1, 'the remote deleted it');
    assert.equal((await ledgerOf(MEDIA_POLICY)).find((row) => row.operation_key === key)!.outcome, 'superseded', 'the newer claim stands');
    assert.deepEqual(await auditOf(MEDIA_POLICY, assetId!), [{ key: assetId, operation_key: key, outcome: 'confirmed' }], 'the deletion that happened is audited');

    // The guard changes back: the operation is re-opened, the retry (same key) is confirmed and
    // the row settled; the audit still has one row for the one deletion.
    await bed.pool.query(`UPDATE media_assets SET status = 'active' WHERE asset_id = $1`, [assetId]);
    assert.equal((await handle(await nextRunBatch(MEDIA_POLICY))).kind, 'done');
    assert.equal((await ledgerOf(MEDIA_POLICY)).find((row) => row.operation_key === key)!.outcome, 'confirmed');
    assert.equal((await auditOf(MEDIA_POLICY, assetId!)).length, 1);
  });

  test('item 8: a call the remote confirmed whose recording transaction fails is audited anyway; the row renewed before the next claim ends it superseded, audited once', async () => {
    const [assetId] = await seedAssets(bed.pool, 'unrecorded-confirmed', 1);
    const key = await currentKeyOf(bed.pool, assetId!);
    // The confirming transaction fails (as a lock timeout or a lost connection would): the ledger
    // refuses to finish this one operation. The audit row is written in another statement.
    await bed.pool.query(`CREATE FUNCTION refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN RAISE EXCEPTION 'test: the confirming transaction fails'; END $$`);
    await bed.pool.query(`CREATE TRIGGER refuse_finish BEFORE UPDATE ON cleanup_ledger FOR EACH ROW
      WHEN (NEW.state = 'done' AND NEW.operation_key = '${key}') EXECUTE FUNCTION refuse_finish()`);
    try {
      const cutoff = await databaseNow();
      const batch = batchOf(MEDIA_POLICY, [{ id: assetId!, observedExpiry: key.slice(MEDIA_POLICY.length + assetId!.length + 2) }], cutoff);
      await assert.rejects(handle(batch), /the confirming transaction fails/);
    } finally {
      await bed.pool.query(`DROP TRIGGER refuse_finish ON cleanup_ledger; DROP FUNCTION refuse_finish()`);
    }
    assert.equal(api.executionsByKey().get(key), 1, 'the remote deleted it');
    assert.equal((await ledgerOf(MEDIA_POLICY)).find((row) => row.operation_key === key)!.state, 'in_flight', 'the outcome is not recorded');
    assert.deepEqual(await auditOf(MEDIA_POLICY, assetId!), [{ key: assetId, operation_key: key, outcome: 'confirmed' }], 'the deletion that happened is audited');

    // The row is renewed before the lease runs out; the next claim supersedes the operation and
    // makes no call: the audit row above is the only record of the deletion, and stays the only one.
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '1 day' WHERE asset_id = $1`, [assetId]);
    await bed.pool.query(`UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 millisecond' WHERE operation_key = $1`, [key]);
    const next = await admitAndClaim(bed.pool, media, targets.get(MEDIA_POLICY)!, { keys: [key], owner: 'other-worker', cutoff: await databaseNow(), batchId: 'other-batch' });
    assert.equal(next.superseded, 1);
    assert.equal(api.executionsByKey().get(key), 1, 'no second call');
    assert.equal((await auditOf(MEDIA_POLICY, assetId!)).length, 1);
  });

  test('item 11: the ledger sweeper sends as much as the live admission override allows, not the file rate', async () => {
    const connection: ChannelModel = await amqp.connect(bed.amqpUrl);
    const broker: TestBroker = await openTestBroker(bed.amqpUrl);
    // Its own pool: the override cache is per pool, so the first read is the override set below.
    const pool = new pg.Pool({ connectionString: bed.databaseUrl, max: 2 });
    try {
      const channel = await connection.createChannel();
      await assertTopology(channel, makeTopology({ prefix: bed.prefix, policies: [SWEPT], deliveryLimit: 20 }));
      await channel.close();
      const names = brokerNames(bed.prefix);
      const ids = await seedAssets(bed.pool, 'swept', 20);
      await bed.pool.query(
        `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, source)
         SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at), $1, asset_id, retention_expires_at, 'webhook'
         FROM media_assets WHERE asset_id = ANY($2::text[])`,
        [SWEPT, ids],
      );
      // The file says 1 call/s (3 operations within the sweeper's 3 s look-ahead); the operator raised it to 20/s.
      await admissionOverrideSet(bed.pool, { policy: SWEPT, rate: 20, setBy: 'test' });
      const published = await sweepPolicy({ pool, publisher: new ConfirmingPublisher(fixedConnection(connection), 5_000), names, registry: makeMetrics().registry }, swept, targets.get(SWEPT)!);
      assert.ok(published > 0);
      const messages = await broker.drain(names.workQueue(SWEPT));
      const sent = messages
        .flatMap((message) => {
          const decoded = decodeBatch(message.content);
          assert.ok(decoded.ok);
          return decoded.batch.items.map((item) => item.id);
        })
        .sort();
      assert.deepEqual(sent, ids, 'every waiting operation sent at the live rate');
      const carried = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_ledger WHERE policy = $1 AND last_delivered_at IS NOT NULL`, [SWEPT]);
      assert.equal(carried.rows[0]!.n, 20);
    } finally {
      await pool.end();
      await broker.close();
      await connection.close();
    }
  });
  test('invariant 18: the ledger sweeper waits for its confirms with no transaction open; a failed publish hands the operations back', async () => {
    const connection: ChannelModel = await amqp.connect(bed.amqpUrl);
    const pool = new pg.Pool({ connectionString: bed.databaseUrl, max: 2 });
    let release = () => {};
    let sweeping: Promise<number> = Promise.resolve(0);
    try {
      const names = brokerNames(bed.prefix);
      await bed.pool.query(`UPDATE cleanup_ledger SET last_delivered_at = NULL, batch_id = NULL WHERE policy = $1 AND state = 'pending'`, [SWEPT]);
      const real = new ConfirmingPublisher(fixedConnection(connection), 5_000);
      const gate = new Promise<void>((resolve) => (release = resolve));
      let waiting!: () => void;
      const atGate = new Promise<void>((resolve) => (waiting = resolve));
      // The real publisher, with its confirm held back until the checks below are done.
      const held = { publish: async (...args: Parameters<ConfirmingPublisher['publish']>) => (waiting(), await gate, real.publish(...args)) } as unknown as ConfirmingPublisher;
      sweeping = sweepPolicy({ pool, publisher: held, names, registry: makeMetrics().registry }, swept, targets.get(SWEPT)!);
      await atGate;
      // While the sweeper waits for the broker: no ledger row is locked, no transaction of its pool is open.
      const locked = await bed.pool.query(`SELECT operation_key FROM cleanup_ledger WHERE policy = $1 FOR UPDATE NOWAIT`, [SWEPT]).then(
        () => 'free',
        (error: { code?: string }) => `locked (${error.code})`,
      );
      assert.equal(locked, 'free', 'the picked ledger rows are not locked while the sweeper waits for its confirms');
      const open = await bed.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()`,
      );
      assert.equal(open.rows[0]!.n, 0, 'no transaction is open while the sweeper waits');
      release();
      assert.ok((await sweeping) > 0);

      // A publish that fails hands the marks back: the next pass may pick the same operations at once.
      await bed.pool.query(`UPDATE cleanup_ledger SET last_delivered_at = NULL, batch_id = NULL WHERE policy = $1 AND state = 'pending'`, [SWEPT]);
      const failing = { publish: async () => Promise.reject(new Error('broker refused')) } as unknown as ConfirmingPublisher;
      await assert.rejects(sweepPolicy({ pool, publisher: failing, names, registry: makeMetrics().registry }, swept, targets.get(SWEPT)!), /broker refused/);
      const carried = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_ledger WHERE policy = $1 AND state = 'pending' AND last_delivered_at IS NOT NULL`, [SWEPT]);
      assert.equal(carried.rows[0]!.n, 0, 'nothing is left marked as carried by a copy that was never published');
    } finally {
      release(); // a failed check above must not leave the sweeper (and its transaction) waiting
      await sweeping.catch(() => 0);
      await pool.end();
      await connection.close();
    }
  });
});
