import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from '../support/broker';
import { rowDeletePolicyYaml, runReceipts, runRow, startServices, stopAllCleanly } from '../support/fixtures';
import { trigger } from '../support/fault-run';
import { assertNoLeakedProcesses, type ReaperProcess } from '../support/processes';
import { RabbitCluster } from '../support/rabbit-cluster';
import { assertCheckerZero, formatChecker, measureRecovery, runChecker } from '../support/run-checks';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * reaper on a three-node RabbitMQ cluster (issue 10), started by the suite on this machine. The
 * work queue is a quorum queue with three replicas (REAPER_QUORUM_GROUP_SIZE=3). A scheduler and
 * three workers each get AMQP_URL as the list of the three nodes, each list starting at another
 * node, so the workers are spread over the nodes. Mid-run the node leading the work queue leaves
 * (`rabbitmqctl stop_app`): its clients fail over to the next URL, the queue elects a leader among
 * the two others and keeps every message. Later the node comes back. The run completes and the
 * checker reads zero.
 *
 * Booting the cluster takes a minute or more, so this runs as `npm run test:cluster`, not in `npm
 * test`; `.ci/run` runs it.
 */
describe('three-node RabbitMQ cluster: the work queue leader lost mid-run', () => {
  let cluster: RabbitCluster | undefined;
  let bed: TestBed;
  let broker: TestBroker | undefined;

  before(async () => {
    cluster = await RabbitCluster.start((line) => process.stderr.write(`# ${line}\n`));
    bed = await makeTestBed('cluster');
  });
  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close().catch(() => undefined);
      await bed?.close().catch(() => undefined);
      await cluster?.stop();
    }
  });

  test('scheduler and three workers on different nodes; the leader node stops and returns; the run completes, checker at zero', async () => {
    const nodes = cluster!.nodes;
    const urls = nodes.map((n) => n.amqpUrl);
    const rotated = (start: number) => [...urls.slice(start), ...urls.slice(0, start)].join(',');
    const policy = 'seat-holds';
    const names = brokerNames(bed.prefix);
    const queue = names.workQueue(policy);
    bed.writePolicies(rowDeletePolicyYaml({ name: policy, batchSize: 50 }));
    const seeded = await seedHolds(bed.pool, { expiredHeld: 100_000, futureHeld: 300, expiredConfirmed: 300 });
    const common = { REAPER_QUORUM_GROUP_SIZE: '3', REAPER_AMQP_HEARTBEAT_S: '5', REAPER_PREFETCH: '2' };
    const group = startServices(
      bed,
      [
        { label: 'scheduler', kind: 'scheduler', env: { ...common, AMQP_URL: rotated(0) } },
        { label: 'worker-1', kind: 'worker', env: { ...common, AMQP_URL: rotated(0) } },
        { label: 'worker-2', kind: 'worker', env: { ...common, AMQP_URL: rotated(1) } },
        { label: 'worker-3', kind: 'worker', env: { ...common, AMQP_URL: rotated(2) } },
      ],
      'no service may die when a broker node leaves',
    );
    const [scheduler, ...workers] = group.services as [ReaperProcess, ...ReaperProcess[]];
    let passed = false;
    let stopped: string | undefined;
    try {
      await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 60_000);
      await Promise.all(workers.map((w) => w.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 60_000)));
      assert.deepEqual(
        workers.map((w) => new URL(String(w.lines.find((line) => line.msg === 'amqp connected')?.url)).port),
        nodes.map((node) => String(node.amqpPort)),
        'each worker connected to its own node',
      );
      const members = await cluster!.membersOf(queue);
      assert.equal(members.length, 3, `the work queue has three replicas: ${members.join(', ')}`);

      const runId = await trigger(bed, policy, { AMQP_URL: rotated(0) });
      await group.eventuallyAlive('some batches committed', async () => (await runReceipts(bed.pool, runId)).batches >= 10, { timeoutMs: 30_000, intervalMs: 20 });
      const leader = await cluster!.leaderOf(queue);
      stopped = leader;
      const before = (await runReceipts(bed.pool, runId)).batches;
      await cluster!.stopApp(leader);
      const stoppedAt = Date.now();
      process.stderr.write(`# stopped the leader ${leader} after ${before} batches\n`);
      // The others go on without it: a new leader, batches keep committing.
      const recovery = await measureRecovery(bed.pool, 'leader node stopped', stoppedAt, 60_000);
      assert.notEqual(recovery.ms, null, 'batches commit again after the leader node left');
      const survivor = nodes.find((n) => n.name !== leader)!;
      const newLeader = await cluster!.leaderOf(queue, survivor.name);
      assert.notEqual(newLeader, leader, 'another node leads the work queue');
      await group.eventuallyAlive('more batches after the failover', async () => (await runReceipts(bed.pool, runId)).batches >= before + 20, { timeoutMs: 60_000, intervalMs: 100 });
      await cluster!.startApp(leader);
      stopped = undefined;
      await group.eventuallyAlive('the run to complete', async () => (await runRow(bed.pool, runId)).state === 'completed', {
        timeoutMs: 120_000,
        intervalMs: 250,
        describe: async () => ({ run: await runRow(bed.pool, runId), receipts: await runReceipts(bed.pool, runId) }),
      });
      const settleId = await trigger(bed, policy, { AMQP_URL: rotated(0) });
      await group.eventuallyAlive('the settling run', async () => (await runRow(bed.pool, settleId)).state === 'completed', { timeoutMs: 60_000, intervalMs: 250 });
      const settle = await runRow(bed.pool, settleId);
      await stopAllCleanly(group.services, { allowErrors: /amqp|connection|node/i });
      broker = await openTestBroker(survivor.amqpUrl);
      const report = await runChecker({
        pool: bed.pool,
        broker,
        workQueues: [queue],
        deadLetterQueue: names.deadLetterQueue,
        rows: { policy, created: 100_600, protected: new Map([...seeded.futureHeld, ...seeded.expiredConfirmed].map((id) => [id, 'unexpired or confirmed'])), cutoff: settle.cutoff },
        recoveries: [recovery],
      });
      process.stderr.write(`${formatChecker(report)}\n`.replace(/^/gm, '# '));
      assertCheckerZero(report);
      passed = true;
    } finally {
      if (stopped) await cluster!.startApp(stopped).catch(() => undefined);
      if (!passed) await group.stopLeftovers();
    }
  });
});
