import assert from 'node:assert/strict';
import { after, describe, test } from 'node:test';
import type { FailpointName } from '../../shared/testing/failpoints';
import { eventually } from '../support/eventually';
import { triggerRunId } from '../support/fixtures';
import { assertNoLeakedProcesses, startReaper, type ReaperProcess } from '../support/processes';
import { findServers } from '../support/servers';
import { makeTestBed, type TestBed } from '../support/testbed';
import { createPartitionedTable, dropPartitionOwner, HELD_ID, partitionedPolicyYaml, partitionOwnerRole } from '../support/partitioned';

/**
 * Issue 44 "crashes at every step": a real scheduler process, logged in as its printed role, is
 * SIGKILLed at each step of a partition retirement (REAPER_TEST_FAILPOINT): after the 'detaching'
 * row committed, after DETACH ... CONCURRENTLY returned, and inside the quarantine transaction
 * before its COMMIT. A second scheduler takes the run over after the lease and finishes: each
 * retirable partition ends in reaper_retired exactly once, no partition is lost (every row of the
 * table is still in it or in reaper_retired), none is left half-detached, none dropped.
 * Both detach paths: without a default partition the detach is CONCURRENTLY (a state between two
 * transactions: killed after the intent, after the DETACH, before the quarantine's COMMIT); with
 * one, the plain DETACH in one transaction (killed after the intent, and before its COMMIT while
 * it holds the table's lock: the server rolls the DETACH back, the heir keeps and retires anew).
 */
const LEASE_MS = 3_000;

describe('partitions: a scheduler killed at each step of a retirement', () => {
  const beds: TestBed[] = [];

  after(async () => {
    await assertNoLeakedProcesses();
    const admin = (await findServers()).databaseUrl;
    for (const bed of beds) {
      const owner = partitionOwnerRole(bed);
      await bed.close();
      await dropPartitionOwner(admin, owner);
    }
  });

  // Without a default partition: DETACH ... CONCURRENTLY, a step between its own transactions.
  // With one (plain DETACH): the intent, then ONE transaction (SHARE on the partition, re-check,
  // DETACH, SET SCHEMA, audit) killed before its COMMIT while it holds the table's ACCESS EXCLUSIVE.
  const cases = [
    ...(['partition-after-begin', 'partition-after-detach', 'partition-before-commit'] satisfies FailpointName[]).map((point) => ({ point, plain: false })),
    ...(['partition-after-begin', 'partition-before-commit'] satisfies FailpointName[]).map((point) => ({ point, plain: true })),
  ];
  for (const { point, plain } of cases) {
    test(`SIGKILL at ${point}${plain ? ' (plain DETACH: a default partition exists)' : ''}: the next scheduler finishes, each retirable partition retired once, nothing lost`, async () => {
      const bed = await makeTestBed(`partitions_crash_${plain ? 'plain_' : ''}${point.replace(/-/g, '_')}`);
      beds.push(bed);
      await createPartitionedTable(bed);
      if (!plain) await bed.pool.query('DROP TABLE p_default'); // no default partition: DETACH ... CONCURRENTLY
      bed.writePolicies(partitionedPolicyYaml());
      await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', $1, 'litigation 44', 'test')`, [HELD_ID]);
      const rowsBefore = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM events_by_day')).rows[0]!.n;
      let doomed: ReaperProcess | undefined;
      let heir: ReaperProcess | undefined;
      try {
        doomed = startReaper(`${point}-doomed`, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: `${point}-doomed`, REAPER_RUN_LEASE_MS: String(LEASE_MS), REAPER_TEST_FAILPOINT: point }));
        await doomed.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
        const runId = await triggerRunId(bed, 'day-events');
        const exit = await doomed.exitWithin(30_000, 'to die at its failpoint');
        assert.deepEqual(exit, { code: null, signal: 'SIGKILL' }, `the scheduler dies by SIGKILL at ${point}`);
        const left = await bed.pool.query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions ORDER BY retirement_id');
        assert.deepEqual(left.rows, [{ source_name: 'p_old_a', state: 'detaching' }], 'the crash left one open retirement');

        heir = startReaper(`${point}-heir`, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: `${point}-heir`, REAPER_RUN_LEASE_MS: String(LEASE_MS) }));
        await eventually('the heir published the run', async () => {
          const run = await bed.pool.query<{ state: string }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [runId]);
          return run.rows[0]?.state !== 'scanning' && run.rows[0]?.state !== 'pending' ? true : undefined;
        }, { timeoutMs: 30_000 });
        const states = await bed.pool.query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions ORDER BY retirement_id');
        const quarantined = states.rows.filter((row) => row.state === 'quarantined').map((row) => row.source_name).sort();
        assert.deepEqual(quarantined, ['p_old_a', 'p_old_b'], `each retirable partition quarantined once (${JSON.stringify(states.rows)})`);
        assert.ok(states.rows.every((row) => row.state === 'quarantined' || row.state === 'kept'), 'nothing left detaching, nothing dropped');
        if (point === 'partition-after-begin' || plain) assert.deepEqual(states.rows[0], { source_name: 'p_old_a', state: 'kept' }, 'a detach that never started (or was rolled back) is recorded kept, then retired anew');
        const concurrent = await bed.pool.query<{ concurrent: boolean }>('SELECT DISTINCT concurrent FROM cleanup_partitions');
        assert.deepEqual(concurrent.rows, [{ concurrent: !plain }], plain ? 'the plain DETACH path was the one taken' : 'DETACH ... CONCURRENTLY was the one taken');
        const retired = await bed.pool.query<{ name: string }>(`SELECT tablename::text AS name FROM pg_tables WHERE schemaname = 'reaper_retired' ORDER BY 1`);
        assert.deepEqual(retired.rows.map((row) => row.name), ['p_old_a', 'p_old_b']);
        const pending = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM pg_inherits WHERE inhparent = 'events_by_day'::regclass AND inhdetachpending`);
        assert.equal(pending.rows[0]!.n, 0, 'no detach left pending');
        const stray = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM pg_tables WHERE schemaname = 'public' AND tablename IN ('p_old_a', 'p_old_b')`);
        assert.equal(stray.rows[0]!.n, 0, 'no detached table left outside the parent and outside reaper_retired');
        // No worker ran: every row is still either attached or in quarantine.
        const rowsAfter = (await bed.pool.query<{ n: number }>('SELECT (SELECT count(*) FROM events_by_day) + (SELECT count(*) FROM reaper_retired.p_old_a) + (SELECT count(*) FROM reaper_retired.p_old_b) AS n')).rows[0]!.n;
        if (plain) assert.ok((await bed.pool.query(`SELECT 1 FROM pg_inherits WHERE inhrelid = 'p_default'::regclass`)).rowCount === 1, 'the default partition stays');
        assert.equal(Number(rowsAfter), rowsBefore, 'no row lost');
      } finally {
        await doomed?.stop(2_000);
        await heir?.stop(5_000);
      }
    });
  }

  test('SIGKILL inside the drop after the quarantine: nothing dropped by the dead one, each table dropped once by the next', async () => {
    const bed = await makeTestBed('partitions_crash_drop');
    beds.push(bed);
    await createPartitionedTable(bed);
    bed.writePolicies(partitionedPolicyYaml({ quarantineDays: 0 }));
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', $1, 'litigation 44', 'test')`, [HELD_ID]);
    const services: ReaperProcess[] = [];
    const scheduler = (label: string, env: Record<string, string> = {}) => {
      const started = startReaper(label, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: label, REAPER_RUN_LEASE_MS: String(LEASE_MS), ...env }));
      services.push(started);
      return started;
    };
    const states = async () => (await bed.pool.query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions ORDER BY retirement_id')).rows;
    const retiredTables = async () => (await bed.pool.query<{ name: string }>(`SELECT tablename::text AS name FROM pg_tables WHERE schemaname = 'reaper_retired' ORDER BY 1`)).rows.map((row) => row.name);
    try {
      const first = scheduler('drop-first');
      await first.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
      await triggerRunId(bed, 'day-events');
      await eventually('both retired', async () => ((await states()).filter((row) => row.state === 'quarantined').length === 2 ? true : undefined), { timeoutMs: 30_000 });
      await first.stop(5_000);

      const doomed = scheduler('drop-doomed', { REAPER_TEST_FAILPOINT: 'partition-drop-before-commit' });
      await doomed.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
      await triggerRunId(bed, 'day-events');
      assert.deepEqual(await doomed.exitWithin(30_000, 'to die at its failpoint'), { code: null, signal: 'SIGKILL' });
      assert.deepEqual(await states(), [{ source_name: 'p_old_a', state: 'quarantined' }, { source_name: 'p_old_b', state: 'quarantined' }], 'the dead drop changed no state');
      assert.deepEqual(await retiredTables(), ['p_old_a', 'p_old_b'], 'and dropped no table');

      const heir = scheduler('drop-heir');
      await eventually('both dropped', async () => ((await states()).every((row) => row.state === 'dropped') ? true : undefined), { timeoutMs: 30_000 });
      assert.deepEqual(await states(), [{ source_name: 'p_old_a', state: 'dropped' }, { source_name: 'p_old_b', state: 'dropped' }], 'each dropped once');
      assert.deepEqual(await retiredTables(), []);
      await heir.stop(5_000);
    } finally {
      for (const service of services) await service.stop(2_000);
    }
  });

  test('a DETACH ... CONCURRENTLY interrupted half-way (inhdetachpending) is FINALIZEd by the next scheduler', async () => {
    const bed = await makeTestBed('partitions_crash_finalize');
    beds.push(bed);
    await createPartitionedTable(bed);
    await bed.pool.query('DROP TABLE p_default');
    bed.writePolicies(partitionedPolicyYaml());
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', $1, 'litigation 44', 'test')`, [HELD_ID]);
    // A reader's open transaction: DETACH ... CONCURRENTLY commits its first half (the partition
    // marked detach-pending) and then waits for it in its second.
    const reader = await bed.pool.connect();
    const services: ReaperProcess[] = [];
    try {
      await reader.query('BEGIN');
      await reader.query('SELECT count(*) FROM events_by_day');
      const doomed = startReaper('finalize-doomed', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'finalize-doomed', REAPER_RUN_LEASE_MS: String(LEASE_MS) }));
      services.push(doomed);
      await doomed.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
      await triggerRunId(bed, 'day-events');
      const waiting = await eventually('the detach waits for the reader', async () => {
        const found = await bed.pool.query<{ pid: number }>(`SELECT pid FROM pg_stat_activity WHERE query LIKE '%DETACH PARTITION%CONCURRENTLY%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`);
        return found.rows[0]?.pid;
      }, { timeoutMs: 30_000 });
      // The machine dies: the process, and with it its session (the server ends it: terminate).
      doomed.signal('SIGKILL');
      await doomed.exitWithin(10_000, 'to die');
      await bed.pool.query('SELECT pg_terminate_backend($1)', [waiting]);
      const pending = await eventually('the partition is left detach-pending', async () => {
        const found = await bed.pool.query<{ name: string }>(`SELECT c.relname::text AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'events_by_day'::regclass AND i.inhdetachpending`);
        return found.rows[0]?.name;
      }, { timeoutMs: 10_000 });
      assert.equal(pending, 'p_old_a');
      await reader.query('COMMIT');

      const heir = startReaper('finalize-heir', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'finalize-heir', REAPER_RUN_LEASE_MS: String(LEASE_MS) }));
      services.push(heir);
      await eventually('both retired', async () => {
        const rows = (await bed.pool.query<{ source_name: string; state: string }>(`SELECT source_name, state FROM cleanup_partitions WHERE state = 'quarantined' ORDER BY 1`)).rows;
        return rows.length === 2 ? rows : undefined;
      }, { timeoutMs: 30_000 });
      const left = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM pg_inherits WHERE inhparent = 'events_by_day'::regclass AND inhdetachpending`);
      assert.equal(left.rows[0]!.n, 0, 'FINALIZEd');
      assert.ok(heir.output.some((text) => text.includes('finishing an interrupted partition retirement') && text.includes('detach-pending')), 'the heir found it pending');
      const states = (await bed.pool.query<{ source_name: string; state: string }>('SELECT source_name, state FROM cleanup_partitions ORDER BY retirement_id')).rows;
      assert.deepEqual(states, [{ source_name: 'p_old_a', state: 'quarantined' }, { source_name: 'p_old_b', state: 'quarantined' }], 'one retirement each, the interrupted one finished');
    } finally {
      await reader.query('ROLLBACK').catch(() => undefined);
      reader.release();
      for (const service of services) await service.stop(2_000);
    }
  });
});
