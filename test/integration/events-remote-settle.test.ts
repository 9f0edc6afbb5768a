import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { parsePolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { targetSettleConfirmed } from '../../shared/db/queries/ledger';
import { MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * remote-delete with expiry events: the transaction that records a confirmed remote call writes
 * one outbox row when it settles the policy's row (targetSettleConfirmed), with the operation's run
 * and batch id; a held row or a row that no longer holds the decision (renewed) gets none.
 */
describe('expiry events: remote-delete settle writes the outbox row', () => {
  let bed: TestBed;
  let target: ResolvedTarget;
  let policy: RemoteDeletePolicy;

  before(async () => {
    bed = await makeTestBed('events_remote_settle');
    policy = parsePolicies(mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 10, burst: 5, concurrency: 4 }), 'test.yaml', {}).get(
      MEDIA_POLICY,
    ) as RemoteDeletePolicy;
    target = await targetResolve(bed.pool, policy);
  });

  after(() => bed?.close());

  /** A confirmed ledger operation for the asset as it is now (what the confirming transaction finished). */
  async function confirmedOperation(assetId: string, runId: string): Promise<string> {
    const result = await bed.pool.query<{ observed: string }>(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, run_id, claim_batch_id, state, outcome)
       SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at), $1, asset_id, retention_expires_at, $3::uuid, $3::text || ':000001', 'done', 'confirmed'
       FROM media_assets WHERE asset_id = $2
       RETURNING reaper_iso(observed_expiry) AS observed`,
      [MEDIA_POLICY, assetId, runId],
    );
    return result.rows[0]!.observed;
  }

  test('settled: one outbox row; held or renewed: none', async () => {
    const [settledId, heldId, renewedId] = await seedAssets(bed.pool, 'events', 3);
    const runId = randomUUID();
    const observed = new Map<string, string>();
    for (const id of [settledId!, heldId!, renewedId!]) observed.set(id, await confirmedOperation(id, runId));
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ($1, $2, 'legal', 'test')`, [MEDIA_POLICY, heldId]);
    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '1 day' WHERE asset_id = $1`, [renewedId]);

    const events = { policyVersion: 'v-test' };
    const settle = (assetId: string) =>
      targetSettleConfirmed(bed.pool, target, { assetId, observedExpiry: observed.get(assetId)!, markConfirmed: policy.markConfirmed, events });
    assert.equal(await settle(settledId!), 'settled');
    assert.equal(await settle(heldId!), 'held');
    assert.equal(await settle(renewedId!), 'changed');

    const outbox = await bed.pool.query<{ key: string; observed: string; run_id: string; batch_id: string; policy_version: string; cutoff: string | null }>(
      `SELECT key, reaper_iso(observed_expiry) AS observed, run_id::text, batch_id, policy_version, cutoff FROM cleanup_outbox WHERE policy = $1`,
      [MEDIA_POLICY],
    );
    assert.deepEqual(outbox.rows, [
      { key: settledId, observed: observed.get(settledId!), run_id: runId, batch_id: `${runId}:000001`, policy_version: 'v-test', cutoff: null },
    ]);
    // Without events the same settle writes nothing.
    const [quietId] = await seedAssets(bed.pool, 'quiet', 1);
    const quietObserved = await confirmedOperation(quietId!, runId);
    assert.equal(await targetSettleConfirmed(bed.pool, target, { assetId: quietId!, observedExpiry: quietObserved, markConfirmed: policy.markConfirmed }), 'settled');
    assert.equal((await bed.pool.query('SELECT 1 FROM cleanup_outbox WHERE key = $1', [quietId])).rowCount, 0);
  });
});
