/**
 * Unit tests for the policies file (shared/config/policies.ts): what parses, what is refused, and
 * that every refusal is a ConfigError naming the field and the value.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { ConfigError } from '../../shared/config/errors';
import { DEMO_POLICIES_PATH } from '../../shared/config/env';
import { loadPolicies, parsePolicies, type RemoteDeletePolicy, type RowDeletePolicy } from '../../shared/config/policies';

/** The example from docs/design.md ("Policies file"), verbatim. */
const DESIGN_EXAMPLE = `
policies:
  - name: seat-holds              # [a-z0-9-]+; also the routing key and the work queue's suffix
    kind: row-delete
    schedule: "* * * * *"         # cron, 5 or 6 fields (seconds first), evaluated in UTC
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
    guard: { status: held }       # column = value, re-checked by the DELETE itself
    batchSize: 100                # 1..1000
  - name: media-assets
    kind: remote-delete
    schedule: "*/5 * * * *"
    table: media_assets
    key: asset_id
    expiresAt: retention_expires_at
    guard: { status: active }
    batchSize: 100
    remote:
      baseUrl: http://127.0.0.1:8081   # a value may be written \${ENV_NAME} to read the environment
      path: /assets/{id}
      timeoutMs: 5000
    admission: { ratePerSecond: 50, burst: 10, concurrency: 8 }   # across all workers together
    retry: { maxAttempts: 10 }
`;

type Doc = Record<string, unknown>;

function rowPolicy(overrides: Doc = {}): Doc {
  return {
    name: 'seat-holds',
    kind: 'row-delete',
    schedule: '* * * * *',
    table: 'seat_reservations',
    key: 'reservation_id',
    expiresAt: 'expires_at',
    guard: { status: 'held' },
    batchSize: 100,
    ...overrides,
  };
}

function remotePolicy(overrides: Doc = {}): Doc {
  return {
    name: 'media-assets',
    kind: 'remote-delete',
    schedule: '*/5 * * * *',
    table: 'media_assets',
    key: 'asset_id',
    expiresAt: 'retention_expires_at',
    guard: { status: 'active' },
    batchSize: 100,
    remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets/{id}', timeoutMs: 5000 },
    admission: { ratePerSecond: 50, burst: 10, concurrency: 8 },
    retry: { maxAttempts: 10 },
    ...overrides,
  };
}

/** JSON is valid YAML: documents built as objects are written out as JSON text. */
function yamlOf(document: unknown): string {
  return JSON.stringify(document, null, 2);
}

function parse(document: unknown, env: NodeJS.ProcessEnv = {}) {
  return parsePolicies(typeof document === 'string' ? document : yamlOf(document), 'test-policies.yaml', env);
}

/** Asserts that parsing throws a ConfigError whose message contains every fragment; returns the message. */
function refused(document: unknown, fragments: readonly string[], env: NodeJS.ProcessEnv = {}): string {
  let caught: unknown;
  try {
    parse(document, env);
  } catch (error) {
    caught = error;
  }
  assert.ok(caught !== undefined, `expected a ConfigError containing ${JSON.stringify(fragments)}, but parsing succeeded`);
  assert.ok(caught instanceof ConfigError, `expected a ConfigError, got ${String(caught)}`);
  assert.equal(caught.code, 'CONFIG_INVALID');
  assert.equal(caught.name, 'ConfigError');
  for (const fragment of fragments) {
    assert.ok(caught.message.includes(fragment), `message should contain ${JSON.stringify(fragment)}:\n${caught.message}`);
  }
  assert.ok(caught.message.includes('test-policies.yaml'), `message should name the file:\n${caught.message}`);
  return caught.message;
}

// ---------------------------------------------------------------------------------------------
// What parses
// ---------------------------------------------------------------------------------------------

test('the demo policies file shipped in infra/ parses', () => {
  const demoPath = path.resolve(__dirname, '..', '..', '..', 'infra', 'policies.demo.yaml');
  assert.equal(DEMO_POLICIES_PATH, demoPath, 'the default REAPER_POLICIES points at the shipped demo file');
  const fromText = parsePolicies(readFileSync(demoPath, 'utf8'), demoPath, {});
  const fromFile = loadPolicies(demoPath, {});
  assert.deepEqual([...fromFile.keys()], [...fromText.keys()]);
  const holds = fromFile.get('seat-holds');
  assert.ok(holds, 'the demo file defines seat-holds');
  assert.equal(holds.kind, 'row-delete');
  assert.equal(holds.table, 'seat_reservations');
  assert.equal(holds.key, 'reservation_id');
  assert.equal(holds.expiresAt, 'expires_at');
  assert.deepEqual(holds.guard, { status: 'held' });
});

test('the docs/design.md example parses, both policies, with defaults filled in', () => {
  const policies = parse(DESIGN_EXAMPLE);
  assert.deepEqual([...policies.keys()], ['seat-holds', 'media-assets']);

  const holds = policies.get('seat-holds') as RowDeletePolicy;
  assert.deepEqual(holds, {
    name: 'seat-holds',
    kind: 'row-delete',
    schedule: '* * * * *',
    table: 'seat_reservations',
    key: 'reservation_id',
    expiresAt: 'expires_at',
    guard: { status: 'held' },
    batchSize: 100,
  });

  const media = policies.get('media-assets') as RemoteDeletePolicy;
  assert.equal(media.kind, 'remote-delete');
  assert.equal(media.schedule, '*/5 * * * *');
  assert.equal(media.table, 'media_assets');
  assert.equal(media.key, 'asset_id');
  assert.equal(media.expiresAt, 'retention_expires_at');
  assert.deepEqual(media.guard, { status: 'active' });
  assert.equal(media.remote.baseUrl, 'http://127.0.0.1:8081');
  assert.equal(media.remote.path, '/assets/{id}');
  assert.equal(media.remote.timeoutMs, 5000);
  assert.deepEqual(media.admission, { ratePerSecond: 50, burst: 10, concurrency: 8 });
  assert.deepEqual(media.retry, { maxAttempts: 10 });
  assert.ok(media.leaseMs > media.remote.timeoutMs, 'the default lease outlives the request timeout');
});

test('a minimal row-delete policy gets the documented defaults (guard {}, batchSize 500)', () => {
  const { guard: _guard, batchSize: _batchSize, ...minimal } = rowPolicy();
  const policy = parse({ policies: [minimal] }).get('seat-holds') as RowDeletePolicy;
  assert.deepEqual(policy.guard, {});
  assert.equal(policy.batchSize, 500);
});

test('boundary values parse: batchSize 1 and 1000, a 6-field cron, schema.table, underscore names', () => {
  const policies = parse({
    policies: [
      rowPolicy({ name: 'a', batchSize: 1 }),
      rowPolicy({ name: 'b-2', batchSize: 1000, schedule: '*/2 * * * * *', table: 'app.seat_reservations', key: '_id' }),
    ],
  });
  assert.equal(policies.get('a')?.batchSize, 1);
  assert.equal(policies.get('b-2')?.batchSize, 1000);
  assert.equal(policies.get('b-2')?.table, 'app.seat_reservations');
});

// ---------------------------------------------------------------------------------------------
// Unknown keys: refused, naming where
// ---------------------------------------------------------------------------------------------

test('an unknown key at the top level is refused, naming the key', () => {
  refused({ policies: [rowPolicy()], polices: [] }, ['(top level)', 'polices']);
});

test('an unknown key in a policy is refused, naming the policy path and the key', () => {
  refused({ policies: [rowPolicy(), rowPolicy({ name: 'other', gaurd: { status: 'held' } })] }, ['policies.1', 'gaurd']);
});

test('an unknown key in remote is refused, naming policies.N.remote and the key', () => {
  const policy = remotePolicy({
    remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets/{id}', timeoutMs: 5000, timeout: 5000 },
  });
  refused({ policies: [policy] }, ['policies.0.remote', '"timeout"']);
});

test('an unknown key in admission is refused, naming policies.N.admission and the key', () => {
  const policy = remotePolicy({ admission: { ratePerSecond: 50, burst: 10, concurrency: 8, perWorker: true } });
  refused({ policies: [rowPolicy(), policy] }, ['policies.1.admission', 'perWorker']);
});

test("a row-delete policy's adaptive law (issue 41): 'load' or 'harm', absent by default; any other is refused naming admission.law", () => {
  const harm = parse({ policies: [rowPolicy({ admission: { law: 'harm' } })] }).get('seat-holds') as RowDeletePolicy;
  assert.equal(harm.admission?.law, 'harm');
  assert.equal((parse({ policies: [rowPolicy()] }).get('seat-holds') as RowDeletePolicy).admission?.law, undefined);
  refused({ policies: [rowPolicy({ admission: { law: 'presence' } })] }, ['policies.0.admission.law']);
});

test('remote and admission are not accepted on a row-delete policy', () => {
  refused({ policies: [rowPolicy({ admission: { ratePerSecond: 1, burst: 1, concurrency: 1 } })] }, ['policies.0', 'admission']);
});

// ---------------------------------------------------------------------------------------------
// Bad values: refused, naming the field and the value
// ---------------------------------------------------------------------------------------------

test('batchSize 0 is refused, naming the field and the value', () => {
  refused({ policies: [rowPolicy({ batchSize: 0 })] }, ['policies.0.batchSize', 'got 0']);
});

test('batchSize 1001 is refused, naming the field and the value', () => {
  refused({ policies: [rowPolicy({ batchSize: 1001 })] }, ['policies.0.batchSize', 'got 1001']);
});

test('a fractional batchSize is refused', () => {
  refused({ policies: [rowPolicy({ batchSize: 10.5 })] }, ['policies.0.batchSize', 'got 10.5']);
});

test('a name with capitals is refused, naming the field and the value', () => {
  refused({ policies: [rowPolicy({ name: 'Seat-Holds' })] }, ['policies.0.name', '"Seat-Holds"']);
});

test('a name with a dot or a space is refused (it becomes a routing key and a queue suffix)', () => {
  refused({ policies: [rowPolicy({ name: 'seat.holds' })] }, ['policies.0.name', '"seat.holds"']);
  refused({ policies: [rowPolicy({ name: 'seat holds' })] }, ['policies.0.name', '"seat holds"']);
});

test('a bad cron expression is refused, naming the field and the value', () => {
  refused({ policies: [rowPolicy({ schedule: 'every minute' })] }, ['policies.0.schedule', '"every minute"']);
  refused({ policies: [rowPolicy({ schedule: '61 * * * *' })] }, ['policies.0.schedule', '"61 * * * *"']);
});

test('a 7-field cron expression is refused', () => {
  refused({ policies: [rowPolicy({ schedule: '0 * * * * * 2026' })] }, ['policies.0.schedule', '"0 * * * * * 2026"']);
  refused({ policies: [rowPolicy({ schedule: '* * * * * * *' })] }, ['policies.0.schedule', '"* * * * * * *"']);
});

test('a 4-field cron expression is refused', () => {
  refused({ policies: [rowPolicy({ schedule: '* * * *' })] }, ['policies.0.schedule', '"* * * *"']);
});

test('a table name with a quote is refused, naming the field and the value', () => {
  const message = refused({ policies: [rowPolicy({ table: `seat_reservations"; --` })] }, ['policies.0.table']);
  assert.ok(message.includes(JSON.stringify(`seat_reservations"; --`)), message);
  refused({ policies: [rowPolicy({ table: "seat'reservations" })] }, ['policies.0.table', `"seat'reservations"`]);
});

test('a table name with a semicolon is refused, naming the field and the value', () => {
  refused({ policies: [rowPolicy({ table: 'seat_reservations; DROP TABLE x' })] }, [
    'policies.0.table',
    '"seat_reservations; DROP TABLE x"',
  ]);
});

test('key and expiresAt must be plain identifiers', () => {
  refused({ policies: [rowPolicy({ key: 'reservation id' })] }, ['policies.0.key', '"reservation id"']);
  refused({ policies: [rowPolicy({ expiresAt: 'expires_at)' })] }, ['policies.0.expiresAt', '"expires_at)"']);
});

test('a guard column with a space is refused, naming the guard and the column', () => {
  refused({ policies: [rowPolicy({ guard: { 'the status': 'held' } })] }, ['policies.0.guard', 'the status']);
});

test('a guard value that is an object is refused', () => {
  refused({ policies: [rowPolicy({ guard: { status: { in: ['held'] } } })] }, ['policies.0.guard.status']);
});

test('an unknown kind is refused, naming the field', () => {
  refused({ policies: [rowPolicy({ kind: 'soft-delete' })] }, ['policies.0.kind']);
});

test('an empty policies list is refused', () => {
  refused({ policies: [] }, ['policies']);
});

test('remote.path without {id} and a non-http baseUrl are refused', () => {
  refused(
    { policies: [remotePolicy({ remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets', timeoutMs: 5000 } })] },
    ['policies.0.remote.path', '"/assets"'],
  );
  refused(
    { policies: [remotePolicy({ remote: { baseUrl: 'ftp://127.0.0.1', path: '/assets/{id}', timeoutMs: 5000 } })] },
    ['policies.0.remote.baseUrl', '"ftp://127.0.0.1"'],
  );
});

test('a remote-delete policy without admission is refused', () => {
  const { admission: _admission, ...policy } = remotePolicy();
  refused({ policies: [policy] }, ['policies.0.admission']);
});

// ---------------------------------------------------------------------------------------------
// Cross-field rules
// ---------------------------------------------------------------------------------------------

test('duplicate policy names are refused, naming the name and the second occurrence', () => {
  refused({ policies: [rowPolicy(), rowPolicy({ table: 'other_table' })] }, ['policies.1.name', 'duplicate', 'seat-holds']);
});

test('duplicate names across kinds are refused too', () => {
  refused({ policies: [rowPolicy({ name: 'same' }), remotePolicy({ name: 'same' })] }, ['policies.1.name', '"same"']);
});

test('leaseMs equal to remote.timeoutMs is refused, naming both', () => {
  refused({ policies: [remotePolicy({ leaseMs: 5000 })] }, ['policies.0.leaseMs', 'remote.timeoutMs', '5000']);
});

test('leaseMs shorter than remote.timeoutMs is refused', () => {
  refused(
    {
      policies: [
        remotePolicy({ leaseMs: 10_000, remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets/{id}', timeoutMs: 20_000 } }),
      ],
    },
    ['policies.0.leaseMs', '20000', '10000'],
  );
});

test('leaseMs shorter than the default remote.timeoutMs (5000) is refused', () => {
  refused(
    { policies: [remotePolicy({ leaseMs: 4000, remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets/{id}' } })] },
    ['policies.0.leaseMs', '4000'],
  );
});

test('leaseMs of exactly remote.timeoutMs + the 10 s margin is accepted (issue 7, item 7)', () => {
  const policy = parse({ policies: [remotePolicy({ leaseMs: 15_000 })] }).get('media-assets') as RemoteDeletePolicy;
  assert.equal(policy.leaseMs, 15_000);
  assert.equal(policy.remote.timeoutMs, 5000);
});

// ---------------------------------------------------------------------------------------------
// ${ENV} substitution
// ---------------------------------------------------------------------------------------------

test('${ENV} in a value is replaced from the given environment', () => {
  const text = DESIGN_EXAMPLE.replace('http://127.0.0.1:8081', '${MEDIA_API_URL}').replace('/assets/{id}', '/${API_VERSION}/assets/{id}');
  const media = parse(text, { MEDIA_API_URL: 'https://media.internal:9443', API_VERSION: 'v2' }).get('media-assets') as RemoteDeletePolicy;
  assert.equal(media.remote.baseUrl, 'https://media.internal:9443');
  assert.equal(media.remote.path, '/v2/assets/{id}');
});

test('${ENV} works inside nested maps (remote.headers)', () => {
  const policy = remotePolicy({
    remote: { baseUrl: 'http://127.0.0.1:8081', path: '/assets/{id}', timeoutMs: 5000, headers: { authorization: 'Bearer ${MEDIA_TOKEN}' } },
  });
  const media = parse({ policies: [policy] }, { MEDIA_TOKEN: 't0ken' }).get('media-assets') as RemoteDeletePolicy;
  assert.deepEqual(media.remote.headers, { authorization: 'Bearer t0ken' });
});

test('a missing ${ENV} variable is refused, naming the variable and where it is used', () => {
  const text = DESIGN_EXAMPLE.replace('http://127.0.0.1:8081', '${MEDIA_API_URL}');
  const message = refused(text, ['MEDIA_API_URL', 'not set', 'remote.baseUrl'], { OTHER: 'x' });
  assert.match(message, /policies\[1\]/);
});

test('the substituted value is validated like a literal one', () => {
  const text = DESIGN_EXAMPLE.replace('http://127.0.0.1:8081', '${MEDIA_API_URL}');
  refused(text, ['policies.1.remote.baseUrl', 'not a url'], { MEDIA_API_URL: 'not a url' });
});

// ---------------------------------------------------------------------------------------------
// Not YAML, not a map
// ---------------------------------------------------------------------------------------------

test('invalid YAML is refused as a ConfigError naming the file', () => {
  refused('policies:\n  - name: [unclosed\n', ['not valid YAML']);
  refused('policies: [', ['not valid YAML']);
});

test('an empty file or a non-map document is refused', () => {
  refused('', ['(top level)']);
  refused('- just\n- a list\n', ['(top level)']);
});

test('loadPolicies on a missing file is a ConfigError naming REAPER_POLICIES and the path', () => {
  assert.throws(
    () => loadPolicies('/nonexistent/reaper-policies.yaml', {}),
    (error: unknown) =>
      error instanceof ConfigError &&
      error.message.includes('REAPER_POLICIES') &&
      error.message.includes('/nonexistent/reaper-policies.yaml'),
  );
});
