import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { openTestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { readyAtRest, startServices, stopAllCleanly } from '../support/fixtures';
import { assertNoLeakedProcesses, startReaper, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Scheduler replicas and restarts, with real processes on a two-second schedule:
 *  - three replicas on one schedule make exactly one run per tick, and no tick is skipped;
 *  - a scheduler that was down across at least two ticks makes, on restart, ONE catch-up run for
 *    the latest missed tick (recorded as 'catch-up'), not one run per missed tick;
 *  - three replicas and two workers over seeded rows, some of them expiring while the test runs:
 *    every run is claimed and scanned by exactly one replica, and every row that expired is
 *    deleted exactly once (receipts add up), nothing else.
 * Each test uses its own policy name, so runs of one never count as history for the other.
 */
const TICK_MS = 2_000;

function policiesYaml(name: string, batchSize = 100): string {
  return `policies:
  - name: ${name}
    kind: row-delete
    schedule: "*/2 * * * * *"
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
    guard: { status: held }
    batchSize: ${batchSize}
`;
}

interface RunRow {
  run_id: string;
  trigger: string;
  scheduled_ms: number;
  state: string;
}

describe('scheduler replicas and catch-up', () => {
  let bed: TestBed;

  before(async () => {
    bed = await makeTestBed('fault_scheduler_replicas');
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await bed?.close();
    }
  });

  const runsOf = async (policy: string): Promise<RunRow[]> =>
    (
      await bed.pool.query<RunRow>(
        `SELECT run_id, trigger, (extract(epoch FROM scheduled_for) * 1000)::float8 AS scheduled_ms, state
         FROM cleanup_runs WHERE policy = $1 ORDER BY scheduled_for`,
        [policy],
      )
    ).rows;

  const databaseNowMs = async (): Promise<number> =>
    (await bed.pool.query<{ ms: number }>('SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8 AS ms')).rows[0]!.ms;

  const startScheduler = (label: string): ReaperProcess =>
    startReaper(label, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: label }));

  const errorsLogged = (processes: ReaperProcess[]) =>
    processes.flatMap((p) => p.lines.filter((line) => Number(line.level) >= 50).map((line) => `${p.label}: ${line.msg}`));

  test('three replicas on one schedule: one run per tick, every tick present once', async () => {
    const policy = 'ticks-replicated';
    bed.writePolicies(policiesYaml(policy));
    const replicas = ['replica-a', 'replica-b', 'replica-c'].map(startScheduler);
    await Promise.all(replicas.map((r) => r.waitForLine('scheduler started', (line) => line.msg === 'scheduler started')));
    const allStartedMs = await databaseNowMs();

    // At least three ticks with all three replicas proposing every one of them.
    await eventually(
      'at least 3 runs for ticks after all replicas started',
      async () => (await runsOf(policy)).filter((run) => run.scheduled_ms > allStartedMs).length >= 3,
      { timeoutMs: 60_000, describe: () => runsOf(policy) },
    );
    const stops = await Promise.all(replicas.map((r) => r.stop()));
    assert.deepEqual(
      stops.map((s) => s.code),
      [0, 0, 0],
      'every replica drains and exits 0',
    );

    const runs = await runsOf(policy);
    assert.ok(runs.length >= 3, `at least three runs (got ${runs.length})`);

    // Exactly one run per (policy, scheduled_for).
    const perTick = new Map<number, number>();
    for (const run of runs) perTick.set(run.scheduled_ms, (perTick.get(run.scheduled_ms) ?? 0) + 1);
    const duplicated = [...perTick].filter(([, n]) => n > 1);
    assert.deepEqual(duplicated, [], 'no tick has more than one run');

    // Every run is on a tick of the schedule (whole even seconds), and no tick between the first
    // and the last is missing.
    for (const run of runs) assert.equal(run.scheduled_ms % TICK_MS, 0, `run ${run.run_id} is scheduled for a tick (${new Date(run.scheduled_ms).toISOString()})`);
    const first = runs[0]!.scheduled_ms;
    const last = runs[runs.length - 1]!.scheduled_ms;
    const expectedTicks: number[] = [];
    for (let tick = first; tick <= last; tick += TICK_MS) expectedTicks.push(tick);
    assert.deepEqual(
      runs.map((run) => new Date(run.scheduled_ms).toISOString()),
      expectedTicks.map((tick) => new Date(tick).toISOString()),
      'every tick from the first run to the last is present exactly once',
    );

    // Ticks seen by all three replicas are plain cron runs (no replica mistook one for a catch-up).
    const withAllReplicas = runs.filter((run) => run.scheduled_ms > allStartedMs);
    assert.ok(withAllReplicas.length >= 3);
    assert.deepEqual(
      withAllReplicas.map((run) => run.trigger),
      withAllReplicas.map(() => 'cron'),
      'ticks proposed by three running replicas are cron runs',
    );

    // One 'run created' line per run across all replicas: the losers of a tick log nothing.
    const created = replicas.flatMap((r) => r.lines.filter((line) => line.msg === 'run created').map((line) => String(line.runId)));
    assert.deepEqual([...created].sort(), runs.map((run) => run.run_id).sort(), 'each run was created by exactly one replica');
    assert.deepEqual(errorsLogged(replicas), [], 'no replica logged an error');
  });

  test('a scheduler down across two ticks makes exactly one catch-up run on restart', async () => {
    const policy = 'ticks-catch-up';
    bed.writePolicies(policiesYaml(policy));

    const firstLife = startScheduler('scheduler-first-life');
    await firstLife.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
    await firstLife.waitForLine('a cron run', (line) => line.msg === 'run created' && line.trigger === 'cron', 30_000);
    const firstExit = await firstLife.stop();
    assert.equal(firstExit.code, 0, 'the scheduler drains and exits 0 on SIGTERM');
    assert.equal(
      firstLife.lines.filter((line) => line.msg === 'run created' && line.trigger === 'catch-up').length,
      0,
      'no history yet: the first start makes no catch-up run',
    );

    const before = await runsOf(policy);
    assert.ok(before.length >= 1);
    const lastBeforeStop = before[before.length - 1]!.scheduled_ms;

    // Down across at least two ticks, measured on the database clock (the clock runs are made from).
    await eventually('two ticks to pass with no scheduler running', async () => (await databaseNowMs()) >= lastBeforeStop + 2 * TICK_MS + 300, {
      timeoutMs: 30_000,
      intervalMs: 50,
    });
    assert.equal((await runsOf(policy)).length, before.length, 'nothing made runs while the scheduler was down');

    const secondLife = startScheduler('scheduler-second-life');
    const catchUpLine = await secondLife.waitForLine('the catch-up run', (line) => line.msg === 'run created' && line.trigger === 'catch-up', 30_000);
    const catchUpSeenAtMs = await databaseNowMs();
    // Let it run on: the next cron tick after the restart is a plain cron run.
    await secondLife.waitForLine('a cron run after the restart', (line) => line.msg === 'run created' && line.trigger === 'cron', 30_000);
    // The catch-up run is a real run: executed to the end like any other (no rows: zero batches).
    await eventually('the catch-up run to complete', async () => (await runsOf(policy)).find((run) => run.run_id === catchUpLine.runId)?.state === 'completed', {
      timeoutMs: 20_000,
      describe: () => runsOf(policy),
    });
    const secondExit = await secondLife.stop();
    assert.equal(secondExit.code, 0);

    const runs = await runsOf(policy);
    const afterStop = runs.filter((run) => run.scheduled_ms > lastBeforeStop);
    const catchUps = afterStop.filter((run) => run.trigger === 'catch-up');
    assert.equal(catchUps.length, 1, `exactly one catch-up run (runs after the stop: ${JSON.stringify(afterStop.map((r) => [r.trigger, new Date(r.scheduled_ms).toISOString()]))})`);
    assert.equal(runs.filter((run) => run.trigger === 'catch-up').length, 1, 'exactly one catch-up run in total');
    const catchUp = catchUps[0]!;
    assert.equal(catchUp.run_id, catchUpLine.runId);
    assert.ok(catchUp.scheduled_ms > lastBeforeStop, 'the catch-up run is for a tick after the last run before the stop');
    assert.ok(catchUp.scheduled_ms >= lastBeforeStop + 2 * TICK_MS, 'it stands for the latest missed tick, not the first one');
    assert.ok(catchUp.scheduled_ms <= catchUpSeenAtMs, 'it is for a tick that had already passed when the scheduler came back');
    assert.equal(catchUp.scheduled_ms % TICK_MS, 0, 'the catch-up run is scheduled for a tick of the schedule');

    // The missed ticks before it are ONE backlog: no run of any kind for them.
    const between = runs.filter((run) => run.scheduled_ms > lastBeforeStop && run.scheduled_ms < catchUp.scheduled_ms);
    assert.deepEqual(between, [], 'missed ticks are covered by the one catch-up run, not one run each');
    // After the catch-up, only cron runs.
    const later = runs.filter((run) => run.scheduled_ms > catchUp.scheduled_ms);
    assert.ok(later.length >= 1);
    assert.ok(later.every((run) => run.trigger === 'cron'));

    assert.deepEqual(errorsLogged([firstLife, secondLife]), [], 'no error logged');
  });

  test('three replicas compete over real scans: each run scanned by one replica, each expired row deleted once', async () => {
    const policy = 'ticks-scanned';
    bed.writePolicies(policiesYaml(policy, 50));
    await bed.pool.query('DELETE FROM seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 3_000, futureHeld: 100, expiredConfirmed: 100 });
    const broker = await openTestBroker(bed.amqpUrl);
    const group = startServices(bed, [
      { label: 'scan-worker-1', kind: 'worker' },
      { label: 'scan-worker-2', kind: 'worker' },
      { label: 'scan-replica-a', kind: 'scheduler' },
      { label: 'scan-replica-b', kind: 'scheduler' },
      { label: 'scan-replica-c', kind: 'scheduler' },
    ]);
    const replicas = group.services.slice(2);
    let expiring: string[] = [];
    try {
      // Once a first run has completed (the 3,000 rows): rows that expire one by one during the next
      // 6 s, so that later ticks' runs find new work however long the services took to start.
      await group.eventuallyAlive('a first completed run', async () => (await bed.pool.query(`SELECT 1 FROM cleanup_runs WHERE policy = $1 AND state = 'completed' AND candidates > 0`, [policy])).rowCount! > 0, {
        timeoutMs: 90_000,
        intervalMs: 250,
      });
      expiring = (
        await bed.pool.query<{ reservation_id: string }>(
          `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
           SELECT gen_random_uuid(), 'held', clock_timestamp() + i * interval '20 milliseconds' + random() * interval '1 millisecond', 'late-' || i
           FROM generate_series(1, 300) i RETURNING reservation_id`,
        )
      ).rows.map((row) => row.reservation_id);
      const lastExpiryMs = (await bed.pool.query<{ ms: number }>(`SELECT (extract(epoch FROM max(expires_at)) * 1000)::float8 AS ms FROM seat_reservations WHERE seat LIKE 'late-%'`)).rows[0]!.ms;
      // Until a run whose cutoff is after the last expiry has completed: then every seeded row that expires has been scanned.
      await group.eventuallyAlive(
        'a completed run with a cutoff after the last expiry',
        async () =>
          (
            await bed.pool.query(`SELECT 1 FROM cleanup_runs WHERE policy = $1 AND state = 'completed' AND extract(epoch FROM cutoff) * 1000 > $2`, [policy, lastExpiryMs])
          ).rowCount! > 0,
        { timeoutMs: 90_000, intervalMs: 250 },
      );
      await stopAllCleanly(group.services);

      const runs = (
        await bed.pool.query<{ run_id: string; state: string; claim_count: number; candidates: number; batches_confirmed: number }>(
          `SELECT run_id, state, claim_count, candidates::int AS candidates, batches_confirmed FROM cleanup_runs WHERE policy = $1 AND state <> 'pending' ORDER BY scheduled_for`,
          [policy],
        )
      ).rows;
      const scans = replicas.flatMap((replica) => replica.lines.filter((line) => line.msg === 'run scanning').map((line) => ({ replica: replica.label, runId: String(line.runId), claim: line.claim })));
      const withWork = runs.filter((run) => run.candidates > 0);
      console.log(
        `[scheduler-replicas] runs=${runs.length} with rows=${withWork.length} scans per replica=${JSON.stringify(Object.fromEntries(replicas.map((r) => [r.label, scans.filter((s) => s.replica === r.label).length])))}`,
      );
      assert.ok(withWork.length >= 2, `several runs found rows to publish (${withWork.length})`);
      for (const run of runs) {
        assert.equal(run.claim_count, 1, `run ${run.run_id} was claimed once (no replica took it from another)`);
        assert.deepEqual(
          scans.filter((scan) => scan.runId === run.run_id).map((scan) => scan.claim),
          [1],
          `run ${run.run_id} was scanned by exactly one replica`,
        );
      }
      // Stopped replicas may leave their last tick's run pending or scanning; every run that published completed.
      assert.deepEqual(runs.filter((run) => run.batches_confirmed > 0 && run.state !== 'completed'), [], 'every run that published batches completed');

      const perRun = (
        await bed.pool.query<{ run_id: string; batches: number; items: number; deleted: number }>(
          `SELECT run_id, count(*)::int AS batches, sum(deleted + noop)::int AS items, sum(deleted)::int AS deleted FROM cleanup_batches WHERE policy = $1 GROUP BY run_id`,
          [policy],
        )
      ).rows;
      for (const run of withWork) {
        const receipts = perRun.find((row) => row.run_id === run.run_id);
        assert.equal(receipts?.batches, run.batches_confirmed, `run ${run.run_id}: one receipt per published batch`);
        assert.equal(receipts?.items, run.candidates, `run ${run.run_id}: every candidate reached a worker once`);
      }
      const deleted = perRun.reduce((sum, row) => sum + row.deleted, 0);
      assert.equal(await countReservations(bed.pool, [...seeded.expiredHeld, ...expiring]), 0, 'every held row that expired is gone');
      assert.equal(deleted, seeded.expiredHeld.length + expiring.length, 'and each was deleted exactly once (the receipts add up)');
      assert.equal(await countReservations(bed.pool, seeded.futureHeld), seeded.futureHeld.length, 'no row that had not expired is gone');
      assert.equal(await countReservations(bed.pool, seeded.expiredConfirmed), seeded.expiredConfirmed.length, 'no confirmed row is gone');
      assert.equal(await readyAtRest(broker, brokerNames(bed.prefix).workQueue(policy)), 0, 'no batch left in the work queue');
    } finally {
      await group.stopLeftovers();
      await broker.close();
    }
  });
});
