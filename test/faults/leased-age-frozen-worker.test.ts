import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { MEDIA_POLICY, mediaPolicyYaml, seedAssets, startSchedulerProcess, started, startWorkerProcess, stopStarted } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 8: reaper_oldest_leased_age_seconds rises while a worker holding a lease is frozen
 * (SIGSTOP, the real remote-delete path: the worker claimed an operation and is mid-call), as
 * exported by the scheduler's /metrics; once the worker is continued and finishes, it is 0 again.
 */
const LEASE_MS = 20_000;
const SLOW_MS = 4_000;
const REFRESH_MS = 300;

describe('oldest leased age with a frozen worker', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    bed = await makeTestBed('fault_leased_age');
    api = await startMediaApi();
    api.configure({ slowMs: SLOW_MS });
    bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: 8_000, leaseMs: LEASE_MS }));
  });

  after(async () => {
    try {
      await stopStarted();
      await assertNoLeakedProcesses();
    } finally {
      await api?.close();
      await bed?.close();
    }
  });

  test('rises while the lease holder is stopped, within a second of the truth; 0 after it finishes', { timeout: 60_000 }, async () => {
    await seedAssets(bed.pool, 'frozen', 1);
    const scheduler = startSchedulerProcess(bed, 'leased-scheduler', { HTTP_PORT: '0', REAPER_BACKLOG_REFRESH_MS: String(REFRESH_MS) });
    const worker = startWorkerProcess(bed, 'leased-worker');
    await Promise.all([started(scheduler, 'scheduler'), started(worker, 'worker')]);
    const port = Number(scheduler.lines.find((line) => line.msg === 'scheduler started')!.httpPort);
    const leasedAge = async (): Promise<number> => {
      const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
      const match = text.match(new RegExp(`^reaper_oldest_leased_age_seconds\\{policy="${MEDIA_POLICY}"\\} (\\S+)$`, 'm'));
      assert.ok(match, 'the gauge is exported for the remote-delete policy');
      return Number(match[1]);
    };
    assert.equal(await eventually('the first refresh', async () => (await leasedAge()) === 0 || undefined), true);

    assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);
    await eventually('the worker to be mid-call (holding the lease)', () => api.calls.find((call) => call.finishedAt === 0), { intervalMs: 5 });
    worker.signal('SIGSTOP');
    try {
      const first = await eventually('a lease age above 0', async () => {
        const age = await leasedAge();
        return age > 0 ? age : undefined;
      });
      const later = await eventually('the lease age to rise by 2 s while the holder is stopped', async () => {
        const age = await leasedAge();
        return age >= first + 2 ? age : undefined;
      }, { timeoutMs: 10_000 });
      // The truth by the database clock: since the claim (lease end minus the lease).
      const truth = await bed.pool.query<{ age: number }>(
        `SELECT extract(epoch FROM clock_timestamp() - (lease_expires_at - $1 * interval '1 millisecond'))::float8 AS age
         FROM cleanup_ledger WHERE state = 'in_flight'`,
        [LEASE_MS],
      );
      assert.equal(truth.rowCount, 1, 'one lease held, by the stopped worker');
      assert.ok(Math.abs(truth.rows[0]!.age - later) < 1 + REFRESH_MS / 1000, `gauge ${later} s vs truth ${truth.rows[0]!.age} s`);
    } finally {
      worker.signal('SIGCONT');
    }
    await eventually('the lease released and the gauge back to 0', async () => (await leasedAge()) === 0, { timeoutMs: 20_000 });
    assert.equal((await scheduler.stop()).code, 0);
    assert.equal((await worker.stop()).code, 0);
  });
});
