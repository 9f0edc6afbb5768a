import assert from 'node:assert/strict';
import { beforeEach, test } from 'node:test';
import { DeleteObjectsCommand, ListObjectVersionsCommand, S3Client, S3ServiceException } from '@aws-sdk/client-s3';
import { mockClient } from 'aws-sdk-client-mock';
import type { S3DeletePolicy } from '../../shared/config/policies';
import { classifyRequestError, makeObjectStorageClient, objectKeyFor, type S3RequestOutcome } from '../../shared/remote/s3';

/**
 * The object storage client with the SDK mocked (aws-sdk-client-mock): versioned buckets and
 * Object Lock, which s3rver does not implement (docs/guardrails.md "Object storage (S3)"), and the
 * classification of whole-request failures.
 */

const remote = (versions: 'current' | 'all'): S3DeletePolicy['remote'] => ({
  kind: 's3',
  bucket: 'media-bucket',
  key: 'media/{id}',
  region: 'us-east-1',
  maxKeysPerRequest: 1000,
  versions,
  timeoutMs: 2000,
});

const client = new S3Client({ region: 'us-east-1', credentials: { accessKeyId: 'test', secretAccessKey: 'test' } });
const s3 = mockClient(client);

beforeEach(() => s3.reset());

function answered(outcome: S3RequestOutcome): Extract<S3RequestOutcome, { kind: 'answered' }> {
  assert.equal(outcome.kind, 'answered', JSON.stringify(outcome));
  return outcome as Extract<S3RequestOutcome, { kind: 'answered' }>;
}

test('versions: all lists every version and delete marker of the exact key (not longer keys), deletes each by version id, and reports their ids', async () => {
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/1' }).resolves({
    Versions: [
      { Key: 'media/1', VersionId: 'v3', IsLatest: true },
      { Key: 'media/1', VersionId: 'v2' },
      { Key: 'media/10', VersionId: 'other' },
    ],
    DeleteMarkers: [{ Key: 'media/1', VersionId: 'dm1' }],
    IsTruncated: false,
  });
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/2' }).resolves({ Versions: [{ Key: 'media/2', VersionId: 'w1' }], IsTruncated: false });
  s3.on(DeleteObjectsCommand).callsFake((input: { Delete: { Objects: Array<{ Key: string; VersionId?: string }> } }) => ({
    Deleted: input.Delete.Objects.map((o) => ({ Key: o.Key, VersionId: o.VersionId })),
  }));
  const outcome = answered(await makeObjectStorageClient(remote('all'), client).deleteKeys(['media/1', 'media/2']));
  const sent = s3.commandCalls(DeleteObjectsCommand);
  assert.equal(sent.length, 1, 'one DeleteObjects request');
  assert.deepEqual(sent[0]!.args[0].input.Delete!.Objects, [
    { Key: 'media/1', VersionId: 'v3' },
    { Key: 'media/1', VersionId: 'v2' },
    { Key: 'media/1', VersionId: 'dm1' },
    { Key: 'media/2', VersionId: 'w1' },
  ]);
  assert.deepEqual(outcome.results.get('media/1'), { kind: 'deleted', versionIds: ['v3', 'v2', 'dm1'] });
  assert.deepEqual(outcome.results.get('media/2'), { kind: 'deleted', versionIds: ['w1'] });
});

test('versions: all follows a truncated listing, and a key with no version left is deleted (nothing there)', async () => {
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/big', KeyMarker: undefined }).resolves({
    Versions: [{ Key: 'media/big', VersionId: 'a' }],
    IsTruncated: true,
    NextKeyMarker: 'media/big',
    NextVersionIdMarker: 'a',
  });
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/big', KeyMarker: 'media/big', VersionIdMarker: 'a' }).resolves({ Versions: [{ Key: 'media/big', VersionId: 'b' }], IsTruncated: false });
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/gone' }).resolves({ IsTruncated: false });
  s3.on(DeleteObjectsCommand).callsFake((input: { Delete: { Objects: Array<{ Key: string; VersionId?: string }> } }) => ({
    Deleted: input.Delete.Objects.map((o) => ({ Key: o.Key, VersionId: o.VersionId })),
  }));
  const outcome = answered(await makeObjectStorageClient(remote('all'), client).deleteKeys(['media/big', 'media/gone']));
  assert.deepEqual(outcome.results.get('media/big'), { kind: 'deleted', versionIds: ['a', 'b'] });
  assert.deepEqual(outcome.results.get('media/gone'), { kind: 'deleted', versionIds: [] });
});

test('Object Lock: a version under legal hold or retention comes back as a per-key AccessDenied: the key is rejected (never retried), the versions that did go are reported', async () => {
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/locked' }).resolves({ Versions: [{ Key: 'media/locked', VersionId: 'new' }, { Key: 'media/locked', VersionId: 'held' }], IsTruncated: false });
  s3.on(ListObjectVersionsCommand, { Prefix: 'media/free' }).resolves({ Versions: [{ Key: 'media/free', VersionId: 'f1' }], IsTruncated: false });
  s3.on(DeleteObjectsCommand).resolves({
    Deleted: [
      { Key: 'media/locked', VersionId: 'new' },
      { Key: 'media/free', VersionId: 'f1' },
    ],
    Errors: [{ Key: 'media/locked', VersionId: 'held', Code: 'AccessDenied', Message: 'Access Denied because object protected by object lock.' }],
  });
  const outcome = answered(await makeObjectStorageClient(remote('all'), client).deleteKeys(['media/locked', 'media/free']));
  assert.deepEqual(outcome.results.get('media/locked'), {
    kind: 'rejected',
    code: 'AccessDenied',
    message: 'Access Denied because object protected by object lock.',
    deletedVersionIds: ['new'],
  });
  assert.deepEqual(outcome.results.get('media/free'), { kind: 'deleted', versionIds: ['f1'] });
});

test('versions: current sends keys without version ids (a delete marker on a versioned bucket) and maps per-key errors by code', async () => {
  s3.on(DeleteObjectsCommand).resolves({
    Deleted: [{ Key: 'media/a', DeleteMarker: true, DeleteMarkerVersionId: 'm1' }],
    Errors: [
      { Key: 'media/b', Code: 'InternalError', Message: 'We encountered an internal error.' },
      { Key: 'media/c', Code: 'SlowDown', Message: 'Please reduce your request rate.' },
      { Key: 'media/d', Code: 'AccessDenied', Message: 'Access Denied' },
    ],
  });
  const outcome = answered(await makeObjectStorageClient(remote('current'), client).deleteKeys(['media/a', 'media/b', 'media/c', 'media/d', 'media/e']));
  assert.equal(s3.commandCalls(ListObjectVersionsCommand).length, 0, 'no listing for current versions');
  assert.deepEqual(s3.commandCalls(DeleteObjectsCommand)[0]!.args[0].input.Delete!.Objects, ['a', 'b', 'c', 'd', 'e'].map((id) => ({ Key: `media/${id}` })));
  assert.deepEqual(outcome.results.get('media/a'), { kind: 'deleted', versionIds: [null] });
  assert.equal(outcome.results.get('media/b')!.kind, 'retryable');
  assert.equal(outcome.results.get('media/c')!.kind, 'retryable');
  assert.equal(outcome.results.get('media/d')!.kind, 'rejected');
  assert.equal(outcome.results.get('media/e')!.kind, 'retryable', 'a key the answer does not name is tried again, never taken as deleted');
});

function serviceError(name: string, status: number, headers: Record<string, string> = {}): S3ServiceException {
  const error = new S3ServiceException({ name, $fault: status >= 500 ? 'server' : 'client', $metadata: { httpStatusCode: status } });
  (error as unknown as { $response: unknown }).$response = { headers };
  return error;
}

test('whole-request failures: 503 SlowDown and 429 throttle the policy; other 5xx and network errors are uncertain; other 4xx reject', () => {
  assert.deepEqual(classifyRequestError(serviceError('SlowDown', 503)), { kind: 'throttled', status: 503, code: 'SlowDown', retryAfterMs: null });
  assert.deepEqual(classifyRequestError(serviceError('TooManyRequests', 429, { 'retry-after': '3' })), { kind: 'throttled', status: 429, code: 'TooManyRequests', retryAfterMs: 3000 });
  assert.equal(classifyRequestError(serviceError('InternalError', 500)).kind, 'uncertain');
  assert.equal(classifyRequestError(serviceError('ServiceUnavailable', 503)).kind, 'uncertain');
  assert.equal(classifyRequestError(Object.assign(new Error('socket hang up'), { code: 'ECONNRESET' })).kind, 'uncertain');
  assert.equal(classifyRequestError(Object.assign(new Error('aborted'), { name: 'TimeoutError' })).kind, 'uncertain');
  const denied = classifyRequestError(serviceError('NoSuchBucket', 404));
  assert.equal(denied.kind, 'rejected');
  assert.equal(classifyRequestError(serviceError('AccessDenied', 403)).kind, 'rejected');
});

test('a request that throws is an outcome, never an exception', async () => {
  s3.on(DeleteObjectsCommand).rejects(serviceError('SlowDown', 503));
  assert.equal((await makeObjectStorageClient(remote('current'), client).deleteKeys(['media/a'])).kind, 'throttled');
  s3.on(ListObjectVersionsCommand).rejects(Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' }));
  assert.equal((await makeObjectStorageClient(remote('all'), client).deleteKeys(['media/a'])).kind, 'uncertain');
});

test('the object key puts the row key in place of {id}, as it is', () => {
  assert.equal(objectKeyFor('media/{id}', 'a b/ü%'), 'media/a b/ü%');
  assert.equal(objectKeyFor('tenants/{id}/original-{id}', '7'), 'tenants/7/original-7');
});

test('warm-up at start-up: no region anywhere is an error naming remote.region; with one, credentials come from the default chain (environment here)', async () => {
  const saved = { region: process.env.AWS_REGION, defaultRegion: process.env.AWS_DEFAULT_REGION, key: process.env.AWS_ACCESS_KEY_ID, secret: process.env.AWS_SECRET_ACCESS_KEY, config: process.env.AWS_CONFIG_FILE };
  try {
    delete process.env.AWS_REGION;
    delete process.env.AWS_DEFAULT_REGION;
    process.env.AWS_CONFIG_FILE = '/nonexistent/reaper-test-aws-config';
    const { region: _region, ...withoutRegion } = remote('current');
    await assert.rejects(makeObjectStorageClient(withoutRegion).warmUp(), /remote\.region/);
    process.env.AWS_ACCESS_KEY_ID = 'from-the-environment';
    process.env.AWS_SECRET_ACCESS_KEY = 'secret-from-the-environment';
    await makeObjectStorageClient(remote('current')).warmUp();
  } finally {
    for (const [name, value] of [['AWS_REGION', saved.region], ['AWS_DEFAULT_REGION', saved.defaultRegion], ['AWS_ACCESS_KEY_ID', saved.key], ['AWS_SECRET_ACCESS_KEY', saved.secret], ['AWS_CONFIG_FILE', saved.config]] as const) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
  }
});
