import { HeadObjectCommand, PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import pino from 'pino';
import type pg from 'pg';
import type { HandlerContext } from '../../services/worker/handlers/types';
import type { BatchV1 } from '../../shared/contracts/batch';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeS3Client } from '../../shared/remote/s3';
import type { S3StandIn } from '../../tools/s3-stand-in/server';
import { MEDIA_POLICY, mediaPolicyHead } from './remote-helpers';

/**
 * Shared pieces of the object storage tests (test/integration/s3-*.test.ts, test/faults/s3-*):
 * the media policy pointed at the S3 stand-in (tools/s3-stand-in: s3rver behind a recording,
 * fault-injecting proxy), objects for seeded assets, and in-process handler contexts.
 */

export const S3_BUCKET = 'media-bucket';

export interface S3PolicyOptions {
  endpoint: string;
  requestsPerSecond: number;
  keysPerSecond: number;
  concurrency: number;
  maxKeysPerRequest?: number;
  batchSize?: number;
  timeoutMs?: number;
  leaseMs?: number;
  maxAttempts?: number;
  versions?: 'current' | 'all';
  /** Turn expiry events on with this outbox limit. */
  events?: { maxOutbox: number };
}

/** The media-assets policy against the stand-in bucket, keys "media/{id}"; audit on; the schedule never fires. */
export function s3PolicyYaml(options: S3PolicyOptions): string {
  return `${mediaPolicyHead(options.batchSize ?? 100)}
    audit: { enabled: true }
    remote:
      kind: s3
      bucket: ${S3_BUCKET}
      key: "media/{id}"
      endpoint: ${options.endpoint}
      forcePathStyle: true
      region: us-east-1
      maxKeysPerRequest: ${options.maxKeysPerRequest ?? 1000}
      versions: ${options.versions ?? 'current'}
      timeoutMs: ${options.timeoutMs ?? 3000}
    admission: { requestsPerSecond: ${options.requestsPerSecond}, keysPerSecond: ${options.keysPerSecond}, concurrency: ${options.concurrency} }
    retry: { maxAttempts: ${options.maxAttempts ?? 10} }
    leaseMs: ${options.leaseMs ?? 13000}
${options.events ? `    events: { enabled: true, maxOutbox: ${options.events.maxOutbox} }\n` : ''}`;
}

/** What a process (or this one) needs to reach the stand-in through the SDK's default credential chain. */
export function s3Environment(stand: S3StandIn): Record<string, string> {
  return {
    AWS_ACCESS_KEY_ID: stand.credentials.accessKeyId,
    AWS_SECRET_ACCESS_KEY: stand.credentials.secretAccessKey,
    AWS_REGION: 'us-east-1',
    AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED: 'true',
  };
}

/** A client straight to s3rver (no proxy: not recorded), for putting and looking at objects. */
export function directClient(stand: S3StandIn): S3Client {
  return makeS3Client({ kind: 's3', bucket: stand.bucket, key: 'media/{id}', endpoint: stand.directEndpoint, forcePathStyle: true, region: 'us-east-1', maxKeysPerRequest: 1000, versions: 'current', timeoutMs: 5000 }, { credentials: stand.credentials });
}

export async function putObjects(stand: S3StandIn, ids: readonly string[]): Promise<void> {
  const client = directClient(stand);
  for (const id of ids) await client.send(new PutObjectCommand({ Bucket: stand.bucket, Key: `media/${id}`, Body: `bytes of ${id}` }));
}

export async function objectExists(stand: S3StandIn, id: string): Promise<boolean> {
  try {
    await directClient(stand).send(new HeadObjectCommand({ Bucket: stand.bucket, Key: `media/${id}` }));
    return true;
  } catch (error) {
    if ((error as { $metadata?: { httpStatusCode?: number } }).$metadata?.httpStatusCode === 404) return false;
    throw error;
  }
}

export function handlerContext(pool: pg.Pool, workerId = 'in-process-worker'): HandlerContext {
  return { pool, workerId, log: pino({ level: 'silent' }), metrics: makeMetrics(), deliveryCount: 1, failpoint: () => undefined };
}

let sequence = 0;

/** A batch naming `assetIds` with their current expiries, cut off now (database clock). */
export async function batchFor(pool: pg.Pool, assetIds: readonly string[]): Promise<BatchV1> {
  // Taken before the query: batches made at once (Promise.all) each get their own id.
  const number = (sequence += 1);
  const result = await pool.query<{ id: string; e: string; now: string }>(
    `SELECT asset_id AS id, reaper_iso(retention_expires_at) AS e, reaper_iso(clock_timestamp()) AS now FROM media_assets WHERE asset_id = ANY($1::text[]) ORDER BY asset_id`,
    [assetIds],
  );
  return {
    version: 1,
    runId: '00000000-0000-4000-8000-' + String(number).padStart(12, '0'),
    batchId: `s3-test:${number}`,
    policy: MEDIA_POLICY,
    cutoff: result.rows[0]!.now,
    items: result.rows.map((row) => ({ id: row.id, observedExpiry: row.e })),
  };
}

/** Audit rows of the media policy per asset id: how many rows each deleted asset has. */
export async function auditCounts(pool: pg.Pool): Promise<Map<string, number>> {
  const result = await pool.query<{ key: string; n: number }>(`SELECT key, count(*)::int AS n FROM cleanup_audit WHERE policy = $1 GROUP BY key`, [MEDIA_POLICY]);
  return new Map(result.rows.map((row) => [row.key, row.n]));
}
