import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli, startReaper, type ReaperProcess } from '../support/processes';
import { seedHolds } from '../support/seed';
import { assertRunDeletedExactlyOnce } from '../support/run-checks';
import { makeTestBed, type TestBed } from '../support/testbed';

const run = promisify(execFile);

/**
 * The broker closes this test's connections in the middle of a run: some batches are committed,
 * some are queued, some are in a worker's hands, and the scheduler may be mid-window with publishes
 * waiting for their confirms. The services reconnect by themselves, the run still completes, every
 * expired hold is deleted exactly once (receipts add up to the seeded count) and no hold that was
 * not eligible is touched.
 *
 * Only this file's connections are closed (matched on the prefix in the connection name): other
 * test files run against the same broker at the same time.
 */
const EXPIRED = 20_000;
const FUTURE = 500;
const CONFIRMED = 500;
const BATCH_SIZE = 50;

interface BrokerConnection {
  /** The connection's Erlang pid as close_connection takes it: <rabbit@host.N.N.N>. */
  pid: string;
  /** client_properties.connection_name, e.g. "reaper-worker <prefix> <id>". */
  name: string;
}

/**
 * This test's connections, as the broker sees them. The table output is read rather than
 * `--formatter json`: the JSON formatter prints pids as #PID<...>, which close_connection refuses.
 * Each line is `<pid>\t[{"connection_name","..."},...]`.
 */
async function connectionsWithPrefix(prefix: string): Promise<BrokerConnection[]> {
  const { stdout } = await run('rabbitmqctl', ['list_connections', 'pid', 'client_properties', '-q', '--no-table-headers']);
  return stdout
    .split('\n')
    .map((line) => ({ pid: line.split('\t')[0]!.trim(), name: /\{"connection_name","([^"]*)"\}/.exec(line)?.[1] ?? '' }))
    .filter((connection) => connection.pid.startsWith('<') && connection.name.split(' ').includes(prefix));
}

async function closeConnection(pid: string): Promise<void> {
  await run('rabbitmqctl', ['close_connection', pid, 'test: broker-restart fault', '-q']);
}

describe('broker closes connections mid-run', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    bed = await makeTestBed('fault_broker_restart');
    broker = await openTestBroker(bed.amqpUrl);
    names = brokerNames(bed.prefix);
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

  const policiesYaml = (name: string, table: string, batchSize = BATCH_SIZE) => `policies:
  - name: ${name}
    kind: row-delete
    schedule: "0 0 1 1 *"
    table: ${table}
    key: reservation_id
    expiresAt: expires_at
    guard: { status: held }
    batchSize: ${batchSize}
`;

  const receiptsOf = async (runId: string) =>
    (
      await bed.pool.query<{ batches: number; deleted: number; noop: number }>(
        'SELECT count(*)::int AS batches, coalesce(sum(deleted), 0)::int AS deleted, coalesce(sum(noop), 0)::int AS noop FROM cleanup_batches WHERE run_id = $1',
        [runId],
      )
    ).rows[0]!;

  const runRow = async (runId: string) =>
    (
      await bed.pool.query<{ state: string; candidates: number; batches_confirmed: number; error: string | null }>(
        'SELECT state, candidates::int AS candidates, batches_confirmed, error FROM cleanup_runs WHERE run_id = $1',
        [runId],
      )
    ).rows[0]!;

  const amqpConnectedCount = (service: ReaperProcess) => service.lines.filter((line) => line.msg === 'amqp connected').length;

  /**
   * Starts the services of one test. Returns a check that fails at once, with the last output, if
   * one of them died (instead of the test timing out later), and a cleanup that SIGKILLs whatever is
   * left when the test failed half-way, so the next test starts clean.
   */
  function startServices(specs: Array<{ label: string; args: string[]; env: Record<string, string> }>) {
    const services = specs.map((spec) => startReaper(spec.label, spec.args, bed.processEnv(spec.env)));
    const died = new Map<string, unknown>();
    for (const service of services) void service.exited.then((exit) => died.set(service.label, exit));
    const assertAlive = () => {
      const dead = services.filter((service) => died.has(service.label));
      assert.deepEqual(
        dead.map((service) => ({ service: service.label, exit: died.get(service.label), lastOutput: service.output.slice(-20) })),
        [],
        'no service may die when the broker closes its connection',
      );
    };
    const killLeftovers = async () => {
      const alive = services.filter((service) => !died.has(service.label));
      for (const service of alive) service.signal('SIGKILL');
      await Promise.all(alive.map((service) => service.exited));
    };
    return { services, assertAlive, killLeftovers };
  }

  /** eventually(), but a service that died ends the wait at once and is reported as such. */
  async function eventuallyAlive<T>(
    assertAlive: () => void,
    what: string,
    probe: () => Promise<T | undefined | false> | T | undefined | false,
    options: Parameters<typeof eventually>[2] = {},
  ): Promise<T> {
    const died = Symbol('died');
    let result: T | typeof died;
    try {
      result = await eventually<T | typeof died>(
        what,
        async () => {
          try {
            assertAlive();
          } catch {
            return died;
          }
          return probe();
        },
        options,
      );
    } catch (error) {
      assertAlive(); // the better explanation, when it applies
      throw error;
    }
    if (result === died) assertAlive();
    return result as T;
  }

  /**
   * Holds the scheduler between two windows: a SHARE lock on cleanup_run_batches makes its next
   * checkpoint (an INSERT there) wait, while reads go on. Released by the returned function.
   */
  async function holdCheckpoints(): Promise<() => Promise<void>> {
    const holder = await bed.pool.connect();
    await holder.query('BEGIN');
    await holder.query('LOCK TABLE cleanup_run_batches IN SHARE MODE');
    return async () => {
      await holder.query('COMMIT');
      holder.release();
    };
  }

  /** True while a scheduler's checkpoint waits on that lock. */
  const schedulerWaitsOnCheckpoint = async (): Promise<boolean> =>
    (
      await bed.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'reaper-scheduler' AND wait_event_type = 'Lock'`,
      )
    ).rows[0]!.n > 0;

  test('every connection closed mid-run: services reconnect, the run completes, each expired hold is deleted once and nothing else', async () => {
    bed.writePolicies(policiesYaml('seat-holds', 'seat_reservations'));
    const seeded = await seedHolds(bed.pool, { expiredHeld: EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const expectedBatches = Math.ceil(EXPIRED / BATCH_SIZE);
    const { services, assertAlive, killLeftovers } = startServices([
      { label: 'scheduler', args: ['scheduler'], env: { REAPER_WORKER_ID: 'scheduler-1' } },
      { label: 'worker-1', args: ['worker'], env: { REAPER_WORKER_ID: 'worker-1', REAPER_PREFETCH: '1' } },
      { label: 'worker-2', args: ['worker'], env: { REAPER_WORKER_ID: 'worker-2', REAPER_PREFETCH: '1' } },
    ]);
    const [scheduler, ...workers] = services as [ReaperProcess, ReaperProcess, ReaperProcess];
    let passed = false;
    try {
      await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
      await Promise.all(workers.map((w) => w.waitForLine('worker consuming', (line) => line.msg === 'worker consuming')));
      assert.deepEqual(services.map(amqpConnectedCount), [1, 1, 1], 'each service connected once');

      // Mid-run, deterministically: the scheduler publishes its first window and then waits to
      // record it; the workers commit some of that window's batches; then every connection closes.
      const release = await holdCheckpoints();
      const triggered = await runReaperCli(['trigger', 'seat-holds', '--json'], bed.processEnv());
      assert.equal(triggered.code, 0, triggered.stdout);
      const runId = (JSON.parse(triggered.stdout) as { runId: string }).runId;
      await eventuallyAlive(assertAlive, 'the scheduler to wait on its first checkpoint', schedulerWaitsOnCheckpoint, { timeoutMs: 20_000, intervalMs: 20 });
      await eventuallyAlive(assertAlive, 'a few batches to be committed', async () => (await receiptsOf(runId)).batches >= 5, { timeoutMs: 20_000, intervalMs: 20 });
      const connections = await connectionsWithPrefix(bed.prefix);
      assert.deepEqual(
        connections.map((c) => c.name).sort(),
        [`reaper-scheduler ${bed.prefix} scheduler-1`, `reaper-worker ${bed.prefix} worker-1`, `reaper-worker ${bed.prefix} worker-2`],
        'one connection per service, named after this test prefix',
      );
      const stateAtClose = (await runRow(runId)).state;
      await Promise.all(connections.map((c) => closeConnection(c.pid)));
      const doneAtClose = (await receiptsOf(runId)).batches;
      await release();
      assert.ok(doneAtClose < expectedBatches, `the connections were closed mid-run (${doneAtClose}/${expectedBatches} batches done)`);

      // Every service notices and comes back by itself.
      for (const service of services) {
        await eventuallyAlive(assertAlive, `${service.label} to notice the closed connection`, () =>
          service.lines.some((line) => line.msg === 'amqp connection closed; reconnecting'),
        );
        await eventuallyAlive(assertAlive, `${service.label} to log 'amqp connected' again`, () => amqpConnectedCount(service) >= 2);
      }
      const reconnected = await connectionsWithPrefix(bed.prefix);
      assert.equal(reconnected.length, 3, 'three live connections again');
      assert.ok(reconnected.every((c) => !connections.some((old) => old.pid === c.pid)), 'new connections, not the closed ones');

      await eventuallyAlive(assertAlive, 'the run to complete', async () => (await runRow(runId)).state === 'completed', {
        timeoutMs: 40_000,
        intervalMs: 250,
        describe: async () => ({ run: await runRow(runId), receipts: await receiptsOf(runId) }),
      });

      // The workers' own accounts: as many deletions logged as seeded, duplicates delete nothing.
      const doneSettles = workers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'done'));
      assert.equal(doneSettles.reduce((sum, line) => sum + Number(line.deleted), 0), EXPIRED, 'the workers logged as many deletions as were seeded');
      const duplicates = workers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'duplicate'));
      assert.ok(duplicates.every((line) => line.deleted === 0), 'duplicates delete nothing');
      // The data: every expired hold deleted, each exactly once, nothing else; services exit 0.
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
        diagnosis: { runStateAtClose: stateAtClose },
      });
      passed = true;
    } finally {
      if (!passed) await killLeftovers();
    }
  });

  /**
   * A flapping connection aimed at the scheduler: its connection (only) is closed again and again
   * while it scans and publishes, and the workers (whose connections stay up) keep deleting what
   * reached the queue. Each close may land while publishes of the current window still wait for
   * their confirms; the scheduler must retry that window from its checkpoint, not die, and the run
   * must still delete every expired hold exactly once.
   */
  test('scheduler connection closed repeatedly while it publishes: it recovers and the run still deletes every expired hold once', async () => {
    const FLAP_EXPIRED = 20_000;
    const CLOSES = 5;
    await bed.pool.query('DELETE FROM seat_reservations'); // whatever the first test left
    bed.writePolicies(policiesYaml('flap-holds', 'seat_reservations', 20));
    const seeded = await seedHolds(bed.pool, { expiredHeld: FLAP_EXPIRED, futureHeld: FUTURE, expiredConfirmed: CONFIRMED });
    const { services, assertAlive, killLeftovers } = startServices([
      { label: 'scheduler-flap', args: ['scheduler'], env: { REAPER_WORKER_ID: 'scheduler-2' } },
      { label: 'worker-3', args: ['worker'], env: { REAPER_WORKER_ID: 'worker-3', REAPER_PREFETCH: '1' } },
      { label: 'worker-4', args: ['worker'], env: { REAPER_WORKER_ID: 'worker-4', REAPER_PREFETCH: '1' } },
    ]);
    const [scheduler, ...workers] = services as [ReaperProcess, ReaperProcess, ReaperProcess];
    let passed = false;
    try {
      await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
      await Promise.all(workers.map((w) => w.waitForLine('worker consuming', (line) => line.msg === 'worker consuming')));

      const triggered = await runReaperCli(['trigger', 'flap-holds', '--json'], bed.processEnv());
      assert.equal(triggered.code, 0, triggered.stdout);
      const runId = (JSON.parse(triggered.stdout) as { runId: string }).runId;

      let closes = 0;
      while (closes < CLOSES) {
        // Between two windows, deterministically: hold the next checkpoint, close the scheduler's
        // connection while it waits there, let it go on once it has reconnected.
        const release = await holdCheckpoints();
        const state = await eventuallyAlive(assertAlive, 'the scheduler to wait on a checkpoint', async () => {
          if (await schedulerWaitsOnCheckpoint()) return 'scanning';
          const row = await runRow(runId);
          return ['published', 'completed', 'failed'].includes(row.state) ? row.state : undefined;
        }, { intervalMs: 20 });
        if (state !== 'scanning') {
          await release();
          break;
        }
        const connections = (await connectionsWithPrefix(bed.prefix)).filter((c) => c.name.split(' ').includes('scheduler-2'));
        assert.equal(connections.length, 1, "the scheduler's one connection");
        await closeConnection(connections[0]!.pid);
        closes += 1;
        await release();
        await eventuallyAlive(assertAlive, `the scheduler to reconnect after close ${closes}`, () => amqpConnectedCount(scheduler) >= closes + 1, { intervalMs: 20 });
      }
      assert.ok(closes >= 2, `the connection was closed at least twice while the run was scanning (${closes})`);

      await eventuallyAlive(assertAlive, 'the run to complete', async () => (await runRow(runId)).state === 'completed', {
        timeoutMs: 40_000,
        intervalMs: 250,
        describe: async () => ({ run: await runRow(runId), receipts: await receiptsOf(runId) }),
      });
      await assertRunDeletedExactlyOnce({
        pool: bed.pool,
        broker,
        workQueue: names.workQueue('flap-holds'),
        deadLetterQueue: names.deadLetterQueue,
        runId,
        seeded,
        scheduler,
        workers,
        services,
        diagnosis: { closes },
      });
      passed = true;
    } finally {
      if (!passed) await killLeftovers();
    }
  });
});
