import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { makeBatchId } from '../../shared/contracts/batch';
import { loadPolicies } from '../../shared/config/policies';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { openTestBroker, type TestBroker } from '../support/broker';
import { makeRowBatch, publishBatch, rowDeletePolicyYaml } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { runReaperCli } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { requireTool, streamingStandby } from '../support/requirements';
import { startStandby, type Standby } from '../support/standby';
import { makeTestBed, type TestBed } from '../support/testbed';

const MAX_LAG_SECONDS = 1;

/**
 * The replica-lag brake (issue 12) against a real streaming standby made by this test: while the
 * standby's replay is paused (pg_wal_replay_pause) its replay lag grows past the policy's maximum
 * and row-delete admission stops; `status` and the metric say so; after pg_wal_replay_resume the
 * lag falls and the same batches are deleted.
 */
describe('row-delete: replica-lag brake', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  /** Also closed in after(): a test that times out never reaches its own finally. */
  let standby: Standby | undefined;

  before(async () => {
    bed = await makeTestBed('row_delete_brake');
    bed.writePolicies(`${rowDeletePolicyYaml({ batchSize: 50 })}    admission: { rowsPerSecond: 5000, concurrency: 2 }\n    brake: { maxReplicationLagSeconds: ${MAX_LAG_SECONDS} }\n`);
    broker = await openTestBroker(bed.amqpUrl);
    names = brokerNames(bed.prefix);
    await bed.pool.query('CREATE TABLE wal_noise (at timestamptz DEFAULT clock_timestamp(), filler text)');
  });

  after(async () => {
    try {
      await standby?.close();
      await broker?.close();
    } finally {
      await bed?.close();
    }
  });

  // A base backup of the whole test server (every test database on it) takes minutes on a busy machine.
  test('deletions stop while the standby replay is paused and resume after it catches up', { timeout: 360_000 }, async (t) => {
    if (!(await requireTool(t, streamingStandby(bed.databaseUrl)))) return;
    let worker: WorkerHandle | undefined;
    let noise: NodeJS.Timeout | undefined;
    const lines: Array<Record<string, unknown>> = [];
    try {
      standby = await startStandby(bed.databaseUrl, randomUUID().slice(0, 8));
      const lagOf = async () =>
        (await bed.pool.query<{ lag: number | null }>(`SELECT extract(epoch FROM replay_lag)::float8 AS lag FROM pg_stat_replication WHERE application_name = $1`, [standby!.name])).rows[0]?.lag ?? null;

      const log = pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) });
      const env = bed.env({ REAPER_WORKER_ID: 'braked-worker' });
      worker = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
      const braked = async () => (await worker!.metrics.registry.getSingleMetric('reaper_replication_brake_engaged')?.get())?.values.find((v) => v.labels.policy === 'seat-holds')?.value;

      // Replay paused, WAL still flowing (the standby receives it but does not apply it): its lag grows.
      await standby.pauseReplay();
      noise = setInterval(() => void bed.pool.query(`INSERT INTO wal_noise (filler) VALUES (repeat('x', 200))`).catch(() => undefined), 100);
      await eventually('the standby replay lag to pass the maximum', async () => ((await lagOf()) ?? 0) > MAX_LAG_SECONDS + 0.5, { timeoutMs: 30_000 });

      const seeded = await seedHolds(bed.pool, { expiredHeld: 200 });
      const runId = randomUUID();
      const batches = await Promise.all([0, 1, 2, 3].map((i) => makeRowBatch(bed.pool, seeded.expiredHeld.slice(i * 50, (i + 1) * 50), { runId, batchId: makeBatchId(runId, i + 1) })));
      for (const batch of batches) await publishBatch(broker, names, batch);

      // The worker held the batches for its whole admission wait and was refused for the lag.
      await eventually('the worker to give the batches back, refused by the brake', () =>
        lines.find((line) => line.msg === 'row-delete not admitted in time; batches go to a delay tier' && line.reason === 'replica-lag'), { timeoutMs: 30_000 });
      assert.equal(await braked(), 1, 'reaper_replication_brake_engaged{policy="seat-holds"} = 1');
      assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 200, 'nothing deleted while the standby lags');
      const receipts = await bed.pool.query('SELECT 1 FROM cleanup_batches WHERE run_id = $1', [runId]);
      assert.equal(receipts.rowCount, 0, 'no batch committed');
      const status = await runReaperCli(['status', '--json'], bed.processEnv());
      assert.equal(status.code, 0, status.stdout);
      const brake = (JSON.parse(status.stdout) as { policies: Array<{ policy: string; brake: { engaged: boolean; maxReplicationLagSeconds: number } | null }> }).policies.find((p) => p.policy === 'seat-holds')!.brake;
      assert.equal(brake?.engaged, true, `status shows the brake engaged: ${JSON.stringify(brake)}`);

      // Replay resumed: the standby catches up, the lag falls under the maximum, the batches come back and are deleted.
      await standby.resumeReplay();
      await eventually('every row deleted after the standby caught up', async () => (await countReservations(bed.pool, seeded.expiredHeld)) === 0, { timeoutMs: 60_000 });
      assert.equal(await braked(), 0, 'the brake is released');
      const done = await bed.pool.query<{ n: number; deleted: number }>('SELECT count(*)::int AS n, sum(deleted)::int AS deleted FROM cleanup_batches WHERE run_id = $1', [runId]);
      assert.deepEqual(done.rows[0], { n: 4, deleted: 200 }, 'each batch committed once, every row deleted once');
    } finally {
      if (noise) clearInterval(noise);
      await worker?.stop();
      await standby?.close();
      standby = undefined;
    }
  });
});
