import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import type { TestBroker } from '../support/broker';
import { countReservations, seedHolds } from '../support/seed';
import { runReaperCli } from '../support/processes';
import type { TestBed } from '../support/testbed';
import {
  closeBedAndBroker,
  databaseNowMs,
  makeRowBatch,
  openBedAndBroker,
  publishBatch,
  rowDeletePolicyYaml,
  startServices,
  stopAllCleanly,
} from '../support/fixtures';

/**
 * Issue 20 item 1, with a real scheduler and worker: a schedule window (UTC, to the second)
 * computed from the clock when the test starts, closed for its first ~25 s, then open for 20 s,
 * then closed again. While closed: no run starts (cron ticks are skipped), `reaper trigger` is
 * refused, a batch already in the work queue is not deleted (the worker sends it to a delay tier
 * until the opening), `reaper status` and the metrics say "outside window, opens at ...". Once
 * open: one catch-up run for the skipped ticks, and everything is deleted. Closed again: ticks
 * are skipped again. Waits are polls with deadlines on the real clock, no sleeps.
 */
const CLOSED_FIRST_MS = 25_000;
const OPEN_FOR_MS = 20_000;
const hhmmss = (at: Date) => at.toISOString().slice(11, 19);

describe('schedule window with a real scheduler and worker', () => {
  let bed: TestBed;
  let broker: TestBroker;
  before(async () => {
    ({ bed, broker } = await openBedAndBroker('schedule_window'));
  });
  after(() => closeBedAndBroker({ bed, broker }));

  test('closed: nothing runs or deletes, trigger refused, status and metric say when it opens; open: caught up and deleted', { timeout: 180_000 }, async () => {
    const names = brokerNames(bed.prefix);
    const now = await databaseNowMs(bed.pool);
    const opensAt = new Date(Math.ceil((now + CLOSED_FIRST_MS) / 1000) * 1000);
    const closesAt = new Date(opensAt.getTime() + OPEN_FOR_MS);
    // Two ticks a minute: one 10 s before the opening (skipped), one 3 s after the close (skipped);
    // none while open, so the run that deletes is the catch-up run the opening makes.
    const second = (at: number) => new Date(at).getUTCSeconds();
    const schedule = `${second(opensAt.getTime() - 10_000)},${second(closesAt.getTime() + 3_000)} * * * * *`;
    const yaml = `${rowDeletePolicyYaml({ schedule, batchSize: 10 })}    window: { start: "${hhmmss(opensAt)}", end: "${hhmmss(closesAt)}", timeZone: "UTC" }\n`;
    bed.writePolicies(yaml);
    const seeded = await seedHolds(bed.pool, { expiredHeld: 20 });
    const group = startServices(bed, [
      { label: 'scheduler', kind: 'scheduler', env: { HTTP_PORT: '0' } },
      { label: 'worker', kind: 'worker' },
    ]);
    const [scheduler, worker] = group.services as [(typeof group.services)[number], (typeof group.services)[number]];
    try {
      await group.ready(20_000);
      const started = await scheduler.waitForLine('http listening', (line) => line.msg === 'http listening');
      const metricsUrl = `http://127.0.0.1:${String(started.httpPort)}/metrics`;

      // --- closed ---
      const status = JSON.parse((await runReaperCli(['status', '--json'], bed.processEnv())).stdout) as { policies: Array<{ window: { open: boolean; opensAt: string | null; summary: string } | null }> };
      assert.equal(status.policies[0]!.window?.open, false);
      assert.equal(status.policies[0]!.window?.opensAt, opensAt.toISOString());
      const shown = await runReaperCli(['status'], bed.processEnv());
      assert.match(shown.stdout, new RegExp(`outside window \\(${hhmmss(opensAt)}-${hhmmss(closesAt)} UTC\\), opens at ${opensAt.toISOString().replace(/\./g, '\\.')}`));

      const refused = await runReaperCli(['trigger', 'seat-holds'], bed.processEnv());
      assert.equal(refused.code, 1, refused.stdout);
      assert.match(refused.stdout, /policy seat-holds is outside window .*opens at .*nothing recorded/);

      const metrics = await (await fetch(metricsUrl)).text();
      assert.match(metrics, /^reaper_policy_window_open\{policy="seat-holds"\} 0$/m);
      assert.match(metrics, new RegExp(`^reaper_policy_window_opens_at_seconds\\{policy="seat-holds"\\} ${opensAt.getTime() / 1000}$`, 'm'));

      // A batch already in the work queue (published before the window closed, say) is not deleted.
      const early = await makeRowBatch(bed.pool, seeded.expiredHeld.slice(0, 5), { policy: 'seat-holds' });
      await publishBatch(broker, names, early);
      const delayed = await worker.waitForLine('the early batch delayed until the opening', (line) => line.msg === 'batch delayed' && line.batchId === early.batchId);
      assert.match(String(delayed.reason), /outside window/);
      await scheduler.waitForLine('a cron tick skipped', (line) => line.msg === 'tick outside the schedule window: skipped until the window opens');

      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 20, 'nothing deleted while closed');
      const runsWhileClosed = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_runs')).rows[0]!.n;
      assert.equal(runsWhileClosed, 0, 'no run recorded while closed (ticks skipped, trigger refused)');
      assert.ok((await databaseNowMs(bed.pool)) < opensAt.getTime(), 'the checks above ran while the window was still closed (a slower machine: raise CLOSED_FIRST_MS)');

      // --- open ---
      await group.eventuallyAlive('every row deleted once the window opened', async () => (await countReservations(bed.pool, seeded.expiredHeld)) === 0, { timeoutMs: OPEN_FOR_MS + CLOSED_FIRST_MS });
      const deletions = await bed.pool.query<{ first: Date }>('SELECT min(completed_at) AS first FROM cleanup_batches');
      assert.ok(deletions.rows[0]!.first.getTime() >= opensAt.getTime(), `the first deletion (${deletions.rows[0]!.first.toISOString()}) is not before the opening`);
      const runs = await bed.pool.query<{ trigger: string; created: Date }>('SELECT trigger, created_at AS created FROM cleanup_runs ORDER BY created_at');
      assert.ok(runs.rows.length > 0 && runs.rows.every((run) => run.created.getTime() >= opensAt.getTime()), 'runs start only inside the window');
      assert.deepEqual(runs.rows.map((run) => run.trigger), ['catch-up'], 'the opening makes one catch-up run for the tick skipped while closed');

      // --- closed again ---
      await group.eventuallyAlive('the window closed again', async () => /reaper_policy_window_open\{policy="seat-holds"\} 0/.test(await (await fetch(metricsUrl)).text()), { timeoutMs: OPEN_FOR_MS + 10_000 });
      const after = await seedHolds(bed.pool, { expiredHeld: 3 });
      const runsAtClose = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_runs')).rows[0]!.n;
      const skippedBefore = scheduler.lines.filter((line) => line.msg === 'tick outside the schedule window: skipped until the window opens').length;
      await group.eventuallyAlive('a cron tick skipped after the close', () => scheduler.lines.filter((line) => line.msg === 'tick outside the schedule window: skipped until the window opens').length > skippedBefore, { timeoutMs: 20_000 });
      assert.equal((await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_runs')).rows[0]!.n, runsAtClose, 'no new run after the close');
      assert.equal(await countReservations(bed.pool, after.expiredHeld), 3, 'rows expired after the close wait for the next window');

      await stopAllCleanly(group.services);
    } finally {
      await group.stopLeftovers();
    }
  });
});
