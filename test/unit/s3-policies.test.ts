import assert from 'node:assert/strict';
import { test } from 'node:test';
import { stringify } from 'yaml';
import { ConfigError } from '../../shared/config/errors';
import { isS3Policy, parsePolicies, policyVersion, s3RequestKeys, type S3DeletePolicy } from '../../shared/config/policies';

/** Object storage policies (remote.kind s3, issue 21 item 1): what is accepted, what is refused and how the refusal reads. */

function s3Policy(overrides: Record<string, unknown> = {}, remote: Record<string, unknown> = {}, admission: Record<string, unknown> = {}): Record<string, unknown> {
  return {
    name: 'media-objects',
    kind: 'remote-delete',
    schedule: '*/5 * * * *',
    table: 'media_assets',
    key: 'asset_id',
    expiresAt: 'retention_expires_at',
    remote: { kind: 's3', bucket: 'media-bucket', key: 'media/{id}', ...remote },
    admission: { requestsPerSecond: 50, keysPerSecond: 3000, concurrency: 4, ...admission },
    ...overrides,
  };
}

function parse(policy: Record<string, unknown>): S3DeletePolicy {
  const parsed = parsePolicies(stringify({ policies: [policy] }), 'test-policies.yaml', {}).get(String(policy.name))!;
  assert.ok(isS3Policy(parsed), 'read as an object storage policy');
  return parsed;
}

function refused(policy: Record<string, unknown>, fragments: readonly string[]): string {
  let caught: unknown;
  try {
    parsePolicies(stringify({ policies: [policy] }), 'test-policies.yaml', {});
  } catch (error) {
    caught = error;
  }
  assert.ok(caught instanceof ConfigError, `expected a ConfigError containing ${JSON.stringify(fragments)}, got ${String(caught)}`);
  for (const fragment of fragments) assert.ok(caught.message.includes(fragment), `message should contain ${JSON.stringify(fragment)}:\n${caught.message}`);
  return caught.message;
}

test('an s3 remote with only bucket and key takes the defaults: 1000 keys a request, current versions, 10 s timeout', () => {
  const policy = parse(s3Policy());
  assert.equal(policy.kind, 'remote-delete');
  assert.deepEqual(policy.remote, { kind: 's3', bucket: 'media-bucket', key: 'media/{id}', maxKeysPerRequest: 1000, versions: 'current', timeoutMs: 10_000 });
  // The parts every remote-delete policy shares read keys: ratePerSecond is keysPerSecond, burst one request's keys.
  assert.deepEqual(policy.admission, { requestsPerSecond: 50, keysPerSecond: 3000, concurrency: 4, ratePerSecond: 3000, burst: 1000 });
  assert.match(policyVersion(policy), /^[0-9a-f]{16}$/);
});

test('region, endpoint, forcePathStyle and versions: all are read', () => {
  const policy = parse(s3Policy({}, { region: 'eu-west-1', endpoint: 'http://127.0.0.1:9000', forcePathStyle: true, versions: 'all', maxKeysPerRequest: 250 }));
  assert.equal(policy.remote.region, 'eu-west-1');
  assert.equal(policy.remote.endpoint, 'http://127.0.0.1:9000');
  assert.equal(policy.remote.forcePathStyle, true);
  assert.equal(policy.remote.versions, 'all');
  assert.equal(policy.admission.burst, 250);
});

test('a request never carries more than a second of keys, and whole requests fill a second evenly', () => {
  assert.equal(s3RequestKeys(3000, 1000), 1000);
  assert.equal(s3RequestKeys(500, 1000), 500, 'keysPerSecond below a full request');
  assert.equal(s3RequestKeys(1500, 1000), 750, 'two requests of 750 a second, not 1000 + 500');
  assert.equal(s3RequestKeys(0.5, 1000), 1, 'at least one key');
});

test('bad values are refused naming the field and the value', () => {
  refused(s3Policy({}, { bucket: 'Media_Bucket' }), ['policies.0.remote.bucket', 'S3 bucket name', '"Media_Bucket"']);
  refused(s3Policy({}, { key: 'media/asset' }), ['policies.0.remote.key', 'must contain {id}', '"media/asset"']);
  refused(s3Policy({}, { maxKeysPerRequest: 1001 }), ['policies.0.remote.maxKeysPerRequest', '1001']);
  refused(s3Policy({}, { versions: 'latest' }), ['policies.0.remote.versions', '"latest"']);
  refused(s3Policy({}, { endpoint: 'ftp://store' }), ['policies.0.remote.endpoint', '"ftp://store"']);
  refused(s3Policy({}, { region: 'EU West' }), ['policies.0.remote.region', '"EU West"']);
  refused(s3Policy({}, {}, { keysPerSecond: 0 }), ['policies.0.admission.keysPerSecond', '0']);
  refused(s3Policy({}, {}, { requestsPerSecond: 200, keysPerSecond: 100 }), ['policies.0.admission.requestsPerSecond', 'must not exceed admission.keysPerSecond (100)', 'got 200']);
  refused(s3Policy({ leaseMs: 15_000 }, { timeoutMs: 10_000 }), ['policies.0.leaseMs', 'remote.timeoutMs (10000)', '15000']);
});

test('HTTP keys on an s3 remote, s3 keys on an HTTP remote, HTTP admission on an s3 policy, and an unknown remote kind are refused', () => {
  refused(s3Policy({}, { baseUrl: 'http://127.0.0.1' }), ['policies.0.remote', 'baseUrl']);
  refused(s3Policy({}, {}, { ratePerSecond: 10 }), ['policies.0.admission', 'ratePerSecond']);
  refused(s3Policy({ remote: { baseUrl: 'http://127.0.0.1', path: '/a/{id}', bucket: 'media-bucket' } }), ['policies.0.remote', 'bucket']);
  refused(s3Policy({}, { kind: 'gcs' }), ['policies.0.remote.kind', 'must be "s3"', '"gcs"']);
});

test('credentials in the file are refused: they come from the SDK default chain only', () => {
  refused(s3Policy({}, { accessKeyId: 'AKIA', secretAccessKey: 'secret' }), ['policies.0.remote', 'accessKeyId']);
});
