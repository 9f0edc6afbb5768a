import assert from 'node:assert/strict';
import type pg from 'pg';
import type { TestBroker } from './broker';
import { eventually } from './eventually';
import { readyAtRest, stopAllCleanly } from './fixtures';
import type { ReaperProcess } from './processes';
import { countReservations } from './seed';

/**
 * The end-of-run verdict shared by the fault tests that disturb a row-delete run (broker closing
 * connections, broker restarted, publishes refused): the run deleted every expired hold exactly
 * once, counted it once, touched nothing else, left no message behind (checked once no consumer
 * holds any), and every service drains, exits 0 and logged no error.
 */
export async function assertRunDeletedExactlyOnce(check: {
  pool: pg.Pool;
  broker: TestBroker;
  workQueue: string;
  deadLetterQueue: string;
  runId: string;
  seeded: { expiredHeld: string[]; futureHeld: string[]; expiredConfirmed: string[] };
  scheduler: ReaperProcess;
  workers: readonly ReaperProcess[];
  services: readonly ReaperProcess[];
  diagnosis?: Record<string, unknown>;
  /** Error-level log lines this fault is expected to cause (matched against "<label>: <msg> <json>"). */
  allowErrors?: RegExp;
}): Promise<void> {
  const { pool, seeded } = check;
  const receipts = (
    await pool.query<{ batches: number; deleted: number; noop: number }>(
      'SELECT count(*)::int AS batches, coalesce(sum(deleted), 0)::int AS deleted, coalesce(sum(noop), 0)::int AS noop FROM cleanup_batches WHERE run_id = $1',
      [check.runId],
    )
  ).rows[0]!;
  const remaining = await countReservations(pool, seeded.expiredHeld);
  const diagnosis = JSON.stringify({
    ...check.diagnosis,
    run: (await pool.query('SELECT state, candidates, batches_confirmed FROM cleanup_runs WHERE run_id = $1', [check.runId])).rows[0],
    receipts,
    remainingExpired: remaining,
    windowRetries: check.scheduler.lines.filter((line) => line.msg === 'run publish failed; retrying').length,
    duplicateSettles: check.workers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'duplicate')).length,
  });
  assert.equal(remaining, 0, `every expired hold is deleted by the completed run; ${diagnosis}`);
  assert.equal(receipts.deleted, seeded.expiredHeld.length, `the receipts add up to the seeded expired count; ${diagnosis}`);
  assert.equal(await countReservations(pool, seeded.futureHeld), seeded.futureHeld.length, 'no hold that had not expired is gone');
  assert.equal(await countReservations(pool, seeded.expiredConfirmed), seeded.expiredConfirmed.length, 'no confirmed reservation is gone');
  await eventually('the work queue to be empty', async () => (await check.broker.messageCount(check.workQueue)) === 0);
  assert.equal((await check.broker.drain(check.deadLetterQueue)).length, 0, 'nothing dead-lettered');
  await stopAllCleanly(check.services, { allowErrors: check.allowErrors });
  // Nothing comes back once the workers are gone: every batch was acked, not merely in a worker's hands.
  assert.equal(await readyAtRest(check.broker, check.workQueue), 0, 'no batch returned to the work queue after the services stopped');
}
