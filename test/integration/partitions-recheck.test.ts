import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { loadPolicies, retiresPartitions } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/target';
import { retirePartitions } from '../../services/scheduler/partition-retirement';
import { testLog } from '../support/fixtures';
import { findServers } from '../support/servers';
import { databaseNowIso } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { createPartitionedTable, dropPartitionOwner, partitionedPolicyYaml, partitionOwnerRole } from '../support/partitioned';

/**
 * Issue 44 "holds placed after classification are re-checked in the transaction that detaches":
 * the retirement step runs as the scheduler's printed role, and a hold is placed on one row of the
 * partition after it was classified retirable and its intent recorded, right before its detach.
 * Plain DETACH (a default partition exists): the re-check in the detaching transaction rolls the
 * detach back. CONCURRENTLY (no default partition): the re-check under the detached table's lock
 * attaches it again. Either way the partition stays attached, recorded kept with the reason, and
 * the other retirable partition is retired.
 */
describe('partitions: a hold placed after the classification wins', () => {
  let bed: TestBed;
  let owner: string;
  let scheduler: pg.Pool;

  before(async () => {
    bed = await makeTestBed('partitions_recheck');
    owner = partitionOwnerRole(bed);
    await createPartitionedTable(bed);
    bed.writePolicies(partitionedPolicyYaml());
    scheduler = new pg.Pool({ connectionString: bed.as(bed.env(), 'scheduler').databaseUrl, max: 2 });
  });

  after(async () => {
    await scheduler?.end();
    await bed?.close();
    if (owner) await dropPartitionOwner((await findServers()).databaseUrl, owner);
  });

  /** A late hold on the first row of the first partition about to be detached (an operator, now). */
  const lateHold = async (partition: string) => {
    const key = (await bed.pool.query<{ id: string }>(`SELECT id::text FROM ONLY ${partition} ORDER BY id LIMIT 1`)).rows[0]!.id;
    await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('day-events', $1, 'late hold', 'test')`, [key]);
  };

  async function retireWithLateHold(beforeFirstDetach: (partition: string) => Promise<void> = lateHold, pool: pg.Pool = scheduler): Promise<Array<{ source_name: string; state: string; reason: string | null }>> {
    const policy = loadPolicies(bed.env().policiesPath).get('day-events')!;
    assert.ok(retiresPartitions(policy));
    const target = await targetResolve(scheduler, policy);
    await bed.pool.query('TRUNCATE cleanup_partitions, cleanup_holds');
    const placed: string[] = [];
    await retirePartitions(
      {
        pool,
        log: testLog,
        stillClaimed: () => true,
        beforeDetach: async (partition) => {
          if (placed.length > 0) return;
          await beforeFirstDetach(partition);
          placed.push(partition);
        },
      },
      { runId: randomUUID(), cutoff: await databaseNowIso(bed.pool) },
      policy,
      target,
      { room: Number.POSITIVE_INFINITY, policyVersion: 'test' },
    );
    assert.deepEqual(placed, ['public.p_old_a']);
    return (await bed.pool.query<{ source_name: string; state: string; reason: string | null }>('SELECT source_name, state, reason FROM cleanup_partitions ORDER BY retirement_id')).rows;
  }

  const attachedNames = async () =>
    (await bed.pool.query<{ name: string }>(`SELECT c.relname::text AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'events_by_day'::regclass ORDER BY 1`)).rows.map((row) => row.name);

  test('plain DETACH (default partition): the hold rolls the detach back', async () => {
    const states = await retireWithLateHold();
    assert.equal(states.length, 3, JSON.stringify(states)); // p_old_a kept; p_old_b and p_held (no hold in this file) quarantined
    assert.deepEqual(states[0]!.source_name, 'p_old_a');
    assert.equal(states[0]!.state, 'kept');
    assert.match(states[0]!.reason!, /1 of 6 row\(s\) no longer pass .* at the re-check: not detached/);
    assert.ok((await attachedNames()).includes('p_old_a'));
    assert.deepEqual(states.slice(1).map((row) => row.state), ['quarantined', 'quarantined']);
  });

  test('plain DETACH behind a reader: lock_timeout 150 ms, 8 attempts, then the partition is kept for the row path', async () => {
    const reader = await bed.pool.connect();
    try {
      const started = Date.now();
      const states = await retireWithLateHold(async () => {
        await reader.query('BEGIN');
        await reader.query('SELECT count(*) FROM events_by_day'); // ACCESS SHARE until COMMIT: DETACH needs ACCESS EXCLUSIVE
      });
      const tookMs = Date.now() - started;
      assert.deepEqual(states.map((row) => [row.source_name, row.state]), [['p_old_a', 'kept']]);
      assert.match(states[0]!.reason!, /DETACH did not get its lock within 150 ms, 8 time\(s\): left to the row path/);
      assert.ok(tookMs >= 8 * 150 + 1_400 && tookMs < 8_000, `bounded: 8 waits of 150 ms and 7 growing pauses of 1.4 s in all (${tookMs} ms)`);
      assert.ok((await attachedNames()).includes('p_old_a'));
    } finally {
      await reader.query('ROLLBACK').catch(() => undefined);
      reader.release();
    }
  });

  test('plain DETACH behind a writer of the partition: the parent is never locked ACCESS EXCLUSIVE while the partition is waited for', async () => {
    const writer = await bed.pool.connect();
    let polling = true;
    let seen = 0;
    const poller = (async () => {
      while (polling) {
        const held = await bed.pool.query(`SELECT 1 FROM pg_locks WHERE relation = 'events_by_day'::regclass AND mode = 'AccessExclusiveLock'`);
        seen += held.rowCount ?? 0;
      }
    })();
    try {
      const states = await retireWithLateHold(async () => {
        await writer.query('BEGIN');
        await writer.query('LOCK TABLE ONLY p_old_a IN ROW EXCLUSIVE MODE'); // an insert into that partition, not committed
      });
      assert.deepEqual(states.map((row) => [row.source_name, row.state]), [['p_old_a', 'kept']]);
      assert.equal(seen, 0, 'the parent was locked ACCESS EXCLUSIVE (queueing every query of the table) while the partition was waited for');
    } finally {
      polling = false;
      await poller;
      await writer.query('ROLLBACK').catch(() => undefined);
      writer.release();
    }
  });

  test('DETACH ... CONCURRENTLY (no default partition): the hold attaches it again', async () => {
    await bed.pool.query('DROP TABLE p_default');
    const states = await retireWithLateHold();
    assert.equal(states[0]!.source_name, 'p_old_a');
    assert.equal(states[0]!.state, 'kept');
    assert.match(states[0]!.reason!, /1 of 6 row\(s\) no longer pass .* at the re-check: attached again/);
    assert.ok((await attachedNames()).includes('p_old_a'));
    assert.equal((await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM events_by_day WHERE id BETWEEN 2001 AND 2006')).rows[0]!.n, 6, 'every row back in the table');
  });

  test('DETACH ... CONCURRENTLY behind an old transaction, lock timeout (55P03): left detaching for the next run, the run goes on', async () => {
    // After the test above: no default partition. The scheduler's sessions have a lock_timeout (a DBA's setting).
    const timed = new pg.Pool({ connectionString: bed.as(bed.env(), 'scheduler').databaseUrl, max: 2, options: '-c lock_timeout=200' });
    const reader = await bed.pool.connect();
    try {
      const states = await retireWithLateHold(async () => {
        await reader.query('BEGIN');
        await reader.query('SELECT count(*) FROM events_by_day'); // an old transaction that uses the table
      }, timed);
      assert.ok(states.length >= 1, JSON.stringify(states));
      assert.ok(states.every((row) => row.state === 'detaching'), JSON.stringify(states));
    } finally {
      await reader.query('ROLLBACK').catch(() => undefined);
      reader.release();
      await timed.end();
    }
  });
});
