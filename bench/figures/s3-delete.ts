import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startS3StandIn, type S3StandIn } from '../../tools/s3-stand-in/server';
import { check, checkFinished, reaperEnvironment, type BenchContext } from '../lib/context';
import { seedExpiredAssets, OBSERVER_APPLICATION } from '../lib/database';
import { NEVER, writePolicies } from '../lib/policies';
import { startServices, stopServices, type ReaperService } from '../lib/services';
import { pollUntil } from '../lib/wait';

/**
 * Figure 9 (issue 21): object storage. A backlog of expired assets whose objects live in the S3
 * stand-in (s3rver behind the recording proxy, in this process), deleted by a scheduler and the
 * workers in DeleteObjects requests under the policy's admission (requests/s, keys/s, requests at
 * once, across every worker). The proxy records each request's arrival and keys, so:
 *  - keys/s achieved = keys of every request but the last ÷ first to last arrival, ÷ keysPerSecond;
 *  - most keys in any second (sliding window over arrivals) ÷ keysPerSecond;
 *  - requests per 1,000 keys; keys sent in more than one request (duplicates).
 * The objects are not created first: deleting an absent key is a success in S3, and the figure
 * measures admission and batching, not the stand-in's disk.
 */

export const S3_POLICY = 'bench-objects';

export interface S3Figure {
  keysPerSecond: number;
  requestsPerSecond: number;
  concurrency: number;
  maxKeysPerRequest: number;
  workers: number;
  backlog: number;
  achievedKeysPerSecond: number;
  achievedRatio: number;
  maxKeysInOneSecond: number;
  maxWindowRatio: number;
  requests: number;
  requestsPer1000Keys: number;
  duplicates: number;
  throttled: number;
  /** Each forwarded request: ms after the first one arrived, and its keys (where the pace was lost or bunched). */
  arrivals: Array<[number, number]>;
  seconds: number;
  bounded: boolean;
}

export async function runS3Delete(
  context: BenchContext,
  options: { keysPerSecond: number; requestsPerSecond: number; concurrency: number; maxKeysPerRequest: number; backlogSeconds: number; workers: number },
): Promise<S3Figure> {
  const backlog = Math.round(options.keysPerSecond * options.backlogSeconds);
  await context.databases.fresh();
  await context.broker.preparePhase([S3_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  let stand: S3StandIn | null = null;
  let services: ReaperService[] = [];
  try {
    await seedExpiredAssets(pool, { prefix: 'object-', count: backlog, url: false });
    stand = await startS3StandIn({ bucket: 'bench-objects' });
    const policiesPath = writePolicies(context.workDir, 's3', [
      {
        name: S3_POLICY,
        kind: 'remote-delete',
        schedule: NEVER,
        table: 'media_assets',
        key: 'asset_id',
        expiresAt: 'retention_expires_at',
        guard: { status: 'active' },
        batchSize: Math.min(1000, options.maxKeysPerRequest),
        remote: { kind: 's3', bucket: 'bench-objects', key: 'media/{id}', endpoint: stand.endpoint, forcePathStyle: true, region: 'us-east-1', maxKeysPerRequest: options.maxKeysPerRequest, timeoutMs: 10_000 },
        admission: { requestsPerSecond: options.requestsPerSecond, keysPerSecond: options.keysPerSecond, concurrency: options.concurrency },
        retry: { maxAttempts: 10 },
      },
    ]);
    const extraEnv = {
      AWS_ACCESS_KEY_ID: stand.credentials.accessKeyId,
      AWS_SECRET_ACCESS_KEY: stand.credentials.secretAccessKey,
      AWS_REGION: 'us-east-1',
      AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED: 'true',
    };
    services = await startServices({ ...reaperEnvironment(context, policiesPath), extraEnv }, [
      { kind: 'scheduler', id: 'bench-scheduler' },
      ...Array.from({ length: options.workers }, (_, i) => ({ kind: 'worker' as const, id: `bench-worker-${i + 1}` })),
    ]);
    const run = (await runsInsertIfAbsent(pool, { policy: S3_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const deadline = Date.now() + Math.min(context.boundMs, (3 * options.backlogSeconds + 30) * 1000);
    const done = await pollUntil(
      async () => {
        const state = (await pool.query<{ state: string }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [run.runId])).rows[0]!.state;
        return state === 'completed' ? state : undefined;
      },
      { deadline, everyMs: 250 },
    );
    for (const service of services) service.assertRunning();
    await stopServices(services);

    const forwarded = stand.deleteCalls().filter((call) => call.injected === null && call.status === 200).sort((a, b) => a.arrivedAt - b.arrivedAt);
    const keys = forwarded.reduce((sum, call) => sum + call.keys.length, 0);
    const spanSeconds = forwarded.length > 1 ? (forwarded[forwarded.length - 1]!.arrivedAt - forwarded[0]!.arrivedAt) / 1000 : 0;
    const achievedKeysPerSecond = spanSeconds > 0 ? (keys - forwarded[forwarded.length - 1]!.keys.length) / spanSeconds : 0;
    const sent = new Map<string, number>();
    for (const call of forwarded) for (const key of call.keys) sent.set(key, (sent.get(key) ?? 0) + 1);
    const duplicates = [...sent.values()].filter((n) => n > 1).length;
    const maxKeysInOneSecond = stand.maxKeysInWindow(1000);
    const figure = `object storage, ${options.keysPerSecond} keys/s, backlog ${backlog}, ${options.workers} workers`;
    const ledger = (await pool.query<{ confirmed: number }>(`SELECT count(*)::int AS confirmed FROM cleanup_ledger WHERE policy = $1 AND outcome = 'confirmed'`, [S3_POLICY])).rows[0]!;
    check(context, figure, 'keys sent in more than one request', 0, duplicates);
    if (checkFinished(context, figure, done !== undefined)) {
      check(context, figure, 'keys sent', backlog, sent.size);
      check(context, figure, 'ledger operations confirmed', backlog, ledger.confirmed);
    }
    return {
      keysPerSecond: options.keysPerSecond,
      requestsPerSecond: options.requestsPerSecond,
      concurrency: options.concurrency,
      maxKeysPerRequest: options.maxKeysPerRequest,
      workers: options.workers,
      backlog,
      achievedKeysPerSecond,
      achievedRatio: achievedKeysPerSecond / options.keysPerSecond,
      maxKeysInOneSecond,
      maxWindowRatio: maxKeysInOneSecond / options.keysPerSecond,
      requests: forwarded.length,
      requestsPer1000Keys: keys > 0 ? (forwarded.length * 1000) / keys : 0,
      duplicates,
      throttled: stand.deleteCalls().filter((call) => call.status !== 200).length,
      arrivals: forwarded.map((call) => [call.arrivedAt - forwarded[0]!.arrivedAt, call.keys.length]),
      seconds: spanSeconds,
      bounded: done === undefined,
    };
  } finally {
    await stopServices(services);
    await stand?.close();
    await pool.end();
  }
}
