import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { test } from 'node:test';
import { makeLogger, redactUrl } from '../../shared/observability/logger';

test('redactUrl hides the password of a connection URL and leaves other text alone', () => {
  assert.equal(redactUrl('postgres://reaper:s3cret@db:5432/app'), 'postgres://reaper:***@db:5432/app');
  assert.equal(redactUrl('amqp://guest:guest@127.0.0.1:5672'), 'amqp://guest:***@127.0.0.1:5672');
  assert.equal(redactUrl('amqp://127.0.0.1:5672'), 'amqp://127.0.0.1:5672');
  assert.equal(redactUrl('/etc/reaper/policies.yaml'), '/etc/reaper/policies.yaml');
});

test('the service logger never prints secrets under the redacted keys', () => {
  const lines: string[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      lines.push(chunk.toString());
      done();
    },
  });
  const log = makeLogger({ level: 'info', service: 'test', workerId: 'w-1' }, sink);
  log.info({ databaseUrl: 'postgres://u:p@h/d', nested: { password: 'hunter2' }, webhookSecret: 'x'.repeat(20), runId: 'r1' }, 'config');
  const line = JSON.parse(lines[0]!) as Record<string, unknown>;
  assert.equal(line.databaseUrl, '***');
  assert.deepEqual(line.nested, { password: '***' });
  assert.equal(line.webhookSecret, '***');
  assert.equal(line.runId, 'r1');
  assert.equal(line.service, 'test');
  assert.equal(line.workerId, 'w-1');
});
