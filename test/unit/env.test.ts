/**
 * Unit tests for the environment (shared/config/env.ts): defaults, `_FILE` variants, and errors
 * that name the variable without printing a secret.
 */
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import path from 'node:path';
import { ConfigError } from '../../shared/config/errors';
import { DEMO_POLICIES_PATH, loadEnv, PREFETCH_DEFAULTS, readVariable } from '../../shared/config/env';

const dir = mkdtempSync(path.join(tmpdir(), 'reaper-env-test-'));
after(() => rmSync(dir, { recursive: true, force: true }));

let fileCounter = 0;
function secretFile(content: string): string {
  const file = path.join(dir, `secret-${++fileCounter}`);
  writeFileSync(file, content, { mode: 0o600 });
  return file;
}

/** Asserts loadEnv(source) throws a ConfigError containing every fragment and none of `hidden`. */
function refused(source: NodeJS.ProcessEnv, fragments: readonly string[], hidden: readonly string[] = []): string {
  let caught: unknown;
  try {
    loadEnv(source);
  } catch (error) {
    caught = error;
  }
  assert.ok(caught !== undefined, `expected a ConfigError containing ${JSON.stringify(fragments)}, but loadEnv succeeded`);
  assert.ok(caught instanceof ConfigError, `expected a ConfigError, got ${String(caught)}`);
  for (const fragment of fragments) {
    assert.ok(caught.message.includes(fragment), `message should contain ${JSON.stringify(fragment)}:\n${caught.message}`);
  }
  for (const secret of hidden) {
    assert.ok(!caught.message.includes(secret), `message must not print the secret ${JSON.stringify(secret)}:\n${caught.message}`);
    assert.ok(!String(caught.stack).includes(secret), 'the stack must not print the secret either');
  }
  return caught.message;
}

// ---------------------------------------------------------------------------------------------
// Defaults
// ---------------------------------------------------------------------------------------------

test('an empty environment gives the documented defaults', () => {
  const env = loadEnv({});
  assert.equal(env.amqpPrefix, 'reaper');
  assert.equal(env.policiesPath, DEMO_POLICIES_PATH);
  assert.equal(path.basename(env.policiesPath), 'policies.demo.yaml');
  assert.equal(env.workerId, `${hostname()}:${process.pid}`);
  assert.equal(env.logLevel, 'info');
  assert.equal(env.httpPort, undefined);
  assert.equal(env.webhookSecret, undefined);
  // Test-only crash points are not production configuration (shared/testing/failpoints.ts reads them).
  assert.equal('failpoint' in env, false);
  assert.equal('failpoint' in loadEnv({ REAPER_TEST_FAILPOINT: 'before-commit' }), false);
  assert.ok(env.databaseUrl.startsWith('postgres://'), env.databaseUrl);
  assert.ok(env.amqpUrl.startsWith('amqp://'), env.amqpUrl);
  assert.deepEqual(env.prefetch, PREFETCH_DEFAULTS, 'unset: each kind of queue its own prefetch');
  assert.ok(Number.isInteger(env.dbPoolSize) && env.dbPoolSize >= 1);
  assert.ok(Number.isInteger(env.deliveryLimit) && env.deliveryLimit >= 1);
});

test('REAPER_PREFETCH unset: row-delete queues hold more than remote-delete ones; set: it applies to every queue; a bad value names the variable', () => {
  assert.ok(PREFETCH_DEFAULTS.rowDelete > PREFETCH_DEFAULTS.remoteDelete, 'row-delete batches coalesce into one statement: more in hand, fewer statements');
  assert.deepEqual(loadEnv({ REAPER_PREFETCH: '3' }).prefetch, { rowDelete: 3, remoteDelete: 3 });
  assert.deepEqual(loadEnv({ REAPER_PREFETCH: '' }).prefetch, PREFETCH_DEFAULTS, 'empty counts as unset');
  for (const bad of ['0', '1001', '2.5', 'eight']) {
    assert.throws(() => loadEnv({ REAPER_PREFETCH: bad }), (error: Error) => error.message.includes('REAPER_PREFETCH'), `REAPER_PREFETCH=${bad}`);
  }
});

test('empty strings count as unset (defaults apply)', () => {
  const env = loadEnv({ REAPER_AMQP_PREFIX: '', LOG_LEVEL: '', HTTP_PORT: '', DATABASE_URL: '', REAPER_POLICIES: '' });
  assert.deepEqual(env, loadEnv({}));
});

test('explicit values are read and converted', () => {
  const env = loadEnv({
    DATABASE_URL: 'postgres://app@db:5432/app',
    AMQP_URL: 'amqp://app@mq:5672',
    REAPER_AMQP_PREFIX: 'reaper_t-1',
    REAPER_POLICIES: '/etc/reaper/policies.yaml',
    REAPER_WORKER_ID: 'worker-7',
    LOG_LEVEL: 'debug',
    HTTP_PORT: '9464',
  });
  assert.equal(env.databaseUrl, 'postgres://app@db:5432/app');
  assert.equal(env.amqpUrl, 'amqp://app@mq:5672');
  assert.equal(env.amqpPrefix, 'reaper_t-1');
  assert.equal(env.policiesPath, '/etc/reaper/policies.yaml');
  assert.equal(env.workerId, 'worker-7');
  assert.equal(env.logLevel, 'debug');
  assert.equal(env.httpPort, 9464);
});

test('HTTP_PORT 0 (any free port) and 65535 are accepted', () => {
  assert.equal(loadEnv({ HTTP_PORT: '0' }).httpPort, 0);
  assert.equal(loadEnv({ HTTP_PORT: '65535' }).httpPort, 65535);
});

test('loadEnv reads only the source it is given', () => {
  const saved = process.env.LOG_LEVEL;
  process.env.LOG_LEVEL = 'not-a-level';
  try {
    assert.equal(loadEnv({}).logLevel, 'info');
  } finally {
    if (saved === undefined) delete process.env.LOG_LEVEL;
    else process.env.LOG_LEVEL = saved;
  }
});

// ---------------------------------------------------------------------------------------------
// _FILE variants
// ---------------------------------------------------------------------------------------------

test('DATABASE_URL_FILE reads the file, trimmed', () => {
  const file = secretFile('postgres://app:s3cr3t-from-file@db:5432/app\n');
  assert.equal(loadEnv({ DATABASE_URL_FILE: file }).databaseUrl, 'postgres://app:s3cr3t-from-file@db:5432/app');
});

test('AMQP_URL_FILE and REAPER_WEBHOOK_SECRET_FILE read their files', () => {
  const amqp = secretFile('amqp://app:mq-pass@mq:5672');
  const webhook = secretFile('  0123456789abcdef-webhook  \n');
  const env = loadEnv({ AMQP_URL_FILE: amqp, REAPER_WEBHOOK_SECRET_FILE: webhook });
  assert.equal(env.amqpUrl, 'amqp://app:mq-pass@mq:5672');
  assert.equal(env.webhookSecret, '0123456789abcdef-webhook');
});

test('readVariable: the direct value, the file, empty as unset', () => {
  const file = secretFile('from-file\n');
  assert.equal(readVariable({ NAME: 'direct' }, 'NAME'), 'direct');
  assert.equal(readVariable({ NAME_FILE: file }, 'NAME'), 'from-file');
  assert.equal(readVariable({ NAME: '' }, 'NAME'), undefined);
  assert.equal(readVariable({}, 'NAME'), undefined);
  assert.equal(readVariable({ NAME: 'direct', NAME_FILE: '' }, 'NAME'), 'direct', 'an empty NAME_FILE is unset');
  assert.equal(readVariable({ NAME: '', NAME_FILE: file }, 'NAME'), 'from-file', 'an empty NAME is unset');
});

test('readVariable: both NAME and NAME_FILE set is refused, naming both and printing neither value', () => {
  const file = secretFile('file-secret-value');
  assert.throws(
    () => readVariable({ NAME: 'direct-secret-value', NAME_FILE: file }, 'NAME'),
    (error: unknown) =>
      error instanceof ConfigError &&
      error.message.includes('NAME') &&
      error.message.includes('NAME_FILE') &&
      !error.message.includes('direct-secret-value') &&
      !error.message.includes('file-secret-value'),
  );
});

test('loadEnv: both DATABASE_URL and DATABASE_URL_FILE set is refused without printing the secret', () => {
  const file = secretFile('postgres://app:file-pass@db/app');
  refused(
    { DATABASE_URL: 'postgres://app:direct-pass@db/app', DATABASE_URL_FILE: file },
    ['DATABASE_URL', 'DATABASE_URL_FILE'],
    ['direct-pass', 'file-pass'],
  );
});

test('an unreadable _FILE is refused, naming the variable and the path', () => {
  const missing = path.join(dir, 'does-not-exist');
  refused({ AMQP_URL_FILE: missing }, ['AMQP_URL_FILE', missing]);
});

test('an empty secret file is refused rather than silently using a default', () => {
  refused({ DATABASE_URL_FILE: secretFile('\n') }, ['DATABASE_URL']);
});

// ---------------------------------------------------------------------------------------------
// Bad values: named, secrets hidden
// ---------------------------------------------------------------------------------------------

test('a non-numeric HTTP_PORT is refused, naming the variable and the value', () => {
  refused({ HTTP_PORT: 'http' }, ['HTTP_PORT', '"http"']);
});

test('an out-of-range or fractional HTTP_PORT is refused, naming the variable and the value', () => {
  refused({ HTTP_PORT: '65536' }, ['HTTP_PORT', '"65536"']);
  refused({ HTTP_PORT: '-1' }, ['HTTP_PORT', '"-1"']);
  refused({ HTTP_PORT: '80.5' }, ['HTTP_PORT', '"80.5"']);
});

test('a blank HTTP_PORT (only spaces) is refused, not read as port 0', () => {
  // Number(' ') is 0: coercion would silently turn a blank value into "any free port".
  refused({ HTTP_PORT: '  ' }, ['HTTP_PORT']);
});

test('an unknown LOG_LEVEL is refused, naming the variable and the value', () => {
  refused({ LOG_LEVEL: 'verbose' }, ['LOG_LEVEL', '"verbose"']);
});

test('several bad variables are all named in one message', () => {
  refused({ LOG_LEVEL: 'loud', HTTP_PORT: 'eighty' }, ['LOG_LEVEL', '"loud"', 'HTTP_PORT', '"eighty"']);
});

test('a bad REAPER_AMQP_PREFIX is refused, naming the variable and the value', () => {
  refused({ REAPER_AMQP_PREFIX: 'reaper.prod' }, ['REAPER_AMQP_PREFIX', '"reaper.prod"']);
});

test('a too-short webhook secret is refused without printing it', () => {
  const message = refused({ REAPER_WEBHOOK_SECRET: 'hunter2-short' }, ['REAPER_WEBHOOK_SECRET', '16'], ['hunter2-short']);
  assert.ok(message.includes('hidden'), message);
});

test('a too-short webhook secret read from a file is refused without printing it', () => {
  const file = secretFile('tiny-secret\n');
  refused({ REAPER_WEBHOOK_SECRET_FILE: file }, ['REAPER_WEBHOOK_SECRET'], ['tiny-secret']);
});

test('errors about other variables do not print the secrets that were valid', () => {
  refused(
    {
      DATABASE_URL: 'postgres://app:db-password-123@db/app',
      AMQP_URL: 'amqp://app:mq-password-456@mq',
      REAPER_WEBHOOK_SECRET: 'webhook-secret-0123456789',
      HTTP_PORT: 'nope',
    },
    ['HTTP_PORT'],
    ['db-password-123', 'mq-password-456', 'webhook-secret-0123456789'],
  );
});
