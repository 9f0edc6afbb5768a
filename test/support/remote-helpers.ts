import assert from 'node:assert/strict';
import { after, before } from 'node:test';
import type pg from 'pg';
import { startMediaApi, type MediaApi, type MediaApiCall, type MediaApiOptions } from '../../tools/media-api/server';
import { eventually } from './eventually';
import { assertNoLeakedProcesses, startReaper, stopLeftovers, type ReaperProcess } from './processes';
import { makeTestBed, type TestBed } from './testbed';

/**
 * Shared pieces of the remote-delete tests (test/integration/remote-*.test.ts and
 * test/faults/remote-*.test.ts): a media-assets policy pointed at a stand-in API, seeded assets
 * whose expiries carry microseconds, ledger reads, and real scheduler/worker processes.
 */

export const MEDIA_POLICY = 'media-assets';

export interface MediaPolicyOptions {
  baseUrl: string;
  ratePerSecond: number;
  burst: number;
  concurrency: number;
  timeoutMs?: number;
  leaseMs?: number;
  maxAttempts?: number;
  batchSize?: number;
  /** Turn expiry events on with this outbox limit. */
  events?: { maxOutbox: number };
}

/** The media-assets policy's first lines (the table side), without a newline at the end; the remote side follows. */
export function mediaPolicyHead(batchSize: number): string {
  return `policies:
  - name: ${MEDIA_POLICY}
    kind: remote-delete
    schedule: "0 0 1 1 *"
    table: media_assets
    key: asset_id
    expiresAt: retention_expires_at
    guard: { status: active }
    markConfirmed: { status: deleted }
    batchSize: ${batchSize}`;
}

/** The demo's media-assets policy with the given limits; the schedule never fires (runs are triggered). */
export function mediaPolicyYaml(options: MediaPolicyOptions): string {
  return `${mediaPolicyHead(options.batchSize ?? 10)}
    remote:
      baseUrl: ${options.baseUrl}
      path: /assets/{id}
      timeoutMs: ${options.timeoutMs ?? 2000}
    admission: { ratePerSecond: ${options.ratePerSecond}, burst: ${options.burst}, concurrency: ${options.concurrency} }
    retry: { maxAttempts: ${options.maxAttempts ?? 10} }
    leaseMs: ${options.leaseMs ?? 12000}
${options.events ? `    events: { enabled: true, maxOutbox: ${options.events.maxOutbox} }\n` : ''}`;
}

/**
 * Inserts `count` active assets `<prefix>-<n>` that expired about an hour ago, each expiry with a
 * random sub-millisecond part (a key that dropped microseconds would not match), with a URL and
 * metadata (the bulky payload the ledger must clear once confirmed).
 */
export async function seedAssets(pool: pg.Pool, prefix: string, count: number): Promise<string[]> {
  const result = await pool.query<{ asset_id: string }>(
    `INSERT INTO media_assets (asset_id, status, retention_expires_at, url, metadata)
     SELECT $1 || '-' || lpad(i::text, 4, '0'), 'active',
            now() - interval '1 hour' + i * interval '1 millisecond' + random() * interval '1 millisecond',
            'https://media.example/' || $1 || '/' || i || '.mp4', jsonb_build_object('bytes', 1000 + i, 'owner', 'user-' || i)
     FROM generate_series(1, $2) i
     RETURNING asset_id`,
    [prefix, count],
  );
  return result.rows.map((row) => row.asset_id).sort();
}

export interface LedgerRow {
  operation_key: string;
  asset_id: string;
  observed_expiry: string;
  state: string;
  outcome: string | null;
  last_result: string | null;
  attempt_count: number;
  delivery_count: number;
  not_before_ms: number;
  lease_owner: string | null;
  lease_expires_ms: number | null;
  payload: unknown;
  source: string;
  completed_ms: number | null;
}

/** Ledger rows of the media policy (optionally only for these assets), in key order. */
export async function ledgerRows(pool: pg.Pool, assetIds?: readonly string[]): Promise<LedgerRow[]> {
  const result = await pool.query<LedgerRow>(
    `SELECT operation_key, asset_id, reaper_iso(observed_expiry) AS observed_expiry, state, outcome, last_result, attempt_count, delivery_count,
            (extract(epoch FROM not_before) * 1000)::float8 AS not_before_ms, lease_owner,
            (extract(epoch FROM lease_expires_at) * 1000)::float8 AS lease_expires_ms, payload, source,
            (extract(epoch FROM completed_at) * 1000)::float8 AS completed_ms
     FROM cleanup_ledger WHERE policy = $1 AND ($2::text[] IS NULL OR asset_id = ANY($2::text[])) ORDER BY operation_key`,
    [MEDIA_POLICY, assetIds ?? null],
  );
  return result.rows;
}

/** The key a scan makes for an asset now: '<policy>:<id>:<expiry, ISO with microseconds>'. */
export async function currentKeyOf(pool: pg.Pool, assetId: string): Promise<string> {
  const result = await pool.query<{ key: string }>(
    `SELECT $1 || ':' || asset_id || ':' || reaper_iso(retention_expires_at) AS key FROM media_assets WHERE asset_id = $2`,
    [MEDIA_POLICY, assetId],
  );
  assert.equal(result.rowCount, 1, `asset ${assetId} exists`);
  return result.rows[0]!.key;
}

export async function assetStatuses(pool: pg.Pool, assetIds: readonly string[]): Promise<Map<string, string>> {
  const result = await pool.query<{ asset_id: string; status: string }>('SELECT asset_id, status FROM media_assets WHERE asset_id = ANY($1::text[])', [assetIds]);
  return new Map(result.rows.map((row) => [row.asset_id, row.status]));
}

/** Invariant 12: a confirmed operation keeps ids, timestamps, counters and outcome; its payload is gone. */
export function assertRetention(rows: readonly LedgerRow[]): void {
  for (const row of rows.filter((r) => r.outcome === 'confirmed')) {
    assert.equal(row.state, 'done', `${row.operation_key}: confirmed means done`);
    assert.equal(row.payload, null, `${row.operation_key}: payload cleared after confirmation`);
    assert.ok(row.attempt_count >= 1, `${row.operation_key}: attempt_count kept (${row.attempt_count})`);
    assert.ok(row.delivery_count >= 1, `${row.operation_key}: delivery_count kept (${row.delivery_count})`);
    assert.ok(row.completed_ms !== null, `${row.operation_key}: completed_at kept`);
    assert.ok(row.asset_id && row.observed_expiry, `${row.operation_key}: identifiers kept`);
    assert.equal(row.lease_owner, null, `${row.operation_key}: no lease left on a finished operation`);
  }
}

/** Calls of the stand-in grouped by Idempotency-Key, each group in arrival order. */
export function callsByKey(api: MediaApi): Map<string, MediaApiCall[]> {
  const byKey = new Map<string, MediaApiCall[]>();
  for (const call of api.calls) {
    const key = call.key ?? '(none)';
    byKey.set(key, [...(byKey.get(key) ?? []), call]);
  }
  return byKey;
}

const startedHere: ReaperProcess[] = [];

export function startWorkerProcess(bed: TestBed, label: string, extra: Record<string, string> = {}): ReaperProcess {
  const process = startReaper(label, ['worker'], bed.processEnv({ REAPER_WORKER_ID: label, ...extra }));
  startedHere.push(process);
  return process;
}

export function startSchedulerProcess(bed: TestBed, label: string, extra: Record<string, string> = {}): ReaperProcess {
  const process = startReaper(label, ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: label, ...extra }));
  startedHere.push(process);
  return process;
}

export async function started(process: ReaperProcess, kind: 'worker' | 'scheduler'): Promise<void> {
  await process.waitForLine(`${kind} started`, (line) => line.msg === `${kind} started`);
}

/** The services of a remote test: a scheduler and its workers, each started (logged "<kind> started"); `all` for stopAllCleanly. */
export interface RemoteServices {
  scheduler: ReaperProcess;
  workers: ReaperProcess[];
  all: ReaperProcess[];
}

export async function startRemoteServices(
  bed: TestBed,
  services: { scheduler: string; workers: readonly string[]; schedulerEnv?: Record<string, string>; workerEnv?: Record<string, string> },
): Promise<RemoteServices> {
  const scheduler = startSchedulerProcess(bed, services.scheduler, services.schedulerEnv);
  const workers = services.workers.map((label) => startWorkerProcess(bed, label, services.workerEnv));
  await Promise.all([started(scheduler, 'scheduler'), ...workers.map((worker) => started(worker, 'worker'))]);
  return { scheduler, workers, all: [scheduler, ...workers] };
}

/** Log lines at error level or above, for "nothing went wrong" checks. */
export function errorsLogged(processes: readonly ReaperProcess[]): string[] {
  return processes.flatMap((p) => p.lines.filter((line) => Number(line.level) >= 50).map((line) => `${p.label}: ${String(line.msg)} ${JSON.stringify(line)}`));
}

/** Counts of the media policy's ledger by state/outcome, for failure messages and progress checks. */
export async function ledgerSummary(pool: pg.Pool): Promise<Record<string, number>> {
  const result = await pool.query<{ k: string; n: number }>(
    `SELECT state || coalesce('/' || outcome, '') AS k, count(*)::int AS n FROM cleanup_ledger WHERE policy = $1 GROUP BY 1 ORDER BY 1`,
    [MEDIA_POLICY],
  );
  return Object.fromEntries(result.rows.map((row) => [row.k, row.n]));
}

/**
 * For `after()` hooks, before assertNoLeakedProcesses(): stops what a failed test left running of
 * the processes started through this module (a frozen one is continued first), so the test's own
 * failure is the one reported, not "left processes running".
 */
export async function stopStarted(): Promise<void> {
  await stopLeftovers(startedHere.splice(0), 5_000);
}

/**
 * For failure messages: the counts, plus every operation still open with what it last saw and
 * when it is due (ms from now, database clock), so a stuck operation explains itself.
 */
export async function ledgerDiagnosis(pool: pg.Pool): Promise<{ ledger: Record<string, number>; open: unknown[] }> {
  const open = await pool.query(
    `SELECT operation_key, state, last_result, last_error, attempt_count, delivery_count, lease_owner,
            round(extract(epoch FROM not_before - clock_timestamp()) * 1000) AS due_in_ms,
            round(extract(epoch FROM lease_expires_at - clock_timestamp()) * 1000) AS lease_left_ms
     FROM cleanup_ledger WHERE policy = $1 AND state <> 'done' ORDER BY not_before LIMIT 10`,
    [MEDIA_POLICY],
  );
  return { ledger: await ledgerSummary(pool), open: open.rows };
}

/** A remote-delete test file's world: its test bed with a media policy pointed at a fresh stand-in API. */
export interface RemoteWorld {
  bed: TestBed;
  api: MediaApi;
}

export async function openRemoteWorld(
  label: string,
  policy: Omit<MediaPolicyOptions, 'baseUrl'>,
  stand: MediaApiOptions & { slowMs?: number } = {},
): Promise<RemoteWorld> {
  const bed = await makeTestBed(label);
  const api = await startMediaApi(stand);
  if (stand.slowMs !== undefined) api.configure({ slowMs: stand.slowMs });
  bed.writePolicies(mediaPolicyYaml({ baseUrl: api.url, ...policy }));
  return { bed, api };
}

/** For `after()`: stops what this module started, fails on leaked processes, then frees the API and the bed. */
export async function closeRemoteWorld(world: Partial<RemoteWorld> | undefined): Promise<void> {
  try {
    await stopStarted();
    await assertNoLeakedProcesses();
  } finally {
    await world?.api?.close();
    await world?.bed?.close();
  }
}

/** openRemoteWorld/closeRemoteWorld as the before()/after() of the calling describe(); the world is filled in before its first test runs. */
export function remoteWorldSuite(label: string, policy: Omit<MediaPolicyOptions, 'baseUrl'>, stand: MediaApiOptions & { slowMs?: number } = {}): RemoteWorld {
  const world: Partial<RemoteWorld> = {};
  before(async () => {
    Object.assign(world, await openRemoteWorld(label, policy, stand));
  });
  after(() => closeRemoteWorld(world));
  return world as RemoteWorld;
}

/** Waits until `count` operations of the media policy are confirmed; a timeout shows the open ones and how many calls were made. */
export async function allConfirmed(world: RemoteWorld, count: number, timeoutMs: number, what = `all ${count} operations confirmed`): Promise<void> {
  await eventually(what, async () => (await ledgerSummary(world.bed.pool))['done/confirmed'] === count, {
    timeoutMs,
    intervalMs: 250,
    describe: async () => ({ ...(await ledgerDiagnosis(world.bed.pool)), calls: world.api.calls.length }),
  });
}
