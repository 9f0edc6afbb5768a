import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import pg from 'pg';
import { assertTopology, makeTopology } from '../../shared/amqp/topology';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { holdCheckpointLock, releaseHeldLocks } from '../support/locks';
import { assertNoLeakedProcesses, startReaper, stopLeftovers } from '../support/processes';
import { measureRecovery } from '../support/run-checks';
import { findServers } from '../support/servers';
import { brokerObjectNames, makeTestBed, type TestBed } from '../support/testbed';

/**
 * The test infrastructure keeps its promises (issue 13 item 5): a test bed drops its database
 * whatever else fails, deletes what the topology declared over AMQP, held locks are released, and
 * the leak check sees processes a clean-up helper stopped quietly.
 */
describe('test support', () => {
  let bed: TestBed;

  before(async () => {
    bed = await makeTestBed('test_support');
  });

  after(async () => {
    try {
      await releaseHeldLocks();
      await assertNoLeakedProcesses();
    } finally {
      await bed?.close();
    }
  });

  const databasesNamed = async (label: string): Promise<string[]> => {
    const admin = new pg.Client({ connectionString: (await findServers()).databaseUrl });
    await admin.connect();
    try {
      return (await admin.query<{ datname: string }>('SELECT datname FROM pg_database WHERE datname LIKE $1', [`reaper_test_${label}_%`])).rows.map((r) => r.datname);
    } finally {
      await admin.end();
    }
  };

  // The fault tests' recovery figure. Before the work-left check, a fault whose work had all
  // finished before it ended polled until its timeout (30 s in runUnderFault): this test's own
  // timeout, far under the 600 s asked for, is what fails then.
  test("a fault's recovery: none at once when no work is left; polled while a run is open; measured from a completion after the fault", { timeout: 30_000 }, async () => {
    assert.deepEqual(await measureRecovery(bed.pool, 'nothing to do', Date.now(), 600_000), { fault: 'nothing to do', ms: null }, 'no run, no ledger operation: no recovery, at once');
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'recovery-probe', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    try {
      const since = Date.now();
      const started = performance.now();
      assert.deepEqual(await measureRecovery(bed.pool, 'open run', since, 600), { fault: 'open run', ms: null }, 'an open run and no completion: polled to its timeout');
      assert.ok(performance.now() - started >= 600, 'an open run keeps it polling until the timeout');
      const measuring = measureRecovery(bed.pool, 'a receipt after the fault', since, 20_000);
      await bed.pool.query(
        `INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id, completed_at)
         VALUES ($1, $2, 'recovery-probe', 1, 1, 0, 'test', clock_timestamp())`,
        [`${run.runId}:000001`, run.runId],
      );
      const measured = await measuring;
      const elapsed = Date.now() - since;
      assert.equal(measured.fault, 'a receipt after the fault');
      // Measured from the fault (since) to the receipt: after the 600 ms poll above, and no later than now.
      assert.ok(measured.ms !== null && measured.ms >= 600 && measured.ms <= elapsed, `the receipt committed after the fault is its recovery: ${JSON.stringify(measured)} (since the fault: ${elapsed} ms)`);
    } finally {
      await bed.pool.query('DELETE FROM cleanup_batches WHERE run_id = $1', [run.runId]);
      await bed.pool.query('DELETE FROM cleanup_runs WHERE run_id = $1', [run.runId]);
    }
  });

  test('a migration that fails drops the database it was run in', async () => {
    const label = `tb_migrate_fails_${process.pid}`;
    await assert.rejects(
      makeTestBed(label, {
        migrate: async () => {
          throw new Error('migration 0042 is broken');
        },
      }),
      /migration 0042 is broken/,
    );
    assert.deepEqual(await databasesNamed(label), [], 'no database left behind');
  });

  test('the database is dropped even when the broker clean-up fails, and close() still reports the failure', async () => {
    const label = `tb_broker_down_${process.pid}`;
    const doomed = await makeTestBed(label, { cleanupAmqpUrl: 'amqp://guest:guest@127.0.0.1:1' });
    assert.equal((await databasesNamed(label)).length, 1);
    await assert.rejects(doomed.close(), /ECONNREFUSED|connect/);
    assert.deepEqual(await databasesNamed(label), [], 'the database is dropped anyway');
  });

  test("close() deletes every queue and exchange under the bed's prefixes: the topology's, and a test's own (probe queues, a policy written elsewhere)", async () => {
    const label = `tb_broker_clean_${process.pid}`;
    const other = await makeTestBed(label);
    other.writePolicies(rowDeletePolicyYaml({ name: 'clean-me' }));
    const extraPrefix = `${other.prefix}-extra`;
    other.processEnv({ REAPER_AMQP_PREFIX: extraPrefix }); // a process of this file was given another prefix
    const connection = await amqp.connect(other.amqpUrl);
    try {
      const channel = await connection.createChannel();
      for (const prefix of [other.prefix, extraPrefix]) {
        await assertTopology(channel, makeTopology({ prefix, policies: ['clean-me', 'seat-holds', 'media-assets'], deliveryLimit: 20 }));
      }
      // What the topology does not know: the dead-letter CLI test's `cleanup.other`, the settle-safety
      // test's `settle-probe`, an exchange of a test's own (issue 22: every full run used to leave them).
      const own = { queues: [`${other.prefix}.cleanup.other`, `${other.prefix}.settle-probe`, `${extraPrefix}.probe`], exchanges: [`${other.prefix}.probe-exchange`] };
      for (const queue of own.queues) await channel.assertQueue(queue, { durable: false });
      for (const exchange of own.exchanges) await channel.assertExchange(exchange, 'fanout', { durable: false });
      await channel.close();
      await other.close();
      const expected = [...[other.prefix, extraPrefix].map((prefix) => brokerObjectNames(prefix, ['clean-me', 'seat-holds', 'media-assets'])), own];
      const stillThere: string[] = [];
      for (const { queues, exchanges } of expected) {
        for (const [name, check] of [
          ...queues.map((q) => [q, 'checkQueue'] as const),
          ...exchanges.map((e) => [e, 'checkExchange'] as const),
        ]) {
          // A passive check of a missing object closes the channel with 404: one channel per check.
          const probe = await connection.createChannel();
          probe.on('error', () => undefined); // the 404 is the expected answer, read from the rejection below
          const found = await (check === 'checkQueue' ? probe.checkQueue(name) : probe.checkExchange(name)).then(
            () => true,
            () => false,
          );
          if (found) {
            stillThere.push(name);
            await probe.close();
          }
        }
      }
      assert.deepEqual(stillThere, [], 'nothing declared for the prefixes is left on the broker');
      assert.ok(expected[0]!.queues.includes(`${other.prefix}.cleanup.clean-me`), 'the written policy was among the deleted queues');
    } finally {
      await connection.close();
      await other.close();
    }
  });

  test('the leak check fails a file whose leftover processes were stopped quietly by a clean-up helper', async () => {
    const worker = startReaper('quietly-stopped', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'quietly-stopped' }));
    await worker.waitForLine('worker started', (line) => line.msg === 'worker started');
    await stopLeftovers([worker]);
    assert.equal(worker.running, false, 'the clean-up helper stopped it');
    await assert.rejects(assertNoLeakedProcesses(), /test left processes running: quietly-stopped/);
    await assertNoLeakedProcesses(); // reported once, then forgotten
    // A process that had already exited is not a leak.
    const done = startReaper('exits-alone', ['worker'], bed.processEnv({ HTTP_PORT: 'eighty' }));
    await done.exitWithin(20_000);
    await stopLeftovers([done]);
    await assertNoLeakedProcesses();
  });

  test('a held checkpoint lock is released by releaseHeldLocks() when a test does not release it', async () => {
    const lock = await holdCheckpointLock(bed.pool);
    assert.equal(lock.held, true);
    await releaseHeldLocks();
    assert.equal(lock.held, false);
    // The table takes writes again at once (a lock still held would make this wait, then time out).
    const client = await bed.pool.connect();
    try {
      await client.query('BEGIN');
      await client.query(`SET LOCAL lock_timeout = '2s'`);
      await client.query('LOCK TABLE cleanup_run_batches IN ROW EXCLUSIVE MODE');
    } finally {
      await client.query('ROLLBACK').catch(() => undefined); // nothing was written; a failed LOCK already ended it
      client.release();
    }
    await lock.release(); // idempotent
  });
});
