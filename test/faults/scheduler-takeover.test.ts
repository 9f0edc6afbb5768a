import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { ADAPTIVE } from '../../shared/admission/adaptive';
import { batchesFor } from '../../services/scheduler/run-executor';
import type { FailpointName } from '../../shared/testing/failpoints';
import { type TestBroker } from '../support/broker';
import { closeBedAndBroker, openBedAndBroker, readyAtRest, rowDeletePolicyYaml, runRow, startServices, stopAllCleanly, triggerRunId } from '../support/fixtures';
import { holdCheckpointLock, releaseHeldLocks, schedulerWaitsOnCheckpoint } from '../support/locks';
import { startReaper, stopLeftovers, type LogLine, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';

/**
 * A scheduler that dies mid-run (docs/design.md, run state machine: "lease expired: another
 * scheduler claims it (claim_count + 1) and resumes from the cursor with the SAME cutoff"), with
 * real processes and rows seeded, at each of the scheduler's failpoints (REAPER_TEST_FAILPOINT,
 * shared/testing/failpoints.ts): the first replica SIGKILLs itself there, a second replica takes
 * the run over once the lease has run out, and the run completes with every expired row deleted
 * exactly once. What the second claim publishes again (the window that was on the broker but not
 * checkpointed) reaches the workers twice and is counted as no-ops, never deleted twice. A replica
 * stopped with SIGTERM mid-run hands its lease over at once instead.
 */
const BATCH_SIZE = 50;
/**
 * The run's first window, confirmed together, then checkpointed: the policy is adaptive (the
 * default) and no rate is in force at its start, so the first window is two seconds (batchesFor) of the
 * law's floor (run-executor.ts paceWindow, issue 41): 20 batches here. The windows after it are
 * full (32 batches) once a worker's first take found nobody else, or no take came in time.
 */
const WINDOW_BATCHES = Math.min(32, batchesFor(ADAPTIVE.floorRowsPerSecond, BATCH_SIZE));
const EXPIRED = 4_000; // 80 batches: 20 + 32 + 28
const FUTURE = 100;
const CONFIRMED = 100;
const TOTAL_BATCHES = EXPIRED / BATCH_SIZE;
/** Short, so a takeover after a crash happens within the test; long enough for a window under load. */
const LEASE_MS = 4_000;

interface BatchReceipt {
  batch_id: string;
  deleted: number;
  noop: number;
}

describe('scheduler crash and takeover', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    ({ bed, broker, names } = await openBedAndBroker('fault_scheduler_takeover', rowDeletePolicyYaml({ batchSize: BATCH_SIZE })));
  });

  after(() => closeBedAndBroker({ bed, broker }, releaseHeldLocks));

  const receiptsOfRun = async (runId: string): Promise<BatchReceipt[]> =>
    (await bed.pool.query<BatchReceipt>('SELECT batch_id, deleted, noop FROM cleanup_batches WHERE run_id = $1 ORDER BY batch_id', [runId])).rows;
  const expectedBatchIds = async (runId: string): Promise<string[]> =>
    (await bed.pool.query<{ batch_id: string }>('SELECT batch_id FROM cleanup_run_batches WHERE run_id = $1 ORDER BY batch_id', [runId])).rows.map((row) => row.batch_id);
  const leaseOf = async (runId: string) =>
    (
      await bed.pool.query<{ owner: string; lease_ms: number; cursor_key: string | null }>(
        `SELECT owner, (extract(epoch FROM lease_expires_at) * 1000)::float8 AS lease_ms, cursor_key FROM cleanup_runs WHERE run_id = $1`,
        [runId],
      )
    ).rows[0]!;
  /** Each test starts from a clean table and no open run (a failed earlier test may leave one scanning). */
  const freshStart = async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    await bed.pool.query(`UPDATE cleanup_runs SET state = 'failed', error = 'left by an earlier test', lease_expires_at = NULL WHERE state IN ('pending', 'scanning', 'published')`);
    return seedHolds(bed.pool, { expiredHeld: EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
  };
  const ids = (runId: string, from: number, to: number, claim: number): string[] => {
    const list: string[] = [];
    for (let sequence = from; sequence <= to; sequence++) list.push(`${runId}:${String(sequence).padStart(6, '0')}${claim > 1 ? `-c${claim}` : ''}`);
    return list;
  };
  const scanningLine = (scheduler: ReaperProcess, runId: string, claim: number) =>
    scheduler.waitForLine(`claim ${claim} of run ${runId}`, (line) => line.msg === 'run scanning' && line.runId === runId && line.claim === claim, 30_000);
  const triggerRun = (): Promise<string> => triggerRunId(bed, 'seat-holds');
  const logTime = (line: LogLine): number => Date.parse(String(line.time));

  /**
   * The verdict shared by every takeover: the run completed under the second claim with the cutoff
   * it was created with; the checkpointed windows kept their first-claim ids and everything after
   * them carries "-c2"; every expired row was deleted exactly once (receipts add up to the seeded
   * count, nothing else touched); the rows published twice are exactly the no-ops.
   */
  async function assertTakenOverRun(runId: string, cutoff: string, checkpointedByFirst: number, seeded: Awaited<ReturnType<typeof seedHolds>>) {
    const run = await runRow(bed.pool, runId);
    assert.equal(run.state, 'completed', `the run completes: ${JSON.stringify(run)}`);
    assert.equal(run.claim_count, 2, 'claimed twice: the crashed replica, then the one that took over');
    assert.equal(run.cutoff, cutoff, 'the second claim kept the cutoff the run was created with');
    assert.equal(run.candidates, EXPIRED, 'every expired row counted once as a candidate');
    assert.equal(run.batches_confirmed, TOTAL_BATCHES);
    assert.deepEqual(
      await expectedBatchIds(runId),
      [...ids(runId, 1, checkpointedByFirst, 1), ...ids(runId, checkpointedByFirst + 1, TOTAL_BATCHES, 2)].sort(),
      'checkpointed windows keep the first claim ids; the rest are claim-numbered (-c2), their sequence continuing',
    );
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0, 'every expired hold is gone');
    assert.equal(await countReservations(bed.pool, seeded.futureHeld), FUTURE, 'no hold that had not expired is gone');
    assert.equal(await countReservations(bed.pool, seeded.expiredConfirmed), CONFIRMED, 'no confirmed reservation is gone');
    const receipts = await receiptsOfRun(runId);
    const deleted = receipts.reduce((sum, r) => sum + r.deleted, 0);
    const noop = receipts.reduce((sum, r) => sum + r.noop, 0);
    assert.equal(deleted, EXPIRED, 'each expired row deleted exactly once across both claims');
    // Batches of the first claim that reached the broker but were never checkpointed: their rows
    // were published again under the second claim, so each of those rows met one delete and one no-op.
    const expected = new Set(await expectedBatchIds(runId));
    const republished = receipts.filter((r) => !expected.has(r.batch_id));
    const republishedRows = republished.reduce((sum, r) => sum + r.deleted + r.noop, 0);
    assert.ok(republished.every((r) => !r.batch_id.endsWith('-c2')), 'only first-claim batches are outside the checkpointed set');
    assert.equal(noop, republishedRows, 'the republished rows, and only they, are counted as no-ops');
    assert.equal(receipts.length, TOTAL_BATCHES + republished.length, 'one receipt per batch published');
    return { republishedBatches: republished.length, noop };
  }

  for (const point of ['scheduler-after-publish', 'scheduler-after-confirm', 'scheduler-after-checkpoint'] satisfies FailpointName[]) {
    test(`SIGKILL at ${point}: a second replica takes the run over after the lease, same cutoff, each row deleted once`, async () => {
      const seeded = await freshStart();
      const workQueue = names.workQueue('seat-holds');
      let doomed: ReaperProcess | undefined;
      let heir: ReaperProcess | undefined;
      let workers: ReturnType<typeof startServices> | undefined;
      try {
        // No worker yet: the batches of the crashed claim stay in the queue, and the heir's scan
        // finds their rows still there, so they are published twice (the case to prove).
        doomed = startReaper(`${point}-doomed`, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: `${point}-doomed`, REAPER_RUN_LEASE_MS: String(LEASE_MS), REAPER_TEST_FAILPOINT: point }));
        await doomed.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
        const runId = await triggerRun();
        const createdCutoff = (await runRow(bed.pool, runId)).cutoff;
        const exit = await doomed.exitWithin(30_000, 'to die at its failpoint');
        assert.deepEqual(exit, { code: null, signal: 'SIGKILL' }, `the scheduler dies by SIGKILL at ${point}`);
        assert.ok(doomed.output.some((text) => text.includes(`"failpoint":"${point}"`)), 'it died at the armed failpoint');

        const left = await runRow(bed.pool, runId);
        const lease = await leaseOf(runId);
        assert.equal(left.state, 'scanning', 'the crashed replica left the run mid-scan');
        assert.equal(left.claim_count, 1);
        assert.equal(lease.owner, `${point}-doomed`);
        const checkpointed = point === 'scheduler-after-checkpoint' ? WINDOW_BATCHES : 0;
        assert.equal(left.batches_confirmed, checkpointed, 'the first window was checkpointed only when the failpoint came after the checkpoint');
        // What the crashed claim left on the broker (no consumer: the count is final once it is stable).
        const onBroker = await readyAtRest(broker, workQueue);
        if (point === 'scheduler-after-publish') {
          // The batch whose confirm came back is there; how many of the rest reached the broker
          // before the SIGKILL is up to the socket. Whatever number: each must become a no-op once.
          assert.ok(onBroker >= 1 && onBroker <= WINDOW_BATCHES, `1..${WINDOW_BATCHES} first-window batches on the broker (${onBroker})`);
        } else {
          assert.equal(onBroker, WINDOW_BATCHES, 'the whole first window was confirmed by the broker before the crash');
        }

        heir = startReaper(`${point}-heir`, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: `${point}-heir`, REAPER_RUN_LEASE_MS: String(LEASE_MS) }));
        const claimed = await scanningLine(heir, runId, 2);
        assert.ok(logTime(claimed) >= lease.lease_ms - 5, `the heir claimed the run only after the lease ran out (claimed ${logTime(claimed) - lease.lease_ms} ms after it)`);
        assert.equal(claimed.cutoff, createdCutoff, 'the heir scans with the original cutoff');
        if (checkpointed > 0) assert.equal((claimed.resumedFrom as { key?: string } | null)?.key, lease.cursor_key, 'it resumes from the checkpointed cursor');
        else assert.equal(claimed.resumedFrom, null, 'nothing was checkpointed: it starts from the beginning');
        await heir.waitForLine('the run published', (line) => line.msg === 'run published' && line.runId === runId, 30_000);

        workers = startServices(bed, [
          { label: `${point}-worker-1`, kind: 'worker' },
          { label: `${point}-worker-2`, kind: 'worker' },
        ]);
        await workers.eventuallyAlive('the run to complete', async () => (await runRow(bed.pool, runId)).state === 'completed', {
          timeoutMs: 60_000,
          describe: async () => ({ run: await runRow(bed.pool, runId), receipts: (await receiptsOfRun(runId)).length }),
        });
        const firstClaimOnBroker = point === 'scheduler-after-checkpoint' ? 0 : onBroker;
        // The run completes once its checkpointed batches have receipts; the crashed claim's
        // uncheckpointed copies are not among them and may still be in a worker's hands then (a
        // CI run caught the check a moment early: 0 of 32). Wait for their receipts too.
        await workers.eventuallyAlive('every batch on the broker settled, the crashed claim\'s copies included', async () => (await receiptsOfRun(runId)).length === TOTAL_BATCHES + firstClaimOnBroker, {
          timeoutMs: 30_000,
          describe: async () => ({ receipts: (await receiptsOfRun(runId)).length, expected: TOTAL_BATCHES + firstClaimOnBroker }),
        });
        const { republishedBatches, noop } = await assertTakenOverRun(runId, createdCutoff, checkpointed, seeded);
        assert.equal(republishedBatches, firstClaimOnBroker, 'every uncheckpointed batch the crashed claim left on the broker was delivered, and its rows published again');
        assert.equal(noop, firstClaimOnBroker * BATCH_SIZE, 'each of their rows is one no-op');
        console.log(`[scheduler-takeover] ${point}: first-claim batches on the broker=${onBroker} republished=${republishedBatches} noop rows=${noop}`);
        assert.equal((await broker.drain(names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
        await stopAllCleanly([heir, ...workers.services]);
        assert.equal(await readyAtRest(broker, workQueue), 0, 'no batch left or returned');
      } finally {
        await stopLeftovers([...(doomed ? [doomed] : []), ...(heir ? [heir] : []), ...(workers?.services ?? [])]);
      }
    });
  }

  test('SIGTERM mid-run: the replica checkpoints, releases the lease, and another resumes at once', async () => {
    const seeded = await freshStart();
    // A lease far longer than the test: a takeover within it can only come from the release.
    const longLease = { REAPER_RUN_LEASE_MS: '600000' };
    const group = startServices(bed, [
      { label: 'term-worker-1', kind: 'worker' },
      { label: 'term-worker-2', kind: 'worker' },
    ]);
    let second: ReaperProcess | undefined;
    const first = startReaper('term-first', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'term-first', ...longLease }));
    try {
      await first.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
      const checkpoints = await holdCheckpointLock(bed.pool);
      const runId = await triggerRun();
      const createdCutoff = (await runRow(bed.pool, runId)).cutoff;
      await scanningLine(first, runId, 1);
      await group.eventuallyAlive('the first replica to wait on its first checkpoint', () => schedulerWaitsOnCheckpoint(bed.pool), { timeoutMs: 20_000, intervalMs: 20 });
      // The second replica is up before the first one stops, and cannot claim: the lease is held.
      second = startReaper('term-second', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'term-second', ...longLease }));
      await second.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);

      first.signal('SIGTERM');
      await first.waitForLine('draining', (line) => line.msg === 'scheduler draining');
      await checkpoints.release();
      const exit = await first.exitWithin(30_000, 'to drain');
      const stoppedAt = Date.now();
      assert.deepEqual(exit, { code: 0, signal: null }, 'the first replica drains and exits 0');

      const claimed = await scanningLine(second, runId, 2);
      const handOverMs = logTime(claimed) - stoppedAt;
      assert.ok(handOverMs < 10_000, `the second replica took over at once (${handOverMs} ms after the first exited), not after the 600 s lease`);
      assert.equal(claimed.cutoff, createdCutoff);
      assert.notEqual(claimed.resumedFrom, null, 'it resumes from the checkpoint the first replica wrote while stopping');

      await group.eventuallyAlive('the run to complete', async () => (await runRow(bed.pool, runId)).state === 'completed', { timeoutMs: 60_000 });
      const { republishedBatches, noop } = await assertTakenOverRun(runId, createdCutoff, WINDOW_BATCHES, seeded);
      assert.equal(republishedBatches, 0, 'a graceful hand-over republishes nothing');
      assert.equal(noop, 0);
      await stopAllCleanly([first, second, ...group.services]);
      assert.equal(await readyAtRest(broker, names.workQueue('seat-holds')), 0);
    } finally {
      await releaseHeldLocks();
      await stopLeftovers([first, ...(second ? [second] : []), ...group.services]);
    }
  });
});
