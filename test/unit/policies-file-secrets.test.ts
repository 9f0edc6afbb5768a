/**
 * `${file:/path}` in the policies file (issue 11): a remote API token comes from a mounted secret
 * file, like every other secret, instead of the environment.
 */
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { ConfigError } from '../../shared/config/errors';
import { parsePolicies } from '../../shared/config/policies';

const dir = mkdtempSync(path.join(tmpdir(), 'reaper-policy-secrets-'));
after(() => rmSync(dir, { recursive: true, force: true }));

function policies(headerValue: string): string {
  return `policies:
  - name: media-assets
    kind: remote-delete
    schedule: "*/5 * * * *"
    table: media_assets
    key: asset_id
    expiresAt: retention_expires_at
    remote:
      baseUrl: "\${MEDIA_URL}"
      path: /assets/{id}
      headers:
        authorization: "${headerValue}"
    admission: { ratePerSecond: 5, burst: 5, concurrency: 2 }
`;
}

function headersOf(text: string, env: NodeJS.ProcessEnv = { MEDIA_URL: 'https://media.example' }): Record<string, string> {
  const policy = parsePolicies(text, 'policies.yaml', env).get('media-assets')!;
  assert.equal(policy.kind, 'remote-delete');
  return policy.kind === 'remote-delete' && policy.remote.kind !== 's3' ? policy.remote.headers : {};
}

test('${file:/path} is replaced by the file content without its trailing newline', () => {
  const token = path.join(dir, 'media-api-token');
  writeFileSync(token, 's3cr3t-token\n', { mode: 0o600 });
  assert.deepEqual(headersOf(policies(`Bearer \${file:${token}}`)), { authorization: 'Bearer s3cr3t-token' });
});

test('${NAME} still reads the environment, and both forms mix', () => {
  const token = path.join(dir, 'mixed');
  writeFileSync(token, 'abc');
  assert.deepEqual(headersOf(policies(`\${SCHEME} \${file:${token}}`), { MEDIA_URL: 'https://m.example', SCHEME: 'Token' }), { authorization: 'Token abc' });
});

test('an unreadable file is a ConfigError naming the key and the path; a relative path is refused', () => {
  const missing = path.join(dir, 'no-such-token');
  assert.throws(() => headersOf(policies(`Bearer \${file:${missing}}`)), (error: unknown) => {
    assert.ok(error instanceof ConfigError);
    assert.match(error.message, /policies\.yaml\.policies\[0\]\.remote\.headers\.authorization: cannot read \$\{file:.*no-such-token\}/);
    return true;
  });
  assert.throws(() => headersOf(policies('Bearer ${file:relative/token}')), /must name an absolute path/);
});
