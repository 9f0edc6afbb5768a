import assert from 'node:assert/strict';
import { after, afterEach, before } from 'node:test';
import { eventually } from './eventually';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { runReaperCli, stopLeftovers, type ReaperProcess } from './processes';
import {
  callsByKey,
  closeRemoteWorld,
  errorsLogged,
  ledgerDiagnosis,
  ledgerRows,
  MEDIA_POLICY,
  mediaPolicyYaml,
  startSchedulerProcess,
  started,
  startWorkerProcess,
  type LedgerRow,
  type MediaPolicyOptions,
} from './remote-helpers';
import { makeTestBed, type TestBed } from './testbed';

/**
 * The world of the remote-delete failure-transition tests (test/faults/remote-transitions.test.ts
 * and remote-admission.test.ts): a test bed with a media policy pointed at a fresh stand-in API, one
 * scheduler for the file, a worker per test (a fresh circuit breaker) with its /metrics, and the
 * waits those tests share. Call transitionsWorld() inside describe(): it registers the hooks.
 */
const BASE_POLICY: Omit<MediaPolicyOptions, 'baseUrl'> = { ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: 2_000, leaseMs: 12_000, maxAttempts: 3 };

export interface Metrics {
  sum(name: string, labels?: Record<string, string>): number;
}

export interface TransitionsWorld {
  readonly bed: TestBed;
  readonly api: MediaApi;
  /** `env`: the worker's extra environment (e.g. a test timing, shared/config/test-timings.ts). */
  startWorker(label: string, policy?: Partial<MediaPolicyOptions>, env?: Record<string, string>): Promise<{ worker: ReaperProcess; metrics: () => Promise<Metrics> }>;
  trigger(): Promise<void>;
  finished(ids: readonly string[], timeoutMs?: number): Promise<LedgerRow[]>;
  statusesOf(key: string): Array<number | 'reset'>;
  quietFor(ms: number): Promise<unknown>;
  stopCleanly(worker: ReaperProcess): Promise<void>;
}

export function transitionsWorld(label: string): TransitionsWorld {
  let bed: TestBed;
  let api: MediaApi;
  let scheduler: ReaperProcess;
  /** The running test's worker: stopped after each test whatever happened (recorded as a leak if still running). */
  let current: ReaperProcess | undefined;

  before(async () => {
    bed = await makeTestBed(label);
    api = await startMediaApi();
    bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ...BASE_POLICY }));
    scheduler = startSchedulerProcess(bed, 'transitions-scheduler');
    await started(scheduler, 'scheduler');
  });

  afterEach(async () => {
    if (current?.running) await stopLeftovers([current]);
    current = undefined;
  });

  after(async () => {
    const stopped = await scheduler?.stop();
    await closeRemoteWorld({ bed, api });
    assert.equal(stopped?.code, 0, 'the scheduler drains and exits 0');
  });

  /** A worker of this test, with the policy options given (the stand-in's switches are set by the test). */
  async function startWorker(label: string, policy: Partial<MediaPolicyOptions> = {}, env: Record<string, string> = {}): Promise<{ worker: ReaperProcess; metrics: () => Promise<Metrics> }> {
    bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ...BASE_POLICY, ...policy }));
    const worker = startWorkerProcess(bed, label, { HTTP_PORT: '0', ...env });
    current = worker;
    await started(worker, 'worker');
    const port = Number(worker.lines.find((line) => line.msg === 'worker started')!.httpPort);
    return { worker, metrics: () => readMetrics(port) };
  }

  async function readMetrics(port: number): Promise<Metrics> {
    const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
    const samples = text
      .split('\n')
      .filter((line) => line && !line.startsWith('#'))
      .map((line) => {
        const match = /^([a-z_]+)(?:\{(.*)\})? ([0-9.e+-]+|NaN)$/.exec(line);
        const labels = Object.fromEntries([...(match?.[2] ?? '').matchAll(/([a-z_]+)="([^"]*)"/g)].map((m) => [m[1]!, m[2]!]));
        return { name: match?.[1] ?? '', labels, value: Number(match?.[3] ?? 0) };
      });
    return {
      sum: (name, labels = {}) =>
        samples.filter((s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v)).reduce((total, s) => total + s.value, 0),
    };
  }

  const trigger = async (): Promise<void> => assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);

  /** Every operation of these assets finished (state done); their rows. */
  async function finished(ids: readonly string[], timeoutMs = 45_000): Promise<LedgerRow[]> {
    return eventually(
      `${ids.length} operations done`,
      async () => {
        const rows = await ledgerRows(bed.pool, ids);
        return rows.length === ids.length && rows.every((row) => row.state === 'done') ? rows : undefined;
      },
      { timeoutMs, intervalMs: 100, describe: async () => ({ ...(await ledgerDiagnosis(bed.pool)), calls: api.calls.length }) },
    );
  }

  const statusesOf = (key: string) => (callsByKey(api).get(key) ?? []).map((call) => call.status);

  /** Waits `ms` of wall time: only for "nothing happens for a while" checks, never to let something happen. */
  const quietFor = (ms: number) => {
    const from = Date.now();
    return eventually(`${ms} ms to pass`, () => Date.now() - from >= ms, { timeoutMs: ms + 5_000, intervalMs: 50 });
  };

  async function stopCleanly(worker: ReaperProcess): Promise<void> {
    assert.equal((await worker.stop()).code, 0, `${worker.label} drains and exits 0`);
    assert.deepEqual(errorsLogged([worker]), [], 'no error logged');
  }

  return {
    get bed() {
      return bed;
    },
    get api() {
      return api;
    },
    startWorker,
    trigger,
    finished,
    statusesOf,
    quietFor,
    stopCleanly,
  };
}
