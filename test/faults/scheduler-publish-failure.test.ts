import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import type { Channel, ChannelModel } from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli, startReaper, type ReaperProcess } from '../support/processes';
import { seedHolds } from '../support/seed';
import { assertRunDeletedExactlyOnce } from '../support/run-checks';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The scheduler's publishes start failing in the middle of a run, deterministically: the test
 * holds a lock on cleanup_run_batches, so the scheduler's first checkpoint waits while the workers
 * are already deleting that window's batches (they are ahead of every confirmed window). Then the
 * work queue's binding is removed and the lock released: the next window's publishes come back
 * unroutable (mandatory) and are refused. The scheduler must not die; it publishes the same
 * batches again, and once the binding is back the run completes with every expired hold deleted
 * exactly once and counted once.
 *
 * (broker-restart.test.ts hits the same code path by closing connections, which lands mid-window
 * only some of the time; this is the reproducible form of that fault.)
 */
const EXPIRED = 20_000;
const FUTURE = 500;
const CONFIRMED = 500;
const BATCH_SIZE = 50;

describe('scheduler publishes refused mid-window', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  let admin: ChannelModel;
  let adminChannel: Channel;

  before(async () => {
    bed = await makeTestBed('fault_publish_failure');
    bed.writePolicies(`policies:
  - name: seat-holds
    kind: row-delete
    schedule: "0 0 1 1 *"
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
    guard: { status: held }
    batchSize: ${BATCH_SIZE}
`);
    broker = await openTestBroker(bed.amqpUrl);
    names = brokerNames(bed.prefix);
    admin = await amqp.connect(bed.amqpUrl);
    adminChannel = await admin.createChannel();
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await admin?.close().catch(() => undefined); // already closed: nothing to release
      await broker?.close();
      await bed?.close();
    }
  });

  const receiptsOf = async (runId: string) =>
    (
      await bed.pool.query<{ batches: number; deleted: number; noop: number }>(
        'SELECT count(*)::int AS batches, coalesce(sum(deleted), 0)::int AS deleted, coalesce(sum(noop), 0)::int AS noop FROM cleanup_batches WHERE run_id = $1',
        [runId],
      )
    ).rows[0]!;

  const runRow = async (runId: string) =>
    (
      await bed.pool.query<{ state: string; candidates: number; batches_confirmed: number }>(
        'SELECT state, candidates::int AS candidates, batches_confirmed FROM cleanup_runs WHERE run_id = $1',
        [runId],
      )
    ).rows[0]!;

  test('the scheduler retries the refused window instead of dying, and the run deletes every expired hold once', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const services: ReaperProcess[] = [
      startReaper('scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'scheduler-1' })),
      startReaper('worker-1', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'worker-1', REAPER_PREFETCH: '1' })),
      startReaper('worker-2', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'worker-2', REAPER_PREFETCH: '1' })),
    ];
    const [scheduler, ...workers] = services as [ReaperProcess, ReaperProcess, ReaperProcess];
    const died = new Map<string, unknown>();
    for (const service of services) void service.exited.then((exit) => died.set(service.label, exit));
    const assertAlive = () =>
      assert.deepEqual(
        services.filter((s) => died.has(s.label)).map((s) => ({ service: s.label, exit: died.get(s.label), lastOutput: s.output.slice(-20) })),
        [],
        'no service may die because a publish was refused',
      );
    /** eventually(), but a dead service ends the wait at once and is what the failure reports. */
    const eventuallyAlive = async <T>(what: string, probe: () => Promise<T | undefined | false>, options: Parameters<typeof eventually>[2] = {}) => {
      const result = await eventually<T | 'died'>(what, async () => (services.some((s) => died.has(s.label)) ? 'died' : probe()), options).catch((error: Error) => {
        assertAlive();
        throw error;
      });
      assertAlive();
      return result as T;
    };

    let passed = false;
    try {
      await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
      await Promise.all(workers.map((w) => w.waitForLine('worker consuming', (line) => line.msg === 'worker consuming')));
      // Hold the scheduler's first checkpoint: it writes the confirmed batch ids to this table.
      const holder = await bed.pool.connect();
      await holder.query('BEGIN');
      // SHARE mode blocks the checkpoint's INSERT but not the reads of `reaper trigger` or this test.
      await holder.query('LOCK TABLE cleanup_run_batches IN SHARE MODE');
      const triggered = await runReaperCli(['trigger', 'seat-holds', '--json'], bed.processEnv());
      assert.equal(triggered.code, 0, triggered.stdout);
      const runId = (JSON.parse(triggered.stdout) as { runId: string }).runId;

      // Mid-run: the first window is published and confirmed, its checkpoint waits on the lock,
      // and the workers have already committed batches of it.
      await eventuallyAlive(
        'the workers to be ahead of the confirmed windows',
        async () => {
          const row = await runRow(runId);
          return row.state === 'scanning' && (await receiptsOf(runId)).batches > row.batches_confirmed;
        },
        { intervalMs: 20 },
      );
      await adminChannel.unbindQueue(names.workQueue('seat-holds'), names.workExchange, 'seat-holds');
      await holder.query('COMMIT');
      holder.release();
      const refused = await eventuallyAlive(
        'the scheduler to report the refused window',
        async () => scheduler.lines.find((line) => line.msg === 'run publish failed; retrying'),
        { timeoutMs: 15_000 },
      );
      assert.match(String(refused.err), /unroutable/, 'the window failed because its publishes were unroutable');
      await adminChannel.bindQueue(names.workQueue('seat-holds'), names.workExchange, 'seat-holds');

      await eventuallyAlive('the run to complete', async () => (await runRow(runId)).state === 'completed', { timeoutMs: 40_000, intervalMs: 250 });
      await assertRunDeletedExactlyOnce({
        pool: bed.pool,
        broker,
        workQueue: names.workQueue('seat-holds'),
        deadLetterQueue: names.deadLetterQueue,
        runId,
        seeded,
        scheduler,
        workers,
        services,
      });
      passed = true;
    } finally {
      if (!passed) {
        const alive = services.filter((s) => !died.has(s.label));
        for (const service of alive) service.signal('SIGKILL');
        await Promise.all(alive.map((s) => s.exited));
      }
    }
  });
});
