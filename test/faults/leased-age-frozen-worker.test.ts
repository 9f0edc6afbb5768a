import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { readAgeGaugeExactly } from '../support/fixtures';
import { type MediaApi } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import { closeRemoteWorld, MEDIA_POLICY, openRemoteWorld, seedAssets, startRemoteServices } from '../support/remote-helpers';
import { type TestBed } from '../support/testbed';

/**
 * Issue 8: reaper_oldest_leased_age_seconds rises while a worker holding a lease is frozen
 * (SIGSTOP, the real remote-delete path: the worker claimed an operation and is mid-call, its
 * answer held by the stand-in), as exported by the scheduler's /metrics, and it is exactly the
 * lease's age when a pass read it (database clock); once the worker is continued and its call
 * answered, it is 0 again. Nothing here measures against the wall clock.
 */
const LEASE_MS = 20_000;
const REFRESH_MS = 300;

describe('oldest leased age with a frozen worker', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    ({ bed, api } = await openRemoteWorld('fault_leased_age', { ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: 8_000, leaseMs: LEASE_MS }));
    // The call is held until the test releases it: the worker is mid-call (holding its lease) for
    // as long as the test needs, however slowly this machine gets there.
    api.configure({ hold: true });
  });

  after(() => closeRemoteWorld({ bed, api }));

  test('rises while the lease holder is stopped, exactly the lease age by the database clock; 0 after it finishes', { timeout: 90_000 }, async () => {
    await seedAssets(bed.pool, 'frozen', 1);
    const services = { scheduler: 'leased-scheduler', workers: ['leased-worker'], schedulerEnv: { HTTP_PORT: '0', REAPER_BACKLOG_REFRESH_MS: String(REFRESH_MS) } };
    const { scheduler, workers: [worker] } = await startRemoteServices(bed, services);
    const port = Number(scheduler.lines.find((line) => line.msg === 'scheduler started')!.httpPort);
    /** Undefined until the first refresh exports the gauge (a probe's "not yet", not a failed assertion). */
    const leasedAgeIfExported = async (): Promise<number | undefined> => {
      const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
      const match = text.match(new RegExp(`^reaper_oldest_leased_age_seconds\\{policy="${MEDIA_POLICY}"\\} (\\S+)$`, 'm'));
      return match ? Number(match[1]) : undefined;
    };
    const leasedAge = async (): Promise<number> => {
      const age = await leasedAgeIfExported();
      assert.ok(age !== undefined, 'the gauge is exported for the remote-delete policy');
      return age;
    };
    assert.equal(await eventually('the first refresh', async () => (await leasedAgeIfExported()) === 0 || undefined), true);

    assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);
    await eventually('the worker to be mid-call (holding the lease)', () => api.calls.find((call) => call.finishedAt === 0), { timeoutMs: 30_000 });
    worker.signal('SIGSTOP');
    try {
      // The claim instant, by the database clock: lease end minus the lease.
      const claimed = await bed.pool.query<{ ms: number }>(
        `SELECT (extract(epoch FROM lease_expires_at - $1 * interval '1 millisecond') * 1000)::float8 AS ms FROM cleanup_ledger WHERE state = 'in_flight'`,
        [LEASE_MS],
      );
      assert.equal(claimed.rowCount, 1, 'one lease held, by the stopped worker');
      const claimedMs = claimed.rows[0]!.ms;
      const first = await readAgeGaugeExactly(bed.pool, 'the oldest leased age', claimedMs, leasedAge);
      assert.ok(first > 0, `a lease age above 0 (${first})`);
      await eventually('the lease age to rise by 2 s while the holder is stopped', async () => (await leasedAge()) >= first + 2, { timeoutMs: 30_000 });
      await readAgeGaugeExactly(bed.pool, 'the oldest leased age, later', claimedMs, leasedAge);
    } finally {
      worker.signal('SIGCONT');
      api.configure({ hold: false });
      api.release();
    }
    await eventually('the lease released and the gauge back to 0', async () => (await leasedAge()) === 0, { timeoutMs: 30_000 });
    assert.equal((await scheduler.stop()).code, 0);
    assert.equal((await worker.stop()).code, 0);
  });
});
