import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel, type ConsumeMessage } from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { eventually } from '../support/eventually';
import { rowDeletePolicyYaml, stopAllCleanly } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli, startReaper, stopLeftovers, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The batch-version gate matches consumers to workers by identity (issue 17 item 6). A version-2
 * worker killed with SIGKILL leaves a heartbeat row that reads as fresh for 15 s; counted against
 * the work queue's consumers, that row used to stand in for an unannounced (version-1) consumer
 * that connected meanwhile, and version 2 was published to it. Now every announcing worker must
 * also prove on the broker that it consumes the queue (its presence queue has a consumer).
 * Here the killed worker's row is kept fresh by the test, to hold that 15 s window open.
 */
describe('batch version gate: identities, not counts', () => {
  let bed: TestBed;
  let connection: ChannelModel;
  let channel: Channel;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    bed = await makeTestBed('version_gate_identity');
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 10 }));
    connection = await amqp.connect(bed.amqpUrl);
    channel = await connection.createChannel();
    names = brokerNames(bed.prefix);
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await connection?.close().catch(() => undefined); // already closed: nothing to release
      await bed?.close();
    }
  });

  /** `trigger --execute` publishing version 2 if the gate allows it; its output (the gate logs at info). */
  const executeRun = async (): Promise<{ runId: string; output: string }> => {
    const done = await runReaperCli(['trigger', 'seat-holds', '--execute', '--json'], bed.processEnv({ REAPER_BATCH_VERSION: '2', LOG_LEVEL: 'info' }), 60_000);
    assert.equal(done.code, 0, done.stdout);
    const runId = (await bed.pool.query<{ run_id: string }>(`SELECT run_id FROM cleanup_runs WHERE trigger = 'manual' ORDER BY created_at DESC LIMIT 1`)).rows[0]!.run_id;
    return { runId, output: done.stdout };
  };
  const presenceConsumers = async (instanceId: string): Promise<number | null> => {
    const probe = await connection.createChannel();
    probe.on('error', () => undefined); // a missing queue closes the probe channel
    try {
      return (await probe.checkQueue(names.presenceQueue('seat-holds', instanceId))).consumerCount;
    } catch {
      return null;
    } finally {
      await probe.close().catch(() => undefined); // closed by the broker already
    }
  };

  test("a SIGKILLed version-2 worker's fresh heartbeat does not hide an unannounced consumer", async () => {
    const killed: ReaperProcess = startReaper('killed v2 worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'killed-v2-worker' }));
    let consumerTag: string | undefined;
    try {
      await killed.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 60_000);
      const instanceId = (await bed.pool.query<{ id: string }>(`SELECT instance_id::text AS id FROM service_heartbeats WHERE worker_id = 'killed-v2-worker'`)).rows[0]!.id;
      assert.equal(await presenceConsumers(instanceId), 1, 'a live worker proves its consumer on the broker');
      killed.signal('SIGKILL');
      await killed.exitWithin(10_000, 'to die');
      await eventually('the broker to drop the killed worker and its proof', async () => (await presenceConsumers(instanceId)) === null, { timeoutMs: 15_000 });

      // An older worker connects: it announces nothing (a bare AMQP consumer).
      const received: Array<{ version: number; runId: string }> = [];
      ({ consumerTag } = await channel.consume(names.workQueue('seat-holds'), (message: ConsumeMessage | null) => {
        if (!message) return;
        received.push(JSON.parse(message.content.toString('utf8')) as { version: number; runId: string });
        channel.ack(message);
      }));
      // Inside the 15 s a killed worker's row stays fresh: held open here so the run surely falls in it.
      await bed.pool.query(`UPDATE service_heartbeats SET seen_at = clock_timestamp() WHERE worker_id = 'killed-v2-worker'`);
      await seedHolds(bed.pool, { expiredHeld: 25 });
      const { runId, output } = await executeRun();
      await eventually('the batches of the run', () => received.filter((b) => b.runId === runId).length === 3);
      assert.deepEqual([...new Set(received.filter((b) => b.runId === runId).map((b) => b.version))], [1], 'held at version 1: a consumer is not known to accept 2');
      assert.match(output, /holding batch version at 1/);
      assert.match(output, /1 consumer\(s\) on the work queue but only 0 announce version 2 \(killed-v2-worker announce it but consume nothing now/);
    } finally {
      if (consumerTag) await channel.cancel(consumerTag);
      await stopLeftovers([killed]);
    }
  });

  test('a live version-2 worker proves itself: version 2 is published, and a stale row does not hold it back', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    const worker: ReaperProcess = startReaper('v2 worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'live-v2-worker' }));
    let passed = false;
    try {
      await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 60_000);
      // The killed worker's row is still there, fresh: announcing, but proving nothing.
      await bed.pool.query(`UPDATE service_heartbeats SET seen_at = clock_timestamp() WHERE worker_id = 'killed-v2-worker'`);
      const seeded = await seedHolds(bed.pool, { expiredHeld: 25 });
      const { output } = await executeRun();
      assert.match(output, /publishing batch version 2/);
      assert.doesNotMatch(output, /holding batch version/);
      await eventually('the worker to delete the run', async () => (await countReservations(bed.pool, seeded.expiredHeld)) === 0, { timeoutMs: 30_000 });
      // The rows go at the commit; the worker logs the settle after its ack, a moment later.
      await worker.waitForLine('the version-2 worker took the batches (batch settled)', (line) => line.msg === 'batch settled', 10_000);
      const instanceId = (await bed.pool.query<{ id: string }>(`SELECT instance_id::text AS id FROM service_heartbeats WHERE worker_id = 'live-v2-worker'`)).rows[0]!.id;
      await stopAllCleanly([worker]);
      assert.equal(await presenceConsumers(instanceId), null, 'a clean stop withdraws the proof');
      passed = true;
    } finally {
      if (!passed) await stopLeftovers([worker]);
    }
  });
});
