import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { DeleteObjectsCommand, ListObjectVersionsCommand, S3Client } from '@aws-sdk/client-s3';
import { mockClient } from 'aws-sdk-client-mock';
import { makeS3DeleteHandler } from '../../services/worker/handlers/s3-delete';
import { parsePolicies, type S3DeletePolicy } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/expiring-rows';
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

  test('every version is deleted and audited with its version id; a version under Object Lock ends the key rejected, audited for what went, never retried', async () => {
    const [free, locked] = await seedAssets(bed.pool, 'versioned', 2);
    const policy = parsePolicies(
      s3PolicyYaml({ endpoint: 'http://127.0.0.1:1', requestsPerSecond: 100, keysPerSecond: 1000, concurrency: 2, versions: 'all' }),
      'test-policies.yaml',
      {},
    ).get(MEDIA_POLICY) as S3DeletePolicy;
    const target = await targetResolve(bed.pool, policy);
    const handle = makeS3DeleteHandler(policy, target, makeObjectStorageClient(policy.remote, client));
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
});
