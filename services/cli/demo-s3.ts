import { appendFileSync } from 'node:fs';
import { ListObjectsV2Command, PutObjectCommand, S3Client } from '@aws-sdk/client-s3';
import type pg from 'pg';
import type { RunSummary } from '../../shared/db/queries/runs';
import type { S3StandIn } from '../../tools/s3-stand-in/server';

/**
 * The object storage part of `reaper demo` (docs/guardrails.md "Object storage (S3)"): a policy
 * `media-objects` (remote.kind s3) over the demo's media_assets rows whose status is `archived`,
 * deleting their objects "media/<id>" from an in-process S3 server (the stand-in: s3rver behind a
 * recording proxy) in DeleteObjects requests, with admission in requests and keys. Kept apart from
 * demo.ts so the demo reads as before; s3rver is a development dependency, so where it is missing
 * (the demo image) this part is skipped with one line.
 */

export const OBJECTS_POLICY = 'media-objects';
const BUCKET = 'reaper-demo-media';
const OBJECTS = { expired: 400, retained: 50, refused: 3 };
const LIMITS = { requestsPerSecond: 4, keysPerSecond: 200, concurrency: 2, maxKeysPerRequest: 100 };

export interface ObjectStorageDemo {
  /** The SDK's default chain reads these: the stand-in's development credentials. */
  env: Record<string, string>;
  seed(pool: pg.Pool): Promise<void>;
  summarise(pool: pg.Pool, done: RunSummary): Promise<boolean>;
  close(): Promise<void>;
}

const say = (text: string): void => void process.stdout.write(`${text}\n`);

/**
 * Starts the stand-in and adds `media-objects` to the demo's policies file at `policiesPath` (which
 * the demo keeps, so the environment it prints shows all three policies); null (and says why) when
 * s3rver is not installed.
 */
export async function startObjectStorageDemo(policiesPath: string): Promise<ObjectStorageDemo | null> {
  let stand: S3StandIn;
  try {
    const { startS3StandIn } = require('../../tools/s3-stand-in/server') as typeof import('../../tools/s3-stand-in/server');
    stand = await startS3StandIn({ bucket: BUCKET });
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== 'MODULE_NOT_FOUND') throw error;
    say('   (object storage part skipped: the S3 stand-in needs s3rver, a development dependency; run `npm run demo` from the source tree)');
    return null;
  }
  appendFileSync(
    policiesPath,
    `  - name: ${OBJECTS_POLICY}
    kind: remote-delete
    schedule: "*/5 * * * *"
    table: media_assets
    key: asset_id
    expiresAt: retention_expires_at
    guard: { status: archived }
    audit: { enabled: true, retainDays: 90 }
    markConfirmed: { status: purged }
    batchSize: ${LIMITS.maxKeysPerRequest}
    remote:
      kind: s3
      bucket: ${BUCKET}
      key: "media/{id}"
      endpoint: ${stand.endpoint}    # the demo's in-process S3 stand-in (gone when the demo ends)
      forcePathStyle: true
      region: us-east-1
      maxKeysPerRequest: ${LIMITS.maxKeysPerRequest}
    admission: { requestsPerSecond: ${LIMITS.requestsPerSecond}, keysPerSecond: ${LIMITS.keysPerSecond}, concurrency: ${LIMITS.concurrency} }
`,
  );
  const env = {
    AWS_ACCESS_KEY_ID: stand.credentials.accessKeyId,
    AWS_SECRET_ACCESS_KEY: stand.credentials.secretAccessKey,
    AWS_REGION: 'us-east-1',
    AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED: 'true',
  };
  const direct = new S3Client({ region: 'us-east-1', endpoint: stand.directEndpoint, forcePathStyle: true, credentials: stand.credentials });
  const refused = Array.from({ length: OBJECTS.refused }, (_, i) => `object-${i * 101 + 7}`);

  return {
    env,
    async seed(pool) {
      const ids = (
        await pool.query<{ asset_id: string }>(
          `INSERT INTO media_assets (asset_id, status, retention_expires_at, url)
           SELECT 'object-' || i, 'archived',
                  CASE WHEN i <= $1::int THEN now() - interval '1 day' + (random() * interval '1 hour') ELSE now() + interval '30 days' END,
                  's3://${BUCKET}/media/object-' || i
           FROM generate_series(1, $1::int + $2::int) i RETURNING asset_id`,
          [OBJECTS.expired, OBJECTS.retained],
        )
      ).rows.map((row) => row.asset_id);
      for (let at = 0; at < ids.length; at += 25) {
        await Promise.all(ids.slice(at, at + 25).map((id) => direct.send(new PutObjectCommand({ Bucket: BUCKET, Key: `media/${id}`, Body: `bytes of ${id}` }))));
      }
      // A few objects the store refuses to delete (as an IAM deny or an Object Lock would): kept for review.
      for (const id of refused) stand.keyErrors.set(`media/${id}`, 'AccessDenied');
      say(`   ${OBJECTS.expired} archived objects past retention in an S3 bucket (${OBJECTS.refused} of which the store refuses), ${OBJECTS.retained} still retained`);
    },
    async summarise(pool, done) {
      const ledger = (
        await pool.query<{ confirmed: number; rejected: number; audited: number; kept: number }>(
          `SELECT (SELECT count(*) FROM cleanup_ledger WHERE policy = $1 AND outcome = 'confirmed')::int AS confirmed,
                  (SELECT count(*) FROM cleanup_ledger WHERE policy = $1 AND outcome = 'rejected')::int AS rejected,
                  (SELECT count(*) FROM cleanup_audit WHERE policy = $1)::int AS audited,
                  (SELECT count(*) FROM media_assets WHERE status = 'archived' AND retention_expires_at > now())::int AS kept`,
          [OBJECTS_POLICY],
        )
      ).rows[0]!;
      let left = 0;
      let token: string | undefined;
      do {
        const page = await direct.send(new ListObjectsV2Command({ Bucket: BUCKET, Prefix: 'media/object-', ContinuationToken: token }));
        left += page.KeyCount ?? 0;
        token = page.NextContinuationToken;
      } while (token);
      const requests = stand.deleteCalls().filter((call) => call.injected === null);
      const keys = requests.reduce((sum, call) => sum + call.keys.length, 0);
      const sent = new Map<string, number>();
      for (const call of requests) for (const key of call.keys) sent.set(key, (sent.get(key) ?? 0) + 1);
      const twice = [...sent.values()].filter((n) => n > 1).length;
      const expected = OBJECTS.expired - OBJECTS.refused;
      say('');
      say(`${OBJECTS_POLICY} (object storage; ${LIMITS.requestsPerSecond} requests/s, ${LIMITS.keysPerSecond} keys/s, ${LIMITS.concurrency} requests at once, up to ${LIMITS.maxKeysPerRequest} keys a request)`);
      say(`  confirmed deleted               ${ledger.confirmed}   (expected ${expected})`);
      say(`  refused by the store, kept      ${ledger.rejected}   (expected ${OBJECTS.refused}; AccessDenied, left for review)`);
      say(`  audit rows                      ${ledger.audited}   (one per deleted object)`);
      say(`  DeleteObjects requests / keys   ${requests.length} / ${keys}; ${((requests.length * 1000) / Math.max(1, keys)).toFixed(2)} requests per 1,000 keys; keys sent twice: ${twice}`);
      say(`  most keys in any second         ${stand.maxKeysInWindow(1000)} (keysPerSecond ${LIMITS.keysPerSecond})`);
      say(`  objects left in the bucket      ${left}   (expected ${OBJECTS.retained + OBJECTS.refused}: retained and refused)`);
      say(`  retained rows, kept             ${ledger.kept} of ${OBJECTS.retained}`);
      return (
        done.state === 'completed' &&
        ledger.confirmed === expected &&
        ledger.rejected === OBJECTS.refused &&
        ledger.audited === expected &&
        left === OBJECTS.retained + OBJECTS.refused &&
        ledger.kept === OBJECTS.retained &&
        twice === 0
      );
    },
    async close() {
      direct.destroy();
      await stand.close();
    },
  };
}
