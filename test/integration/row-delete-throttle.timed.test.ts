import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import { type TestBroker } from '../support/broker';
import { closeBedAndBroker, makeRowBatch, openBedAndBroker, publishBatch, rowDeletePolicyYaml, startServices, stopAllCleanly } from '../support/fixtures';
import { runReaperCli } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';

const RATE = 300;
const BATCH = 30;
const BATCHES = 40; // 1200 rows: 4 s at the rate

/**
 * The row-delete throttle is global (issue 12): three worker processes share one bucket of rows
 * per second in PostgreSQL, so in any second they delete at most the rate plus one batch, and
 * adding workers adds no load. `reaper admission set --rate` changes it live (issue 9).
 */
describe('row-delete throttle across three workers', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    ({ bed, broker, names } = await openBedAndBroker('row_delete_throttle', `${rowDeletePolicyYaml({ batchSize: BATCH })}    admission: { rowsPerSecond: ${RATE}, concurrency: 2 }\n`));
  });

  after(() => closeBedAndBroker({ bed, broker }));

  /** Receipts' commit-side times (transaction start, database clock) with their deleted counts, in order. */
  async function deletions(batchIds: readonly string[]): Promise<Array<{ at: number; deleted: number }>> {
    const result = await bed.pool.query<{ at: number; deleted: number }>(
      `SELECT extract(epoch FROM completed_at)::float8 AS at, deleted FROM cleanup_batches WHERE batch_id = ANY($1) ORDER BY completed_at`,
      [batchIds],
    );
    return result.rows;
  }

  /** The most rows deleted within any window of `seconds` (windows start at each deletion). */
  function mostInWindow(rows: ReadonlyArray<{ at: number; deleted: number }>, seconds: number): number {
    let most = 0;
    for (let i = 0; i < rows.length; i++) {
      let sum = 0;
      for (let j = i; j < rows.length && rows[j]!.at < rows[i]!.at + seconds; j++) sum += rows[j]!.deleted;
      most = Math.max(most, sum);
    }
    return most;
  }

  async function seedBatches(count: number): Promise<BatchV1[]> {
    const seeded = await seedHolds(bed.pool, { expiredHeld: count * BATCH });
    const runId = randomUUID();
    const batches: BatchV1[] = [];
    for (let i = 0; i < count; i++) {
      batches.push(await makeRowBatch(bed.pool, seeded.expiredHeld.slice(i * BATCH, (i + 1) * BATCH), { runId, batchId: makeBatchId(runId, i + 1) }));
    }
    return batches;
  }

  test('rows per second stay within the limit plus one batch, whatever the number of workers; admission set raises it live', async () => {
    const group = startServices(bed, [1, 2, 3].map((n) => ({ label: `throttled-${n}`, kind: 'worker' as const, env: { REAPER_PREFETCH: '8' } })));
    try {
      await Promise.all(group.services.map((worker) => worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000)));
      const batches = await seedBatches(BATCHES);
      const ids = batches.flatMap((batch) => batch.items.map((item) => item.id));
      for (const batch of batches) await publishBatch(broker, names, batch);
      await group.eventuallyAlive('every row deleted', async () => (await countReservations(bed.pool, ids)) === 0, { timeoutMs: 60_000 });
      const done = await deletions(batches.map((batch) => batch.batchId));
      assert.equal(done.reduce((sum, row) => sum + row.deleted, 0), BATCHES * BATCH, 'every row deleted once');
      const most = mostInWindow(done, 1);
      const span = done[done.length - 1]!.at - done[0]!.at;
      const average = (BATCHES * BATCH - BATCH) / span; // rows after the first batch, over the time they took
      assert.ok(most <= RATE + BATCH, `at most ${RATE} + ${BATCH} rows in any second; saw ${most}`);
      assert.ok(average <= RATE * 1.05, `the average rate stays at the limit: ${average.toFixed(0)} rows/s`);
      assert.ok(average >= RATE * 0.6, `and the throttle does not starve the policy: ${average.toFixed(0)} rows/s`);

      // Live: three times the rate, without a restart.
      const set = await runReaperCli(['admission', 'set', 'seat-holds', '--rate', String(RATE * 3), '--json'], bed.processEnv({ REAPER_OPERATOR: 'throttle-test' }));
      assert.equal(set.code, 0, set.stdout);
      const shown = JSON.parse(set.stdout) as { inForce: { rate: number }; file: { rate: number }; override: { setBy: string } };
      assert.deepEqual([shown.file.rate, shown.inForce.rate, shown.override.setBy], [RATE, RATE * 3, 'throttle-test']);
      await new Promise((resolve) => setTimeout(resolve, 1_000)); // "within a second": the workers' override refresh
      const faster = await seedBatches(BATCHES);
      const fasterIds = faster.flatMap((batch) => batch.items.map((item) => item.id));
      for (const batch of faster) await publishBatch(broker, names, batch);
      await group.eventuallyAlive('every row deleted again', async () => (await countReservations(bed.pool, fasterIds)) === 0, { timeoutMs: 60_000 });
      const done2 = await deletions(faster.map((batch) => batch.batchId));
      const most2 = mostInWindow(done2, 1);
      assert.ok(most2 > RATE + BATCH, `the raised rate is in force: ${most2} rows in the busiest second`);
      assert.ok(most2 <= RATE * 3 + BATCH, `and still held: ${most2}`);
      const reset = await runReaperCli(['admission', 'reset', 'seat-holds', '--json'], bed.processEnv());
      assert.equal(reset.code, 0, reset.stdout);
      assert.equal((JSON.parse(reset.stdout) as { inForce: { rate: number } }).inForce.rate, RATE, "reset: the file's rate is in force again");
      await stopAllCleanly(group.services);
    } finally {
      await group.stopLeftovers();
    }
  });
});
