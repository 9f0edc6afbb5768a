import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import pino from 'pino';
import { brokerNames } from '../../shared/amqp/topology';
import { loadPolicies } from '../../shared/config/policies';
import { replicationLagEvaluate, type WalsenderRow } from '../../shared/db/queries/replication';
import { rolesSql } from '../../shared/db/queries/roles';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { makeRowBatch, publishBatch, rowDeletePolicyYaml } from '../support/fixtures';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The replica-lag brake fails closed (issue 17 item 9), tested without a real standby (the
 * standby test, row-delete-brake.timed.test.ts, needs a pg_hba replication entry):
 * - the rule, over walsender rows no test server can produce (a logical walsender, a hidden row, a
 *   delayed standby), through the very SQL text the worker runs (replicationLagEvaluate);
 * - a real worker against this server's pg_stat_replication: a standby that is gone (an inactive
 *   physical slot; a listed application_name not connected) brakes after the grace, where the
 *   old `coalesce(max(replay_lag), 0)` read lag 0 and deleted;
 * - a worker role without pg_read_all_stats refuses to start, naming the grant.
 */
const CAUGHT_UP = '0/3000000';
const BEHIND = '0/2000000';

function walsender(overrides: Partial<WalsenderRow>): WalsenderRow {
  return { applicationName: 'standby-a', state: 'streaming', replayLsn: BEHIND, replayLagSeconds: 0.2, logical: false, currentLsn: CAUGHT_UP, ...overrides };
}

describe('replica-lag brake: unknown lag is not lag 0', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  const suffix = randomBytes(4).toString('hex');
  const slot = `reaper_test_gone_standby_${suffix}`;
  const roles = { migrator: `reaper_migrator_brake_${suffix}`, scheduler: `reaper_scheduler_brake_${suffix}`, worker: `reaper_worker_brake_${suffix}`, operator: `reaper_operator_brake_${suffix}` };

  before(async () => {
    bed = await makeTestBed('replica_lag_closed');
    broker = await openTestBroker(bed.amqpUrl);
    names = brokerNames(bed.prefix);
  });

  after(async () => {
    try {
      // Slots and roles are cluster-wide: never left behind for other files.
      await bed.pool.query('SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1', [slot]);
      for (const role of Object.values(roles)) {
        if ((await bed.pool.query('SELECT 1 FROM pg_roles WHERE rolname = $1', [role])).rowCount === 0) continue;
        await bed.pool.query(`DROP OWNED BY ${pg.escapeIdentifier(role)}`);
        await bed.pool.query(`DROP ROLE ${pg.escapeIdentifier(role)}`);
      }
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

  test('the rule: physical standbys only, caught-up idle is 0, unreadable or missing is unknown', async () => {
    const evaluate = (walsenders: WalsenderRow[], inactiveSlots: string[] = [], standbys?: string[]) =>
      replicationLagEvaluate(bed.pool, { walsenders, inactiveSlots }, standbys ? { standbys } : {});
    assert.deepEqual(await evaluate([]), { standbys: 0, lagSeconds: 0, unknown: [] }, 'no standby: nothing to wait for');
    assert.deepEqual(await evaluate([walsender({ replayLagSeconds: 2.5 })]), { standbys: 1, lagSeconds: 2.5, unknown: [] });
    assert.deepEqual(
      await evaluate([walsender({}), walsender({ applicationName: 'debezium', logical: true, replayLagSeconds: 900 })]),
      { standbys: 1, lagSeconds: 0.2, unknown: [] },
      'a logical walsender (CDC) never holds the brake',
    );
    assert.deepEqual(
      await evaluate([walsender({ replayLsn: CAUGHT_UP, replayLagSeconds: null })]),
      { standbys: 1, lagSeconds: 0, unknown: [] },
      'idle and caught up: replay_lag reads NULL, and the lag is 0',
    );
    assert.deepEqual(await evaluate([walsender({ replayLagSeconds: null })]), { standbys: 1, lagSeconds: 0, unknown: ['standby-a'] }, 'behind and not reporting: unknown');
    assert.deepEqual(
      await evaluate([walsender({ applicationName: null, state: null, replayLsn: null, replayLagSeconds: null })]),
      { standbys: 1, lagSeconds: 0, unknown: ['(hidden: no pg_read_all_stats)'] },
      'a row hidden from a role without pg_read_all_stats: unknown',
    );
    assert.deepEqual(await evaluate([walsender({})], ['old_slot']), { standbys: 2, lagSeconds: 0.2, unknown: ['slot old_slot'] }, 'an inactive physical slot: a standby that is gone');
    assert.deepEqual(
      await evaluate([walsender({}), walsender({ applicationName: 'delayed', replayLagSeconds: 3600 })], ['old_slot'], ['standby-a']),
      { standbys: 1, lagSeconds: 0.2, unknown: [] },
      'with a list: a delayed standby and slots outside it are left out',
    );
    assert.deepEqual(
      await evaluate([walsender({})], [], ['standby-a', 'standby-b']),
      { standbys: 2, lagSeconds: 0.2, unknown: ['standby-b'] },
      'a listed standby that is not connected: unknown',
    );
  });

  /** Starts a worker, publishes one batch of fresh expired holds, returns what became of it. */
  async function runBrakedBatch(brakeYaml: string, label: string, throttled = true): Promise<{ deleted: number; refusedForLag: boolean; unknownGauge: number | undefined }> {
    await bed.pool.query('TRUNCATE seat_reservations');
    // Throttled, the brake is decided in the token take's statement; unthrottled, from the lag read alone.
    const admission = throttled ? '    admission: { rowsPerSecond: 5000, concurrency: 2 }\n' : '';
    bed.writePolicies(`${rowDeletePolicyYaml({ batchSize: 20 })}${admission}    brake: ${brakeYaml}\n`);
    const lines: Array<Record<string, unknown>> = [];
    const env = bed.env({ REAPER_WORKER_ID: label });
    const worker: WorkerHandle = await startWorker(env, loadPolicies(env.policiesPath), pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) }));
    try {
      const seeded = await seedHolds(bed.pool, { expiredHeld: 20 });
      const runId = randomUUID();
      await publishBatch(broker, names, await makeRowBatch(bed.pool, seeded.expiredHeld, { runId }));
      await eventually(
        'the batch deleted, or given back by the brake',
        async () =>
          (await countReservations(bed.pool, seeded.expiredHeld)) === 0 ||
          lines.some((line) => line.msg === 'row-delete not admitted in time; batches go to a delay tier' && line.reason === 'replica-lag'),
        { timeoutMs: 30_000 },
      );
      const unknownGauge = (await worker.metrics.registry.getSingleMetric('reaper_replication_lag_unknown_standbys')?.get())?.values[0]?.value;
      return {
        deleted: 20 - (await countReservations(bed.pool, seeded.expiredHeld)),
        refusedForLag: lines.some((line) => line.reason === 'replica-lag'),
        unknownGauge,
      };
    } finally {
      await worker.stop();
    }
  }

  test('a standby that is gone (an inactive physical slot) brakes once the grace is over; lag 0 no more', async () => {
    await bed.pool.query('SELECT pg_create_physical_replication_slot($1)', [slot]);
    try {
      const outcome = await runBrakedBatch('{ maxReplicationLagSeconds: 5, unknownLagGraceSeconds: 0 }', 'slot-worker');
      assert.deepEqual(outcome, { deleted: 0, refusedForLag: true, unknownGauge: 1 }, 'nothing deleted while a standby cannot be read');
    } finally {
      // Dropped at once: another file's brake (no list, 30 s grace) must not see it.
      await bed.pool.query('SELECT pg_drop_replication_slot($1)', [slot]);
    }
  });

  test('a listed standby that is not connected brakes after the grace; within the grace, deletion goes on', async () => {
    const absent = `reaper_absent_standby_${suffix}`;
    assert.deepEqual(await runBrakedBatch(`{ maxReplicationLagSeconds: 5, standbys: [${absent}], unknownLagGraceSeconds: 0 }`, 'listed-worker'), {
      deleted: 0,
      refusedForLag: true,
      unknownGauge: 1,
    });
    assert.deepEqual(await runBrakedBatch(`{ maxReplicationLagSeconds: 5, standbys: [${absent}], unknownLagGraceSeconds: 0 }`, 'unthrottled-worker', false), {
      deleted: 0,
      refusedForLag: true,
      unknownGauge: 1,
    });
    assert.deepEqual(await runBrakedBatch(`{ maxReplicationLagSeconds: 5, standbys: [${absent}], unknownLagGraceSeconds: 600 }`, 'grace-worker'), {
      deleted: 20,
      refusedForLag: false,
      unknownGauge: 1,
    });
  });

  test('a worker role without pg_read_all_stats refuses to start, naming the grant', async () => {
    bed.writePolicies(`${rowDeletePolicyYaml({ batchSize: 20 })}    brake: { maxReplicationLagSeconds: 5 }\n`);
    const policies = loadPolicies(bed.env().policiesPath);
    await bed.pool.query(rolesSql(policies, roles));
    await bed.pool.query(`REVOKE pg_read_all_stats FROM ${pg.escapeIdentifier(roles.worker)}`);
    const url = new URL(bed.databaseUrl);
    url.username = roles.worker;
    url.password = '';
    const env = bed.env({ DATABASE_URL: url.toString(), REAPER_WORKER_ID: 'unprivileged' });
    await assert.rejects(startWorker(env, policies, pino({ level: 'silent' })), (error: Error) => {
      assert.match(error.message, /seat-holds/);
      assert.match(error.message, new RegExp(`GRANT pg_read_all_stats TO "${roles.worker}"`));
      return true;
    });
    // With the grant `reaper roles --print` gives it, the same role starts.
    await bed.pool.query(`GRANT pg_read_all_stats TO ${pg.escapeIdentifier(roles.worker)}`);
    const worker = await startWorker(env, policies, pino({ level: 'silent' }));
    await worker.stop();
  });
});
