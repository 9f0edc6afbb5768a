import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import type { BrokerNames } from '../../shared/amqp/topology';
import { encodeBatch, makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import type { TestBroker } from './broker';
import { eventually } from './eventually';
import { startReaper, stopLeftovers, type ReaperProcess } from './processes';
import { databaseNowIso, itemsFor } from './seed';
import type { TestBed } from './testbed';

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
  /** The blast-radius brake's `limits` (written as given). */
  limits?: { maxPerRun?: number; maxFractionPerRun?: number; approvalTolerance?: number };
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
  if (options.limits) lines.push(`    limits: { ${Object.entries(options.limits).map(([limit, value]) => `${limit}: ${value}`).join(', ')} }`);
  return `${lines.join('\n')}\n`;
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
  return {
    services,
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
