import assert from 'node:assert/strict';
import { test } from 'node:test';
import { stringify } from 'yaml';
import { ConfigError } from '../../shared/config/errors';
import { LEASE_MARGIN_MS, parsePolicies } from '../../shared/config/policies';

/**
 * Issue 7, item 7: a lease must cover more than the request (the wait for a late grant's token, a
 * pool checkout, the commit, the ledger write), so leaseMs >= remote.timeoutMs + 10 s, refused
 * with a message naming the key and the value otherwise.
 */
function remote(leaseMs: number, timeoutMs = 5000): string {
  return stringify({
    policies: [
      {
        name: 'media-assets',
        kind: 'remote-delete',
        schedule: '*/5 * * * *',
        table: 'media_assets',
        key: 'asset_id',
        expiresAt: 'retention_expires_at',
        remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets/{id}', timeoutMs },
        admission: { ratePerSecond: 50, burst: 10, concurrency: 8 },
        leaseMs,
      },
    ],
  });
}

test('the documented margin is 10 s', () => {
  assert.equal(LEASE_MARGIN_MS, 10_000);
});

test('a lease that only just outlives the request (timeout + 1 ms) is refused, naming leaseMs and its value', () => {
  assert.throws(
    () => parsePolicies(remote(5001), 'policies.yaml', {}),
    (error: unknown) => {
      assert.ok(error instanceof ConfigError);
      assert.match(error.message, /policies\.0\.leaseMs/);
      assert.match(error.message, /remote\.timeoutMs \(5000\) \+ 10000 ms = 15000/);
      assert.match(error.message, /got 5001/);
      return true;
    },
  );
});

test('one millisecond short of the margin is refused; the margin itself is accepted', () => {
  assert.throws(() => parsePolicies(remote(14_999), 'policies.yaml', {}), /leaseMs.*15000.*got 14999/s);
  assert.doesNotThrow(() => parsePolicies(remote(15_000), 'policies.yaml', {}));
  assert.doesNotThrow(() => parsePolicies(remote(40_000, 30_000), 'policies.yaml', {}));
  assert.throws(() => parsePolicies(remote(39_999, 30_000), 'policies.yaml', {}), /policies\.0\.leaseMs/);
});

test('the default lease (30 s) with the default timeout (5 s) passes', () => {
  const text = remote(30_000).replace(/\n\s+leaseMs: 30000/, '');
  assert.doesNotThrow(() => parsePolicies(text, 'policies.yaml', {}));
});
