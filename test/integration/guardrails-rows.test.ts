import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { loadPolicies, policyVersion } from '../../shared/config/policies';
import { brokerNames } from '../../shared/amqp/topology';
import { runsGetSummary, runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startScheduler } from '../../services/scheduler/scheduler';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { countReservations, databaseNowIso, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { makeRowBatch, publishBatch, rowDeletePolicyYaml } from '../support/fixtures';

/**
 * Guardrails on row-delete (issue 9): `plan` changes nothing and predicts the run, legal holds win
 * over batches already published, and the audit trail holds exactly one row per deletion.
 */
describe('guardrails: row-delete', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });
  let policiesPath: string;

  before(async () => {
    bed = await makeTestBed('guardrails_rows');
    policiesPath = bed.writePolicies(rowDeletePolicyYaml({ batchSize: 10, audit: true }));
    broker = await openTestBroker(bed.amqpUrl);
    names = brokerNames(bed.prefix);
    // Declare the topology (a worker asserts it at start) so the snapshots can count its queues.
    const env = bed.env();
    await (await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log)).stop();
  });

  after(async () => {
    await broker?.close();
    await assertNoLeakedProcesses();
    await bed?.close();
  });

  const cli = (args: string[]) => runReaperCli(args, bed.processEnv());

  /** Every table reaper or the demo writes, as one digest per table, plus the broker's queue depths. */
  async function snapshot(): Promise<Record<string, string | number>> {
    const tables = ['seat_reservations', 'cleanup_runs', 'cleanup_batches', 'cleanup_run_batches', 'cleanup_holds', 'cleanup_audit', 'cleanup_ledger', 'cleanup_admission'];
    const digest: Record<string, string | number> = {};
    for (const name of tables) {
      const row = await bed.pool.query<{ d: string }>(`SELECT coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), 'empty') AS d FROM ${name} t`);
      digest[name] = row.rows[0]!.d;
    }
    for (const queue of [names.workQueue('seat-holds'), names.deadLetterQueue]) digest[queue] = await broker.messageCount(queue);
    return digest;
  }

  async function runToCompletion(cutoff: string | null): Promise<{ deleted: number; noop: number }> {
    const env = bed.env();
    const policies = loadPolicies(env.policiesPath);
    const scheduler = await startScheduler(bed.as(env, 'scheduler'), policies, log);
    const worker = await startWorker(bed.as(env, 'worker'), policies, log);
    try {
      const run = (await runsInsertIfAbsent(bed.pool, { policy: 'seat-holds', trigger: cutoff ? 'replay' : 'manual', scheduledFor: null, cutoff }))!;
      return await eventually('the run completed', async () => {
        const summary = await runsGetSummary(bed.pool, run.runId);
        return summary?.state === 'completed' ? summary : undefined;
      });
    } finally {
      await scheduler.stop();
      await worker.stop();
    }
  }

  test('plan writes nothing, and its counts are what the following run deletes', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 35, futureHeld: 6, expiredConfirmed: 4 });
    const held = seeded.expiredHeld.slice(0, 2);
    const hold = await cli(['hold', 'add', 'seat-holds', ...held, '--reason', 'litigation 42', '--json']);
    assert.equal(hold.code, 0, hold.stdout);
    const cutoff = await databaseNowIso(bed.pool);
    const before = await snapshot();
    const planned = await cli(['plan', 'seat-holds', '--cutoff', cutoff, '--sample', '3', '--json']);
    assert.equal(planned.code, 0, planned.stdout);
    assert.deepEqual(await snapshot(), before, 'plan changed nothing, byte for byte');
    const plan = JSON.parse(planned.stdout) as Record<string, unknown>;
    assert.equal(plan.policy, 'seat-holds');
    assert.equal(plan.cutoff, cutoff);
    assert.equal(plan.candidates, 33);
    assert.equal(plan.batches, 4);
    assert.equal(plan.held, 2);
    assert.equal((plan.sample as string[]).length, 3);
    assert.ok(!(plan.sample as string[]).some((id) => held.includes(id)), 'held keys are not candidates');
    assert.ok(typeof plan.oldestExpiry === 'string' && typeof plan.newestExpiry === 'string');
    assert.ok('estimatedSeconds' in plan);

    const run = await runToCompletion(cutoff);
    assert.equal(run.deleted, plan.candidates, 'the run deleted exactly what the plan counted');
    assert.equal(await countReservations(bed.pool, held), 2, 'held rows kept');
    const future = await cli(['plan', 'seat-holds', '--cutoff', '2999-01-01T00:00:00Z']);
    assert.equal(future.code, 2, 'a future cutoff is refused as in replay');
    assert.match(future.stdout, /--cutoff: .* later than the database clock/);
  });

  test('a hold added after the batch was published keeps its row; removing it lets the next run delete it', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 8 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    // Published first (no worker yet): the batch waits in the queue while the hold is placed.
    await publishBatch(broker, names, batch);
    const held = seeded.expiredHeld[3]!;
    assert.equal((await cli(['hold', 'add', 'seat-holds', held, '--reason', 'subpoena'])).code, 0);
    const env = bed.env();
    const worker: WorkerHandle = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
    try {
      const receipt = await eventually('the receipt', async () => (await bed.pool.query('SELECT deleted, noop FROM cleanup_batches WHERE batch_id = $1', [batch.batchId])).rows[0]);
      assert.deepEqual(receipt, { deleted: 7, noop: 1 });
    } finally {
      await worker.stop();
    }
    assert.equal(await countReservations(bed.pool, [held]), 1, 'the held row survived its batch');
    const listed = JSON.parse((await cli(['hold', 'list', '--policy', 'seat-holds', '--json'])).stdout) as Array<{ key: string }>;
    assert.ok(listed.some((entry) => entry.key === held));
    assert.equal((await cli(['hold', 'remove', 'seat-holds', held])).code, 0);
    const run = await runToCompletion(null);
    assert.equal(run.deleted, 1);
    assert.equal(await countReservations(bed.pool, [held]), 0, 'deleted once the hold is gone');
    const again = await cli(['hold', 'remove', 'seat-holds', held]);
    assert.equal(again.code, 1, 'removing a hold that is not there is "not found"');
    const badId = await cli(['hold', 'add', 'seat-holds', 'not-a-uuid', '--reason', 'x']);
    assert.equal(badId.code, 2, badId.stdout);
    assert.match(badId.stdout, /<id>: .*uuid/);
  });

  test('audit: exactly one row per deletion across duplicate deliveries and a renewal race; `reaper audit` answers', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 12 });
    const batch = await makeRowBatch(bed.pool, seeded.expiredHeld);
    const { runId } = batch;
    // Renewed after the scan, before the worker: the DELETE no longer matches them.
    const renewed = seeded.expiredHeld.slice(0, 3);
    await bed.pool.query(`UPDATE seat_reservations SET expires_at = now() + interval '1 hour' WHERE reservation_id = ANY($1::uuid[])`, [renewed]);
    const env = bed.env();
    const worker = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
    try {
      for (let copy = 0; copy < 3; copy++) {
        await publishBatch(broker, names, batch);
      }
      await eventually('three deliveries settled', async () => {
        const metric = await worker.metrics.registry.getSingleMetric('reaper_batches_total')!.get();
        const settled = metric.values.filter((v) => v.labels.outcome === 'done' || v.labels.outcome === 'duplicate').reduce((sum, v) => sum + v.value, 0);
        return settled >= 3;
      });
    } finally {
      await worker.stop();
    }
    const audit = await bed.pool.query<{ key: string; n: number; version: string; batch: string }>(
      `SELECT key, count(*)::int AS n, min(policy_version) AS version, min(batch_id) AS batch FROM cleanup_audit WHERE run_id = $1 GROUP BY key`,
      [runId],
    );
    const deleted = seeded.expiredHeld.filter((id) => !renewed.includes(id));
    assert.deepEqual(audit.rows.map((row) => row.key).sort(), [...deleted].sort(), 'audit rows are exactly the deleted rows');
    assert.ok(audit.rows.every((row) => row.n === 1), 'once each');
    const version = policyVersion(loadPolicies(policiesPath).get('seat-holds')!);
    assert.ok(audit.rows.every((row) => row.version === version && row.batch === batch.batchId));
    const one = await cli(['audit', 'seat-holds', '--id', deleted[0]!, '--json']);
    assert.equal(one.code, 0, one.stdout);
    const answer = JSON.parse(one.stdout) as { deleted: boolean; entries: Array<{ runId: string; policyVersion: string }> };
    assert.equal(answer.deleted, true);
    assert.equal(answer.entries[0]!.runId, runId);
    const notDeleted = await cli(['audit', 'seat-holds', '--id', renewed[0]!]);
    assert.equal(notDeleted.code, 1, 'a renewed row has no audit entry');
    const byRun = JSON.parse((await cli(['audit', '--run', runId, '--json'])).stdout) as { total: number };
    assert.equal(byRun.total, deleted.length);
  });

  test('the scheduler keeps the audit trail to retainDays', async () => {
    const inserted = await bed.pool.query<{ key: string }>(
      `INSERT INTO cleanup_audit (policy, key, observed_expiry, policy_version, deleted_at)
       VALUES ('seat-holds', 'old-1', now() - interval '40 days', 'v', now() - interval '31 days'),
              ('seat-holds', 'young-1', now() - interval '40 days', 'v', now() - interval '29 days'),
              ('other-policy', 'old-2', now() - interval '400 days', 'v', now() - interval '400 days')
       RETURNING key`,
    );
    assert.equal(inserted.rowCount, 3);
    const env = bed.env();
    const scheduler = await startScheduler(bed.as(env, 'scheduler'), loadPolicies(env.policiesPath), log);
    try {
      await eventually('the row past retention pruned', async () =>
        (await bed.pool.query(`SELECT 1 FROM cleanup_audit WHERE key = 'old-1'`)).rowCount === 0,
      );
    } finally {
      await scheduler.stop();
    }
    const left = await bed.pool.query<{ key: string }>(`SELECT key FROM cleanup_audit WHERE key IN ('old-1', 'young-1', 'old-2') ORDER BY key`);
    assert.deepEqual(left.rows.map((row) => row.key), ['old-2', 'young-1'], 'younger rows and other policies untouched');
  });
});
