import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import type { TestBroker } from '../support/broker';
import { countReservations, seedHolds } from '../support/seed';
import { runReaperCli } from '../support/processes';
import type { TestBed } from '../support/testbed';
import {
  closeBedAndBroker,
  combinedPoliciesYaml,
  databaseNowMs,
  makeRowBatch,
  openBedAndBroker,
  publishBatch,
  rowDeletePolicyYaml,
  startServices,
  stopAllCleanly,
} from '../support/fixtures';

/**
 * Issue 20 item 1, with a real scheduler and worker, and two policies of one table:
 *  - seat-holds (held rows): its window opens in about an hour, so it is closed for the whole test
 *    and nothing about it depends on this machine's speed. Closed: no run starts (cron ticks are
 *    skipped), `reaper trigger` is refused, a batch already in the work queue is not deleted (the
 *    worker sends it to a delay tier until the opening), `reaper status` and the metrics say
 *    "outside window, opens at ...".
 *  - seat-holds-soon (confirmed rows): a window computed from the clock when the test starts,
 *    closed for its first ~25 s, then open for 20 s, then closed again. Ticks every second outside
 *    the open window, so a tick is skipped as soon as the scheduler is up. Once open: one catch-up
 *    run for the skipped ticks, and everything is deleted. Closed again: ticks are skipped again.
 * Issue 43: all the closed checks used to run on the one window before its opening ("a slower
 * machine: raise CLOSED_FIRST_MS"); now only the services' start (bounded by group.ready, well
 * under CLOSED_FIRST_MS) must come before an opening. Waits are polls with deadlines, no sleeps.
 */
const CLOSED_FIRST_MS = 25_000;
const OPEN_FOR_MS = 20_000;
const READY_WITHIN_MS = 15_000;
const hhmmss = (at: Date) => at.toISOString().slice(11, 19);
const SKIPPED = 'tick outside the schedule window: skipped until the window opens';
const CLOSED = 'seat-holds';
const SOON = 'seat-holds-soon';

/** Every second of the minute at least a second away from the seconds of [from, to] (a cron seconds field). */
function secondsOutside(from: Date, to: Date): string {
  const inside = new Set<number>();
  for (let at = from.getTime() - 1_000; at <= to.getTime() + 1_000; at += 1_000) inside.add(new Date(at).getUTCSeconds());
  return Array.from({ length: 60 }, (_, second) => second).filter((second) => !inside.has(second)).join(',');
}

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
    const closedOpensAt = new Date(Math.ceil((now + 3_600_000) / 1000) * 1000);
    const closedClosesAt = new Date(closedOpensAt.getTime() + OPEN_FOR_MS);
    const opensAt = new Date(Math.ceil((now + CLOSED_FIRST_MS) / 1000) * 1000);
    const closesAt = new Date(opensAt.getTime() + OPEN_FOR_MS);
    // The soon policy's ticks: every second outside its open window, so none while open and the run
    // that deletes is the catch-up run the opening makes.
    const closedYaml = `${rowDeletePolicyYaml({ name: CLOSED, schedule: '* * * * * *', batchSize: 10 })}    window: { start: "${hhmmss(closedOpensAt)}", end: "${hhmmss(closedClosesAt)}", timeZone: "UTC" }\n`;
    const soonYaml = `${rowDeletePolicyYaml({ name: SOON, schedule: `${secondsOutside(opensAt, closesAt)} * * * * *`, batchSize: 10, guard: { status: 'confirmed' } })}    window: { start: "${hhmmss(opensAt)}", end: "${hhmmss(closesAt)}", timeZone: "UTC" }\n`;
    bed.writePolicies(combinedPoliciesYaml(closedYaml, soonYaml));
    const seeded = await seedHolds(bed.pool, { expiredHeld: 20, expiredConfirmed: 20 });
    const group = startServices(bed, [
      { label: 'scheduler', kind: 'scheduler', env: { HTTP_PORT: '0' } },
      { label: 'worker', kind: 'worker' },
    ]);
    const [scheduler, worker] = group.services as [(typeof group.services)[number], (typeof group.services)[number]];
    const skipped = (policy: string) => scheduler.lines.filter((line) => line.msg === SKIPPED && line.policy === policy).length;
    const runsOf = async (policy: string) =>
      (await bed.pool.query<{ trigger: string; created: Date }>('SELECT trigger, created_at AS created FROM cleanup_runs WHERE policy = $1 ORDER BY created_at', [policy])).rows;
    try {
      await group.ready(READY_WITHIN_MS);
      const started = await scheduler.waitForLine('http listening', (line) => line.msg === 'http listening');
      const metricsUrl = `http://127.0.0.1:${String(started.httpPort)}/metrics`;

      // --- the soon policy, before its opening: the only step bound to its clock ---
      await scheduler.waitForLine('a tick of the soon policy skipped', (line) => line.msg === SKIPPED && line.policy === SOON);
      assert.ok((await databaseNowMs(bed.pool)) < opensAt.getTime(), `the scheduler skipped a tick before the opening (services ready within ${READY_WITHIN_MS} ms, the opening ${CLOSED_FIRST_MS} ms after the start)`);

      // --- closed (the policy closed all along: no deadline) ---
      const status = JSON.parse((await runReaperCli(['status', '--json'], bed.processEnv())).stdout) as { policies: Array<{ policy: string; window: { open: boolean; opensAt: string | null; summary: string } | null }> };
      const closedStatus = status.policies.find((policy) => policy.policy === CLOSED);
      assert.equal(closedStatus?.window?.open, false);
      assert.equal(closedStatus?.window?.opensAt, closedOpensAt.toISOString());
      const shown = await runReaperCli(['status'], bed.processEnv());
      assert.match(shown.stdout, new RegExp(`outside window \\(${hhmmss(closedOpensAt)}-${hhmmss(closedClosesAt)} UTC\\), opens at ${closedOpensAt.toISOString().replace(/\./g, '\\.')}`));

      const refused = await runReaperCli(['trigger', CLOSED], bed.processEnv());
      assert.equal(refused.code, 1, refused.stdout);
      assert.match(refused.stdout, /policy seat-holds is outside window .*opens at .*nothing recorded/);

      const metrics = await (await fetch(metricsUrl)).text();
      assert.match(metrics, /^reaper_policy_window_open\{policy="seat-holds"\} 0$/m);
      assert.match(metrics, new RegExp(`^reaper_policy_window_opens_at_seconds\\{policy="seat-holds"\\} ${closedOpensAt.getTime() / 1000}$`, 'm'));

      // A batch already in the work queue (published before the window closed, say) is not deleted.
      const early = await makeRowBatch(bed.pool, seeded.expiredHeld.slice(0, 5), { policy: CLOSED });
      await publishBatch(broker, names, early);
      const delayed = await worker.waitForLine('the early batch delayed until the opening', (line) => line.msg === 'batch delayed' && line.batchId === early.batchId);
      assert.match(String(delayed.reason), /outside window/);
      await scheduler.waitForLine('a cron tick skipped', (line) => line.msg === SKIPPED && line.policy === CLOSED);

      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 20, 'nothing deleted while closed');
      assert.deepEqual(await runsOf(CLOSED), [], 'no run recorded while closed (ticks skipped, trigger refused)');

      // --- the soon policy: open ---
      await group.eventuallyAlive('every row of the soon policy deleted once its window opened', async () => (await countReservations(bed.pool, seeded.expiredConfirmed)) === 0, { timeoutMs: OPEN_FOR_MS + CLOSED_FIRST_MS });
      const deletions = await bed.pool.query<{ first: Date }>('SELECT min(b.completed_at) AS first FROM cleanup_batches b JOIN cleanup_runs r USING (run_id) WHERE r.policy = $1', [SOON]);
      assert.ok(deletions.rows[0]!.first.getTime() >= opensAt.getTime(), `the first deletion (${deletions.rows[0]!.first.toISOString()}) is not before the opening`);
      const runs = await runsOf(SOON);
      assert.ok(runs.length > 0 && runs.every((run) => run.created.getTime() >= opensAt.getTime()), 'runs start only inside the window');
      assert.deepEqual(runs.map((run) => run.trigger), ['catch-up'], 'the opening makes one catch-up run for the ticks skipped while closed');
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 20, 'the closed policy\'s rows are still there');

      // --- the soon policy: closed again ---
      await group.eventuallyAlive('the window closed again', async () => /reaper_policy_window_open\{policy="seat-holds-soon"\} 0/.test(await (await fetch(metricsUrl)).text()), { timeoutMs: OPEN_FOR_MS + 10_000 });
      const later = await seedHolds(bed.pool, { expiredHeld: 0, expiredConfirmed: 3 });
      const runsAtClose = (await runsOf(SOON)).length;
      const skippedBefore = skipped(SOON);
      await group.eventuallyAlive('a cron tick skipped after the close', () => skipped(SOON) > skippedBefore, { timeoutMs: 20_000 });
      assert.equal((await runsOf(SOON)).length, runsAtClose, 'no new run after the close');
      assert.equal(await countReservations(bed.pool, later.expiredConfirmed), 3, 'rows expired after the close wait for the next window');
      assert.deepEqual(await runsOf(CLOSED), [], 'the closed policy never ran');

      await stopAllCleanly(group.services);
    } finally {
      await group.stopLeftovers();
    }
  });
});
