import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { bedAndBrokerSuite, rowDeletePolicyYaml, runReceipts, runRow, startServices, stopAllCleanly, type ServiceGroup } from '../support/fixtures';
import { holdCheckpointLock, releaseHeldLocks } from '../support/locks';
import { runReaperCli, startReaper, type ReaperProcess } from '../support/processes';
import { assertRunDeletedExactlyOnce } from '../support/run-checks';
import { countReservations, seedHolds } from '../support/seed';

/**
 * `--execute`: the CLI claims and publishes its run itself, with the scheduler's executor. Real
 * processes: workers, the CLI, and (where the test says so) a scheduler started in the middle.
 */
const BATCH_SIZE = 50;

/** The JSON document a CLI printed with --json (its stderr lines, if any, are around it). */
function jsonOf(output: string): Record<string, unknown> {
  const lines = output.split('\n');
  const start = lines.indexOf('{');
  const end = lines.lastIndexOf('}');
  assert.ok(start >= 0 && end > start, `a JSON document in the output: ${output}`);
  return JSON.parse(lines.slice(start, end + 1).join('\n')) as Record<string, unknown>;
}

describe('reaper trigger/replay --execute', () => {
  const world = bedAndBrokerSuite('cli_execute', { policiesYaml: rowDeletePolicyYaml({ batchSize: BATCH_SIZE }), first: releaseHeldLocks });

  /** Two workers (no scheduler: the CLI executes the runs), consuming. */
  async function startTwoWorkers(): Promise<ServiceGroup> {
    const group = startServices(world.bed, [
      { label: 'worker-1', kind: 'worker' },
      { label: 'worker-2', kind: 'worker' },
    ]);
    await group.ready().catch(async (error: unknown) => {
      await group.stopLeftovers(); // not started: no test's finally will stop them
      throw error;
    });
    return group;
  }

  /** The `finally` of a test with a CLI and a scheduler started outside the group: locks released, leftovers stopped. */
  async function stopUnlessPassed(passed: boolean, group: ServiceGroup, others: ReadonlyArray<ReaperProcess | undefined>): Promise<void> {
    await releaseHeldLocks();
    if (passed) return;
    await group.stopLeftovers();
    for (const process of others) if (process?.running) await process.stop(5_000);
  }

  /** True while the CLI's checkpoint waits on the test's lock (it is between two windows). */
  const cliWaitsOnCheckpoint = async () =>
    (
      await world.bed.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-cli' AND wait_event_type = 'Lock'`,
      )
    ).rows[0]!.n > 0;
  const latestRunId = async (trigger: string) =>
    (await world.bed.pool.query<{ run_id: string }>('SELECT run_id FROM cleanup_runs WHERE trigger = $1 ORDER BY created_at DESC LIMIT 1', [trigger])).rows[0]?.run_id;

  test('with no scheduler: the replay warns, and replay --execute deletes exactly what the original run would have (same cutoff)', async () => {
    await world.bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 3_000, futureHeld: 100, expiredConfirmed: 100 });
    // Expired now, but after the cutoff: the original run would not have deleted them.
    const later = (
      await world.bed.pool.query<{ reservation_id: string }>(
        `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
         SELECT gen_random_uuid(), 'held', now() - interval '10 minutes' + random() * interval '1 second', 'late-' || i FROM generate_series(1, 200) i
         RETURNING reservation_id`,
      )
    ).rows.map((row) => row.reservation_id);
    const cutoff = (await world.bed.pool.query<{ c: string }>(`SELECT reaper_iso(clock_timestamp() - interval '30 minutes') AS c`)).rows[0]!.c;
    const group = await startTwoWorkers();
    let passed = false;
    try {
      // Without --execute: the run is only recorded, and the operator is told nobody will run it.
      const recorded = await runReaperCli(['replay', '--policy', 'seat-holds', '--cutoff', cutoff, '--json'], world.bed.processEnv());
      assert.equal(recorded.code, 0, recorded.stdout);
      assert.match(recorded.stdout, /no scheduler has ever been seen/);
      assert.match(recorded.stdout, /--execute/);
      const original = String(jsonOf(recorded.stdout).runId);
      assert.equal((await runRow(world.bed.pool, original)).state, 'pending', 'no scheduler: the run waits');

      const replayed = await runReaperCli(['replay', '--run', original, '--execute', '--wait', '--json'], world.bed.processEnv(), 90_000);
      assert.equal(replayed.code, 0, replayed.stdout);
      const summary = jsonOf(replayed.stdout);
      assert.equal(summary.state, 'completed');
      assert.equal(summary.cutoff, cutoff, 'the replay used the original cutoff');
      assert.equal(summary.deleted, seeded.expiredHeld.length);
      assert.ok(!replayed.stdout.includes('\r') && !/\[#*-*\]/.test(replayed.stdout), 'no progress bar when piped');
      const runId = String(summary.runId);
      assert.deepEqual(await runReceipts(world.bed.pool, runId), { batches: Number(summary.batchesConfirmed), deleted: seeded.expiredHeld.length, noop: 0 });
      assert.equal(await countReservations(world.bed.pool, seeded.expiredHeld), 0, 'every row expired by the cutoff is gone');
      assert.equal(await countReservations(world.bed.pool, later), later.length, 'rows that expired after the cutoff are kept');
      assert.equal(await countReservations(world.bed.pool, seeded.futureHeld), seeded.futureHeld.length);
      assert.equal(await countReservations(world.bed.pool, seeded.expiredConfirmed), seeded.expiredConfirmed.length);
      assert.equal((await world.broker.drain(world.names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
      // The original, executed now (it would otherwise wait for the next test's scheduler), finds
      // nothing left of its rows: the replay did exactly its work.
      const originalRun = await runReaperCli(['execute', original, '--wait', '--json'], world.bed.processEnv(), 90_000);
      assert.equal(originalRun.code, 0, originalRun.stdout);
      assert.deepEqual(
        { state: jsonOf(originalRun.stdout).state, deleted: jsonOf(originalRun.stdout).deleted },
        { state: 'completed', deleted: 0 },
      );
      assert.equal(await countReservations(world.bed.pool, later), later.length, 'still kept: same cutoff');
      await stopAllCleanly(group.services);
      passed = true;
    } finally {
      if (!passed) await group.stopLeftovers();
    }
  });

  test('a scheduler started in the middle of a CLI-executed run neither duplicates nor skips a batch', async () => {
    await world.bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 20_000, futureHeld: 200, expiredConfirmed: 200 });
    const group = await startTwoWorkers();
    const [worker1, worker2] = group.services as [ReaperProcess, ReaperProcess];
    let scheduler: ReaperProcess | undefined;
    let cli: ReaperProcess | undefined;
    let passed = false;
    try {
      const checkpoints = await holdCheckpointLock(world.bed.pool);
      cli = startReaper('cli trigger --execute', ['trigger', 'seat-holds', '--execute', '--json'], world.bed.processEnv());
      await eventually('the CLI to wait at its first checkpoint', cliWaitsOnCheckpoint, { intervalMs: 20 });
      const runId = (await latestRunId('manual'))!;
      scheduler = startReaper('scheduler', ['scheduler'], world.bed.processEnv({ REAPER_WORKER_ID: 'scheduler' }));
      await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
      await checkpoints.release();

      const exit = await cli.exitWithin(90_000, 'to publish the run');
      assert.equal(exit.code, 0, cli.output.join('\n'));
      assert.equal(jsonOf(cli.output.join('\n')).outcome, 'published');
      await eventually('the run to complete', async () => (await runRow(world.bed.pool, runId)).state === 'completed', { timeoutMs: 60_000, intervalMs: 250 });
      const run = await runRow(world.bed.pool, runId);
      assert.equal(run.claim_count, 1, 'the scheduler never claimed the run the CLI held');
      assert.equal(scheduler.lines.filter((line) => line.msg === 'run scanning' && line.runId === runId).length, 0, 'the scheduler never scanned it');
      assert.equal((await runReceipts(world.bed.pool, runId)).batches, run.batches_confirmed, 'one receipt per confirmed batch: none skipped');
      const duplicates = [worker1, worker2].flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'duplicate'));
      assert.equal(duplicates.length, 0, 'no batch delivered twice');
      // With a scheduler alive, a run recorded without --execute carries no warning.
      const plain = await runReaperCli(['trigger', 'seat-holds', '--json'], world.bed.processEnv());
      assert.equal(plain.code, 0, plain.stdout);
      assert.doesNotMatch(plain.stdout, /no scheduler/);
      const plainRun = String(jsonOf(plain.stdout).runId);
      await eventually('the scheduler to complete the plain run', async () => (await runRow(world.bed.pool, plainRun)).state === 'completed', { timeoutMs: 30_000 });
      await assertRunDeletedExactlyOnce(world, { runId, seeded, scheduler, workers: [worker1, worker2] });
      passed = true;
    } finally {
      await stopUnlessPassed(passed, group, [scheduler, cli]);
    }
  });

  test('Ctrl-C (SIGINT) mid-publish stops at a window boundary, and a scheduler completes the run', async () => {
    await world.bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(world.bed.pool, { expiredHeld: 20_000, futureHeld: 200, expiredConfirmed: 200 });
    const group = await startTwoWorkers();
    const [worker1, worker2] = group.services as [ReaperProcess, ReaperProcess];
    let scheduler: ReaperProcess | undefined;
    let cli: ReaperProcess | undefined;
    let passed = false;
    try {
      const checkpoints = await holdCheckpointLock(world.bed.pool);
      cli = startReaper('cli trigger --execute', ['trigger', 'seat-holds', '--execute'], world.bed.processEnv());
      await eventually('the CLI to wait at its first checkpoint', cliWaitsOnCheckpoint, { intervalMs: 20 });
      const runId = (await latestRunId('manual'))!;
      cli.signal('SIGINT');
      await eventually('the CLI to acknowledge Ctrl-C', () => cli!.output.some((line) => /SIGINT: stopping at the next window boundary/.test(line)));
      await checkpoints.release();
      const exit = await cli.exitWithin(30_000, 'to stop after Ctrl-C');
      assert.equal(exit.code, 1, 'interrupted: not a success');
      assert.match(cli.output.join('\n'), new RegExp(`run ${runId} stopped at a window boundary.*resumable`));

      const stopped = await world.bed.pool.query<{ state: string; released: boolean; batches_confirmed: number; candidates: number }>(
        `SELECT state, lease_expires_at <= clock_timestamp() AS released, batches_confirmed, candidates::int AS candidates FROM cleanup_runs WHERE run_id = $1`,
        [runId],
      );
      const row = stopped.rows[0]!;
      assert.equal(row.state, 'scanning', 'left resumable, not finished');
      assert.equal(row.released, true, 'the lease was handed back at once');
      assert.equal(row.batches_confirmed, 32, 'exactly the first window was confirmed and checkpointed');
      assert.ok(row.candidates < seeded.expiredHeld.length, 'stopped in the middle');

      scheduler = startReaper('scheduler', ['scheduler'], world.bed.processEnv({ REAPER_WORKER_ID: 'scheduler' }));
      await eventually('the scheduler to complete the run', async () => (await runRow(world.bed.pool, runId)).state === 'completed', { timeoutMs: 60_000, intervalMs: 250 });
      assert.equal((await runRow(world.bed.pool, runId)).claim_count, 2, 'the scheduler took the run over once, from the checkpoint');
      await assertRunDeletedExactlyOnce(world, { runId, seeded, scheduler, workers: [worker1, worker2] });
      passed = true;
    } finally {
      await stopUnlessPassed(passed, group, [scheduler, cli]);
    }
  });
});
