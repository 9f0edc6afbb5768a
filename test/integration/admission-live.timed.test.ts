import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import type { MediaApi, MediaApiCall } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import { closeRemoteWorld, ledgerSummary, MEDIA_POLICY, openRemoteWorld, seedAssets, startRemoteServices } from '../support/remote-helpers';
import type { TestBed } from '../support/testbed';
import { stopAllCleanly } from '../support/fixtures';

const FILE_CAP = 4;
const BACKLOG = 150;

/** Most calls in progress at one instant at or after `fromMs` (intervals [startedAt, finishedAt)). */
function peakConcurrencyFrom(calls: readonly MediaApiCall[], fromMs: number, toMs = Number.POSITIVE_INFINITY): number {
  const events: Array<[number, number]> = [];
  for (const call of calls) {
    const end = call.finishedAt === 0 ? Number.POSITIVE_INFINITY : call.finishedAt;
    const start = Math.max(call.startedAt, fromMs);
    const stop = Math.min(end, toMs);
    if (start < stop) events.push([start, 1], [stop, -1]);
  }
  events.sort((a, b) => a[0] - b[0] || a[1] - b[1]); // an end before a start at the same instant
  let now = 0;
  let peak = 0;
  for (const [, delta] of events) peak = Math.max(peak, (now += delta));
  return peak;
}

/**
 * Live admission control (issue 9): `reaper admission set --concurrency 1` reaches three running
 * workers within a second, without a restart: from the next second on no two remote calls
 * overlap; `reaper admission reset` brings back the file's cap. Who set it and when is stored.
 */
describe('admission set/reset: live, on every worker', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    ({ bed, api } = await openRemoteWorld('admission_live', { ratePerSecond: 50, burst: 5, concurrency: FILE_CAP, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 }, { slowMs: 100 }));
  });

  after(() => closeRemoteWorld({ bed, api }));

  test('--concurrency 1: no two calls overlap from the next second on; reset restores the file cap', async () => {
    await seedAssets(bed.pool, 'live', BACKLOG);
    const { all } = await startRemoteServices(bed, { scheduler: 'live-scheduler', workers: [1, 2, 3].map((n) => `live-worker-${n}`) });
    const trigger = await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv());
    assert.equal(trigger.code, 0, trigger.stdout);
    await eventually('calls under the file cap, overlapping', () => peakConcurrencyFrom(api.calls, 0) > 1, { timeoutMs: 30_000 });

    const set = await runReaperCli(['admission', 'set', MEDIA_POLICY, '--concurrency', '1', '--json'], bed.processEnv({ REAPER_OPERATOR: 'live-test' }));
    assert.equal(set.code, 0, set.stdout);
    const setAt = Date.now();
    const view = JSON.parse(set.stdout) as { file: { concurrency: number }; inForce: { concurrency: number }; override: { setBy: string; setAt: string } };
    assert.deepEqual([view.file.concurrency, view.inForce.concurrency, view.override.setBy], [FILE_CAP, 1, 'live-test']);
    const stored = await bed.pool.query<{ set_by: string }>('SELECT set_by FROM cleanup_admission_overrides WHERE policy = $1', [MEDIA_POLICY]);
    assert.deepEqual(stored.rows, [{ set_by: 'live-test' }], 'stored in PostgreSQL with who (and when)');

    // A second and a half of calls under the override, then back to the file.
    const from = setAt + 1_000;
    await eventually('calls under the override', () => api.calls.filter((call) => call.startedAt >= from + 500).length >= 3, { timeoutMs: 30_000 });
    const show = await runReaperCli(['admission', 'show', '--policy', MEDIA_POLICY, '--json'], bed.processEnv());
    assert.equal((JSON.parse(show.stdout) as Array<{ inForce: { concurrency: number } }>)[0]!.inForce.concurrency, 1, 'show: the override is in force');
    const resetStarting = Date.now(); // the reset may be in force before the command returns
    const reset = await runReaperCli(['admission', 'reset', MEDIA_POLICY, '--json'], bed.processEnv());
    assert.equal(reset.code, 0, reset.stdout);
    const resetAt = Date.now();
    const underOverride = peakConcurrencyFrom(api.calls, from, resetStarting);
    assert.equal(underOverride, 1, `from a second after the set on, no two calls overlap (peak ${underOverride})`);

    await eventually('the backlog drained', async () => (await ledgerSummary(bed.pool))['done/confirmed'] === BACKLOG, { timeoutMs: 60_000 });
    const afterReset = peakConcurrencyFrom(api.calls, resetAt + 1_000);
    assert.ok(afterReset > 1 && afterReset <= FILE_CAP, `after reset the file's cap is in force again: peak ${afterReset} (cap ${FILE_CAP})`);
    const statusRun = await runReaperCli(['status', '--json'], bed.processEnv());
    const status = JSON.parse(statusRun.stdout) as { policies: Array<{ policy: string; admission: { override: unknown; inForce: { concurrency: number } } }> };
    const row = status.policies.find((p) => p.policy === MEDIA_POLICY)!;
    assert.deepEqual([row.admission.override, row.admission.inForce.concurrency], [null, FILE_CAP], 'status shows the file values in force');

    await stopAllCleanly(all);
  });
});
