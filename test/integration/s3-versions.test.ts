import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { DeleteObjectsCommand, ListObjectVersionsCommand, S3Client } from '@aws-sdk/client-s3';
import { mockClient } from 'aws-sdk-client-mock';
import { makeS3DeleteHandler } from '../../services/worker/handlers/s3-delete';
import { parsePolicies, type S3DeletePolicy } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/target';
import { auditVersionsOf } from '../../shared/db/queries/ledger-s3';
import { makeObjectStorageClient } from '../../shared/remote/s3';
import { assetStatuses, ledgerRows, MEDIA_POLICY, seedAssets } from '../support/remote-helpers';
import { batchFor, handlerContext, s3PolicyYaml } from '../support/s3-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * `versions: all` and Object Lock through the handler and the ledger (issue 21 item 3). s3rver
 * implements neither versioning nor Object Lock, so the store is the SDK mock
 * (aws-sdk-client-mock); the ledger, the claim, the audit and the rows are the real database.
 */
describe('object storage: versioned bucket (SDK mock)', () => {
  let bed: TestBed;
  const client = new S3Client({ region: 'us-east-1', credentials: { accessKeyId: 'test', secretAccessKey: 'test' } });
  const s3 = mockClient(client);

  before(async () => {
    bed = await makeTestBed('s3_versions');
  });

  after(async () => {
    s3.restore();
    await bed?.close();
  });

  /** The S3 handler of a `versions: all` policy over the real ledger, its store the SDK mock. */
  async function versionedHandler() {
    const policy = parsePolicies(
      s3PolicyYaml({ endpoint: 'http://127.0.0.1:1', requestsPerSecond: 100, keysPerSecond: 1000, concurrency: 2, versions: 'all' }),
      'test-policies.yaml',
      {},
    ).get(MEDIA_POLICY) as S3DeletePolicy;
    return makeS3DeleteHandler(policy, await targetResolve(bed.pool, policy), makeObjectStorageClient(policy.remote, client));
  }

  test('every version is deleted and audited with its version id; a version under Object Lock ends the key rejected, audited for what went, never retried', async () => {
    const [free, locked] = await seedAssets(bed.pool, 'versioned', 2);
    const handle = await versionedHandler();
    s3.on(ListObjectVersionsCommand, { Prefix: `media/${free}` }).resolves({
      Versions: [{ Key: `media/${free}`, VersionId: 'f-2' }, { Key: `media/${free}`, VersionId: 'f-1' }],
      DeleteMarkers: [{ Key: `media/${free}`, VersionId: 'f-marker' }],
      IsTruncated: false,
    });
    s3.on(ListObjectVersionsCommand, { Prefix: `media/${locked}` }).resolves({
      Versions: [{ Key: `media/${locked}`, VersionId: 'l-2' }, { Key: `media/${locked}`, VersionId: 'l-1' }],
      IsTruncated: false,
    });
    s3.on(DeleteObjectsCommand).callsFake((input: { Delete: { Objects: Array<{ Key: string; VersionId: string }> } }) => ({
      Deleted: input.Delete.Objects.filter((o) => o.VersionId !== 'l-1').map((o) => ({ Key: o.Key, VersionId: o.VersionId })),
      Errors: input.Delete.Objects.filter((o) => o.VersionId === 'l-1').map((o) => ({ Key: o.Key, VersionId: o.VersionId, Code: 'AccessDenied', Message: 'Access Denied because object protected by object lock.' })),
    }));

    const batch = await batchFor(bed.pool, [free!, locked!]);
    const result = await handle(batch, handlerContext(bed.pool));
    assert.equal(result.kind, 'done', JSON.stringify(result));
    const rows = new Map((await ledgerRows(bed.pool)).map((row) => [row.asset_id, row]));
    assert.equal(rows.get(free!)!.outcome, 'confirmed');
    assert.equal(rows.get(locked!)!.outcome, 'rejected');
    assert.equal(rows.get(locked!)!.last_result, 'S3 AccessDenied');
    assert.deepEqual((await auditVersionsOf(bed.pool, rows.get(free!)!.operation_key)).sort(), ['f-1', 'f-2', 'f-marker'], 'one audit row per version and delete marker');
    assert.deepEqual(await auditVersionsOf(bed.pool, rows.get(locked!)!.operation_key), ['l-2'], 'the version that did go is audited; the locked one is not');
    assert.equal((await assetStatuses(bed.pool, [locked!])).get(locked!), 'active', 'the locked asset row is kept for review');
    assert.equal((await assetStatuses(bed.pool, [free!])).get(free!), 'deleted');

    // Delivered again: the rejected key is finished, never claimed or sent again.
    const before = s3.commandCalls(DeleteObjectsCommand).length;
    await handle(batch, handlerContext(bed.pool));
    assert.equal(s3.commandCalls(DeleteObjectsCommand).length, before, 'no request for a rejected key: not retried in a loop');
    assert.equal((await ledgerRows(bed.pool, [locked!]))[0]!.attempt_count, 1);
  });

  test('versions: all over more than one DeleteObjects: a later request that fails leaves the versions the earlier one deleted audited, and only the keys it carried open', async () => {
    // 2 x 600 versions: the first request carries 1,000 entries (one key whole, 400 of the other),
    // the second the other key's last 200, and it fails (an HTTP 500: the request may not have run).
    const [first, second] = await seedAssets(bed.pool, 'chunked', 2);
    s3.reset();
    for (const asset of [first!, second!]) {
      s3.on(ListObjectVersionsCommand, { Prefix: `media/${asset}` }).resolves({
        Versions: Array.from({ length: 600 }, (_, i) => ({ Key: `media/${asset}`, VersionId: `${asset}-v${i}` })),
        IsTruncated: false,
      });
    }
    let requests = 0;
    s3.on(DeleteObjectsCommand).callsFake((input: { Delete: { Objects: Array<{ Key: string; VersionId: string }> } }) => {
      requests += 1;
      if (requests > 1) throw Object.assign(new Error('We encountered an internal error. Please try again.'), { name: 'InternalError', $metadata: { httpStatusCode: 500 } });
      return { Deleted: input.Delete.Objects.map((o) => ({ Key: o.Key, VersionId: o.VersionId })) };
    });
    const handle = await versionedHandler();

    const result = await handle(await batchFor(bed.pool, [first!, second!]), handlerContext(bed.pool));
    assert.notEqual(result.kind, 'dead-letter', JSON.stringify(result));
    assert.equal(requests, 2, 'two DeleteObjects requests: 1,000 entries, then 200');
    const rows = await ledgerRows(bed.pool, [first!, second!]);
    const audited = new Map(await Promise.all(rows.map(async (row) => [row.asset_id, (await auditVersionsOf(bed.pool, row.operation_key)).length] as const)));
    const whole = rows.find((row) => audited.get(row.asset_id) === 600);
    const split = rows.find((row) => audited.get(row.asset_id) === 400);
    assert.ok(whole && split, `one key audited with its 600 versions, the other with the 400 the first request deleted (audited: ${JSON.stringify([...audited])})`);
    assert.equal(whole.outcome, 'confirmed', 'the key whose versions all went in the first request is confirmed');
    assert.equal(split.state, 'pending', 'the key the failed request carried is tried again');
    assert.equal(split.outcome, null);
    assert.equal(split.last_result, 'S3 RequestFailed');
  });
});
