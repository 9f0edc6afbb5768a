import assert from 'node:assert/strict';
import { after, afterEach, before } from 'node:test';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import pino, { type Logger } from 'pino';
import type { Registry } from 'prom-client';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { brokerNames, type BrokerNames } from '../../shared/amqp/topology';
import { loadPolicies } from '../../shared/config/policies';
import { encodeBatch, makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import { outboxInsertPartitionRetired } from '../../shared/db/queries/outbox';
import { openTestBroker, type TestBroker } from './broker';
import { eventually } from './eventually';
import { assertNoLeakedProcesses, runReaperCli, startReaper, stopLeftovers, type ReaperProcess } from './processes';
import { databaseNowIso, itemsFor } from './seed';
import { findServers } from './servers';
import { makeTestBed, type TestBed, type TestBedOptions } from './testbed';

/**
 * Fixtures the row-delete and broker tests share, instead of a copy per file: the seat-holds
 * policy, hand-made batches and their receipts, services started as a group that fails fast when
 * one of them dies, and the "stop all, exit 0, no errors logged" ending.
 */

export interface RowDeletePolicyOptions {
  name?: string;
  table?: string;
  key?: string;
  expiresAt?: string;
  /** `null` for a policy without a guard. */
  guard?: Record<string, string> | null;
  batchSize?: number;
  /** Default: a schedule that never fires while a test runs (runs are triggered). */
  schedule?: string;
  /** Turn the audit trail on (retainDays 30). */
  audit?: boolean;
  /** Turn the archive on, kept this many days. */
  archiveRetainDays?: number;
  /** The blast-radius brake's `limits` (written as given). */
  limits?: { maxPerRun?: number; maxFractionPerRun?: number; approvalTolerance?: number };
  /** Turn expiry events on (`true`), or with this outbox limit. */
  events?: true | { maxOutbox: number };
}

/** A row-delete policies file (one policy; seat_reservations' held rows unless told otherwise). */
export function rowDeletePolicyYaml(options: RowDeletePolicyOptions = {}): string {
  const guard = options.guard === undefined ? { status: 'held' } : options.guard;
  const lines = [
    'policies:',
    `  - name: ${options.name ?? 'seat-holds'}`,
    '    kind: row-delete',
    `    schedule: "${options.schedule ?? '0 0 1 1 *'}"`,
    `    table: ${options.table ?? 'seat_reservations'}`,
    `    key: ${options.key ?? 'reservation_id'}`,
    `    expiresAt: ${options.expiresAt ?? 'expires_at'}`,
  ];
  if (guard) lines.push(`    guard: { ${Object.entries(guard).map(([column, value]) => `${column}: ${value}`).join(', ')} }`);
  if (options.batchSize !== undefined) lines.push(`    batchSize: ${options.batchSize}`);
  if (options.audit) lines.push('    audit: { enabled: true, retainDays: 30 }');
  if (options.archiveRetainDays !== undefined) lines.push(`    archive: { enabled: true, retainDays: ${options.archiveRetainDays} }`);
  if (options.events) lines.push(`    events: { enabled: true${options.events === true ? '' : `, maxOutbox: ${options.events.maxOutbox}`} }`);
  if (options.limits) lines.push(`    limits: { ${Object.entries(options.limits).map(([limit, value]) => `${limit}: ${value}`).join(', ')} }`);
  return `${lines.join('\n')}\n`;
}

/** One policies file from several one-policy files (rowDeletePolicyYaml, mediaPolicyYaml, ...). */
export function combinedPoliciesYaml(...files: readonly string[]): string {
  return `policies:\n${files.map((file) => file.replace(/^policies:\n/, '')).join('')}`;
}

/** The database clock moved by `interval` (e.g. '-30 minutes'), in the batch format (six fractional digits). */
export async function databaseIsoIn(pool: pg.Pool, interval: string): Promise<string> {
  return (await pool.query<{ at: string }>('SELECT reaper_iso(clock_timestamp() + $1::interval) AS at', [interval])).rows[0]!.at;
}

/** A batch as a scan would publish it for these rows: exact expiries, cutoff = database clock now. */
export async function makeRowBatch(pool: pg.Pool, ids: readonly string[], overrides: Partial<BatchV1> = {}): Promise<BatchV1> {
  const runId = overrides.runId ?? randomUUID();
  return {
    version: 1,
    runId,
    batchId: makeBatchId(runId, 1),
    policy: 'seat-holds',
    cutoff: await databaseNowIso(pool),
    items: await itemsFor(pool, ids),
    ...overrides,
  };
}

/** Publishes a batch the way the scheduler does (message id = batch id, x-run-id header), confirmed. */
export function publishBatch(broker: TestBroker, names: BrokerNames, batch: BatchV1): Promise<void> {
  return broker.publish(names.workExchange, batch.policy, encodeBatch(batch), { messageId: batch.batchId, headers: { 'x-run-id': batch.runId } });
}

export interface Receipt {
  deleted: number;
  noop: number;
  worker_id: string;
}

/** Receipts (cleanup_batches rows) of one batch: none before it committed, exactly one after. */
export async function receiptsOf(pool: pg.Pool, batchId: string): Promise<Receipt[]> {
  return (await pool.query<Receipt>('SELECT deleted, noop, worker_id FROM cleanup_batches WHERE batch_id = $1', [batchId])).rows;
}

/** Receipt totals of a run. */
export async function runReceipts(pool: pg.Pool, runId: string): Promise<{ batches: number; deleted: number; noop: number }> {
  return (
    await pool.query<{ batches: number; deleted: number; noop: number }>(
      'SELECT count(*)::int AS batches, coalesce(sum(deleted), 0)::int AS deleted, coalesce(sum(noop), 0)::int AS noop FROM cleanup_batches WHERE run_id = $1',
      [runId],
    )
  ).rows[0]!;
}

export interface RunRow {
  state: string;
  candidates: number;
  batches_confirmed: number;
  claim_count: number;
  cutoff: string;
  error: string | null;
}

export async function runRow(pool: pg.Pool, runId: string): Promise<RunRow> {
  const result = await pool.query<RunRow>(
    `SELECT state, candidates::int AS candidates, batches_confirmed, claim_count, reaper_iso(cutoff) AS cutoff, error
     FROM cleanup_runs WHERE run_id = $1`,
    [runId],
  );
  assert.equal(result.rowCount, 1, `run ${runId} exists`);
  return result.rows[0]!;
}

/** Log lines at error level or above, for "nothing went wrong" checks. */
export function errorsLogged(processes: readonly ReaperProcess[]): string[] {
  return processes.flatMap((p) => p.lines.filter((line) => Number(line.level) >= 50).map((line) => `${p.label}: ${String(line.msg)} ${JSON.stringify(line)}`));
}

/** The ending of a test whose services all did their job: SIGTERM each, each drains and exits 0, no error logged. */
export async function stopAllCleanly(processes: readonly ReaperProcess[], options: { allowErrors?: RegExp } = {}): Promise<void> {
  const exits = await Promise.all(processes.map((p) => p.stop()));
  assert.deepEqual(
    exits.map((exit, index) => ({ service: processes[index]!.label, ...exit })),
    processes.map((p) => ({ service: p.label, code: 0, signal: null })),
    'every service drains and exits 0',
  );
  const allow = options.allowErrors;
  assert.deepEqual(
    errorsLogged(processes).filter((line) => !allow || !allow.test(line)),
    [],
    'no service logged an error',
  );
}

export interface ServiceSpec {
  label: string;
  kind: 'scheduler' | 'worker';
  env?: Record<string, string>;
}

/**
 * Services of one test started as a group, with the died-map and liveness helpers the fault tests
 * need: `assertAlive()` fails at once, with the last output, if one of them exited, and
 * `eventuallyAlive()` is eventually() that ends as soon as a service died (reported as such
 * instead of a timeout later). `stopLeftovers()` is for `finally`: it records as leaked and stops
 * whatever a failed test left running.
 */
export interface ServiceGroup {
  services: ReaperProcess[];
  /** Resolves once every scheduler logged 'scheduler started' and every worker 'worker consuming'. */
  ready(timeoutMs?: number): Promise<void>;
  assertAlive(): void;
  eventuallyAlive<T>(what: string, probe: () => Promise<T | undefined | false> | T | undefined | false, options?: Parameters<typeof eventually>[2]): Promise<T>;
  stopLeftovers(): Promise<void>;
}

export function startServices(bed: TestBed, specs: readonly ServiceSpec[], why = 'no service may die during this test'): ServiceGroup {
  const services = specs.map((spec) => startReaper(spec.label, [spec.kind], bed.processEnv({ REAPER_WORKER_ID: spec.label, ...spec.env })));
  const died = new Map<string, unknown>();
  for (const service of services) void service.exited.then((exit) => died.set(service.label, exit));
  const assertAlive = () =>
    assert.deepEqual(
      services.filter((s) => died.has(s.label)).map((s) => ({ service: s.label, exit: died.get(s.label), lastOutput: s.output.slice(-20) })),
      [],
      why,
    );
  const readyLine = { scheduler: 'scheduler started', worker: 'worker consuming' } as const;
  return {
    services,
    async ready(timeoutMs?: number) {
      await Promise.all(
        services.map((service, index) => {
          const line = readyLine[specs[index]!.kind];
          return service.waitForLine(line, (logged) => logged.msg === line, timeoutMs);
        }),
      );
    },
    assertAlive,
    async eventuallyAlive<T>(what: string, probe: () => Promise<T | undefined | false> | T | undefined | false, options: Parameters<typeof eventually>[2] = {}) {
      const dead = Symbol('died');
      const result = await eventually<T | typeof dead>(what, async () => (died.size > 0 ? dead : probe()), options).catch((error: Error) => {
        assertAlive(); // the better explanation, when it applies
        throw error;
      });
      assertAlive();
      return result as T;
    },
    stopLeftovers: () => stopLeftovers(services),
  };
}

/**
 * The ready-message count of a queue once no consumer holds any of its messages. A quorum queue
 * returns the unacked messages of a closed consumer a moment after the consumer's process ended;
 * it removes a consumer only together with (or after) settling or returning what it held, so once
 * the consumer count is 0 the message count is final. An "empty" check right after a stop, without
 * this wait, passes even when messages are about to come back.
 */
export async function readyAtRest(broker: TestBroker, queue: string, timeoutMs = 15_000): Promise<number> {
  await eventually(`${queue} to have no consumer`, async () => (await broker.consumerCount(queue)) === 0, { timeoutMs, intervalMs: 50 });
  return broker.messageCount(queue);
}

/** A sample of an in-process service's metric (a histogram's _count/_sum/_bucket included), undefined when absent. */
export async function metricValue(registry: Registry, name: string, labels: Record<string, string>): Promise<number | undefined> {
  // A histogram's samples (_count, _sum, _bucket) belong to the metric named without the suffix.
  const family = name.replace(/_(count|sum|bucket)$/, '');
  const metric = registry.getSingleMetric(name) ?? registry.getSingleMetric(family);
  assert.ok(metric, `metric ${name} is registered`);
  const { values } = await metric.get();
  return values.find(
    (value) => ((value as { metricName?: string }).metricName ?? name) === name && Object.entries(labels).every(([key, label]) => value.labels[key] === label),
  )?.value;
}

/** The database clock now, in epoch milliseconds (the clock runs, leases and gauges are read from). */
export async function databaseNowMs(pool: pg.Pool): Promise<number> {
  return (await pool.query<{ ms: number }>('SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8 AS ms')).rows[0]!.ms;
}

/**
 * An age gauge (seconds since a known instant `sinceMs`, computed by a periodic pass from the
 * database clock) checked with no wall-clock tolerance: waits for a value computed after this call
 * began, and asserts that the instant it implies (sinceMs + age) lies between this call's start and
 * the moment the value was read, both on the database clock. A gauge measuring from the wrong
 * instant fails; a slow machine only makes the wait longer, never the check looser.
 */
export async function readAgeGaugeExactly(
  pool: pg.Pool,
  what: string,
  sinceMs: number,
  read: () => Promise<number | undefined>,
  timeoutMs = 30_000,
): Promise<number> {
  const fromMs = await databaseNowMs(pool);
  let last: number | undefined;
  const age = await eventually(
    `${what}: a value computed after ${new Date(fromMs).toISOString()}`,
    async () => {
      last = await read();
      return last !== undefined && sinceMs + last * 1000 >= fromMs - 1 ? last : undefined;
    },
    { timeoutMs, describe: () => ({ lastAgeSeconds: last, impliedMs: last === undefined ? null : sinceMs + last * 1000, fromMs }) },
  );
  const toMs = await databaseNowMs(pool);
  // 1 ms: rounding of the float seconds; the bracket itself is exact.
  assert.ok(sinceMs + age * 1000 <= toMs + 1, `${what}: ${age} s implies ${sinceMs + age * 1000}, after it was read (${toMs})`);
  return age;
}

export interface BedAndBroker {
  bed: TestBed;
  broker: TestBroker;
  names: BrokerNames;
}

/** The usual before() of a file that talks to the broker: its bed (with this policies file, when given) and a test client on its broker. */
export async function openBedAndBroker(label: string, policiesYaml?: string, options: TestBedOptions = {}): Promise<BedAndBroker> {
  const bed = await makeTestBed(label, options);
  if (policiesYaml !== undefined) bed.writePolicies(policiesYaml);
  return { bed, broker: await openTestBroker(bed.amqpUrl), names: brokerNames(bed.prefix) };
}

/**
 * The matching after(): `first` (e.g. releasing held locks), then a failure when a test leaked a
 * reaper process; the broker client and the bed are closed whatever failed before.
 */
export async function closeBedAndBroker(
  world: Partial<BedAndBroker>,
  first?: () => Promise<void>,
  /** The file's own resources (proxies, admin connections), closed before the broker client and the bed. */
  alsoClose: ReadonlyArray<() => Promise<unknown>> = [],
): Promise<void> {
  try {
    await first?.();
    await assertNoLeakedProcesses();
  } finally {
    for (const close of alsoClose) await close();
    await world.broker?.close();
    await world.bed?.close();
  }
}

/**
 * openBedAndBroker/closeBedAndBroker as the before()/after() of the calling describe(): the world
 * returned is filled in before its first test runs (read it inside tests and hooks, not at
 * describe time). `first` and `alsoClose` are closeBedAndBroker's.
 */
export function bedAndBrokerSuite(
  label: string,
  options: { policiesYaml?: string; first?: () => Promise<void>; alsoClose?: ReadonlyArray<() => Promise<unknown>> } = {},
): BedAndBroker {
  const world: Partial<BedAndBroker> = {};
  before(async () => {
    Object.assign(world, await openBedAndBroker(label, options.policiesYaml));
  });
  after(() => closeBedAndBroker(world, options.first, options.alsoClose));
  return world as BedAndBroker;
}

/** `reaper trigger <policy> --json`, which must succeed: the new run's id. */
export async function triggerRunId(bed: TestBed, policy: string): Promise<string> {
  const triggered = await runReaperCli(['trigger', policy, '--json'], bed.processEnv());
  assert.equal(triggered.code, 0, triggered.stdout);
  return (JSON.parse(triggered.stdout.slice(triggered.stdout.indexOf('{'))) as { runId: string }).runId;
}

/**
 * A startReaper whose processes are stopped after each test of the suite it is made in (it
 * registers the afterEach): a test that fails mid-way cannot leave a scheduler running that would
 * claim the next test's runs.
 */
export function startReaperStoppedAfterEach(): typeof startReaper {
  let running: ReaperProcess[] = [];
  afterEach(async () => {
    await Promise.all(running.map((p) => p.stop(2_000)));
    running = [];
  });
  return (...args) => {
    const started = startReaper(...args);
    running.push(started);
    return started;
  };
}

/** The crew of most row-delete fault tests: one scheduler and its workers, started as a group. */
export interface RunCrew {
  group: ServiceGroup;
  scheduler: ReaperProcess;
  workers: ReaperProcess[];
  services: ReaperProcess[];
}

export function startSchedulerAndWorkers(
  bed: TestBed,
  crew: { scheduler: string; workers: readonly string[]; workerEnv?: Record<string, string>; schedulerEnv?: Readonly<Record<string, string>> },
  why?: string,
): RunCrew {
  const group = startServices(
    bed,
    [{ label: crew.scheduler, kind: 'scheduler', env: crew.schedulerEnv ? { ...crew.schedulerEnv } : undefined }, ...crew.workers.map((label) => ({ label, kind: 'worker' as const, env: crew.workerEnv }))],
    why,
  );
  const [scheduler, ...workers] = group.services as [ReaperProcess, ...ReaperProcess[]];
  return { group, scheduler, workers, services: group.services };
}

/** Waits (failing at once if a service died) for a run to complete; a timeout shows the run row and its receipts. */
export async function runCompleted(group: ServiceGroup, pool: pg.Pool, runId: string, timeoutMs: number): Promise<void> {
  await group.eventuallyAlive('the run to complete', async () => (await runRow(pool, runId)).state === 'completed', {
    timeoutMs,
    intervalMs: 250,
    describe: async () => ({ run: await runRow(pool, runId), receipts: await runReceipts(pool, runId) }),
  });
}

/** A counter of an in-process service summed over every sample whose labels include `labels` (0 when none). */
export async function counterTotal(registry: Registry, name: string, labels: Record<string, string>): Promise<number> {
  const metric = registry.getSingleMetric(name);
  assert.ok(metric, `metric ${name} is registered`);
  const { values } = await metric.get();
  return values.filter((value) => Object.entries(labels).every(([key, label]) => value.labels[key] === label)).reduce((sum, value) => sum + value.value, 0);
}

/** The batch's receipt as deleted/noop counts; undefined until the batch committed. */
export async function batchReceipt(pool: pg.Pool, batchId: string): Promise<{ deleted: number; noop: number } | undefined> {
  return (await pool.query<{ deleted: number; noop: number }>('SELECT deleted, noop FROM cleanup_batches WHERE batch_id = $1', [batchId])).rows[0];
}

/** Logs of in-process services: silent unless TEST_LOG_LEVEL asks. */
export const testLog: Logger = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

/** A worker running in the test's own process on the bed's current policies file (its metrics readable directly), logged in as the worker's role. */
export function startInProcessWorker(bed: TestBed, envOverrides: Record<string, string> = {}, log: Logger = testLog): Promise<WorkerHandle> {
  const env = bed.as(bed.env(envOverrides), 'worker'); // as deployed: the worker's printed role
  return startWorker(env, loadPolicies(env.policiesPath), log);
}

/** A file whose batches an in-process worker takes: the bed, a broker client and the worker. */
export interface WorkerWorld extends BedAndBroker {
  worker: WorkerHandle;
}

export async function openWorkerWorld(label: string, options: { policiesYaml?: string; env?: Record<string, string> } = {}): Promise<WorkerWorld> {
  const world = await openBedAndBroker(label, options.policiesYaml);
  try {
    return { ...world, worker: await startInProcessWorker(world.bed, options.env) };
  } catch (error) {
    await closeBedAndBroker(world); // after() never sees this world: nothing else would drop it
    throw error;
  }
}

/** The matching after(): the worker stops first, then closeBedAndBroker. */
export async function closeWorkerWorld(world: Partial<WorkerWorld>): Promise<void> {
  await closeBedAndBroker(world, async () => {
    await world.worker?.stop();
  });
}

/**
 * While `during` runs, the database of `databaseUrl` refuses new connections and every session it
 * had is terminated (a database outage the services' pools see); it accepts them again afterwards,
 * whatever `during` did. A pool of the test's own on that database needs an 'error' listener.
 */
export async function whileDatabaseRefuses<T>(databaseUrl: string, during: () => Promise<T>): Promise<T> {
  const database = new URL(databaseUrl).pathname.slice(1);
  const admin = new pg.Client({ connectionString: (await findServers()).databaseUrl });
  await admin.connect();
  try {
    await admin.query(`ALTER DATABASE ${pg.escapeIdentifier(database)} WITH ALLOW_CONNECTIONS false`);
    await admin.query('SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()', [database]);
    return await during();
  } finally {
    await admin.query(`ALTER DATABASE ${pg.escapeIdentifier(database)} WITH ALLOW_CONNECTIONS true`);
    await admin.end();
  }
}

/** A `<policy>.partition-retired` event of seat-holds in the outbox, as retiring the partition writes it (run-less). */
export function insertPartitionRetiredEvent(pool: pg.Pool, partition: string, rowCount: number): Promise<void> {
  return outboxInsertPartitionRetired(pool, {
    policy: 'seat-holds',
    partition,
    upperBound: '2026-01-02T00:00:00Z',
    runId: null,
    policyVersion: 'v',
    rowCount,
    bound: "FOR VALUES FROM ('2026-01-01 00:00:00+00') TO ('2026-01-02 00:00:00+00')",
    keyChecksum: 'abc',
  });
}
