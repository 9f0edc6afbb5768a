import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { type MediaApi } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import {
  closeRemoteWorld,
  currentKeyOf,
  errorsLogged,
  ledgerDiagnosis,
  ledgerRows,
  MEDIA_POLICY,
  mediaPolicyYaml,
  openRemoteWorld,
  seedAssets,
  startRemoteServices,
} from '../support/remote-helpers';
import type { TestBed } from '../support/testbed';

/**
 * Guardrails on remote-delete (issue 9): a legal hold placed while the batch's work waits in the
 * ledger (admission paused) wins inside the claim statement (no call, outcome 'held'); removing it
 * lets the next run delete the asset; with audit on, one audit row per confirmed deletion.
 */
describe('guardrails: remote-delete', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    ({ bed, api } = await openRemoteWorld('guardrails_remote', { ratePerSecond: 20, burst: 2, concurrency: 2, batchSize: 3 }));
    bed.writePolicies(`${mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 2, concurrency: 2, batchSize: 3 })}    audit: { enabled: true, retainDays: 7 }\n`);
  });
  after(() => closeRemoteWorld({ bed, api }));

  const cli = (args: string[]) => runReaperCli(args, bed.processEnv());
  const allDone = async (count: number) =>
    eventually(
      `${count} operations done`,
      async () => {
        const rows = await ledgerRows(bed.pool);
        return rows.length === count && rows.every((row) => row.state === 'done') ? rows : undefined;
      },
      { timeoutMs: 40_000, describe: () => ledgerDiagnosis(bed.pool) },
    );

  test('a hold placed while the work waits is honoured by the claim; removing it lets the next run delete', async () => {
    const ids = await seedAssets(bed.pool, 'held', 6);
    const heldId = ids[1]!;
    const heldKey = await currentKeyOf(bed.pool, heldId);
    assert.equal((await cli(['pause', MEDIA_POLICY])).code, 0);
    const { scheduler, workers: [worker] } = await startRemoteServices(bed, { scheduler: 'guard-scheduler', workers: ['guard-worker'] });
    assert.equal((await cli(['trigger', MEDIA_POLICY])).code, 0);
    await eventually('every operation recorded while paused', async () => (await ledgerRows(bed.pool)).length === 6, {
      describe: () => ledgerDiagnosis(bed.pool),
    });
    assert.equal(api.calls.length, 0, 'paused: no call yet');
    assert.equal((await cli(['hold', 'add', MEDIA_POLICY, heldId, '--reason', 'legal hold 7'])).code, 0);
    assert.equal((await cli(['resume', MEDIA_POLICY])).code, 0);

    const first = await allDone(6);
    const held = first.find((row) => row.asset_id === heldId)!;
    assert.equal(held.outcome, 'held');
    assert.equal(held.attempt_count, 0, 'no call was made for the held asset');
    assert.ok(!api.calls.some((call) => call.key === heldKey), 'the stand-in never saw the held key');
    assert.deepEqual(
      first.filter((row) => row.asset_id !== heldId).map((row) => row.outcome),
      ['confirmed', 'confirmed', 'confirmed', 'confirmed', 'confirmed'],
    );

    assert.equal((await cli(['hold', 'remove', MEDIA_POLICY, heldId])).code, 0);
    assert.equal((await cli(['trigger', MEDIA_POLICY])).code, 0);
    const second = await eventually('the held asset confirmed after its hold was removed', async () => {
      const rows = await ledgerRows(bed.pool, [heldId]);
      return rows[0]?.outcome === 'confirmed' ? rows : undefined;
    }, { timeoutMs: 30_000, describe: () => ledgerDiagnosis(bed.pool) });
    assert.equal(second.length, 1, 'the same operation (same key), re-opened');
    assert.equal(api.executionsByKey().get(heldKey), 1, 'deleted once');

    const audit = await bed.pool.query<{ key: string; n: number; outcome: string; operation_key: string }>(
      `SELECT key, count(*)::int AS n, min(outcome) AS outcome, min(operation_key) AS operation_key FROM cleanup_audit WHERE policy = $1 GROUP BY key ORDER BY key`,
      [MEDIA_POLICY],
    );
    assert.deepEqual(audit.rows.map((row) => row.key), ids, 'one audit entry per confirmed asset');
    assert.ok(audit.rows.every((row) => row.n === 1 && row.outcome === 'confirmed' && row.operation_key.startsWith(`${MEDIA_POLICY}:`)));
    assert.deepEqual(errorsLogged([scheduler, worker]), []);
    assert.equal((await scheduler.stop()).code, 0);
    assert.equal((await worker.stop()).code, 0);
  });
});
