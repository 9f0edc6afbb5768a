import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { PublishError } from '../../shared/amqp/publisher';
import { classifyRunError } from '../../services/scheduler/run-errors';

/** The scheduler's error table (issue 7 item 11): what fails a run, what is retried with the lease kept. */
describe('classifyRunError', () => {
  const pgError = (code: string, message = 'boom') => Object.assign(new Error(message), { code });

  test('a table dropped, a column gone, a permission revoked, a bad value: permanent, with the SQLSTATE in the reason', () => {
    for (const code of ['42P01', '42703', '42501', '42883', '22P02', '3F000', '0A000']) {
      const result = classifyRunError(pgError(code, `error ${code}`));
      assert.equal(result.kind, 'permanent', code);
      assert.match(result.reason, new RegExp(`${code}: error ${code}`));
    }
  });

  test('the database unreachable or busy, deadlocks, timeouts, credentials rotating: retryable', () => {
    for (const code of ['08006', '57P01', '53300', '40001', '40P01', '55P03', '57014', '28P01', '55000']) {
      assert.equal(classifyRunError(pgError(code)).kind, 'retryable', code);
    }
    assert.equal(classifyRunError(Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' })).kind, 'retryable');
    assert.equal(classifyRunError(new Error('timeout exceeded when trying to connect')).kind, 'retryable', 'a pool checkout timeout');
  });

  test('broker refusals are retryable; unroutable is marked as permanent once it persists', () => {
    const unroutable = classifyRunError(new PublishError('unroutable: no queue bound to reaper.cleanup with key p'));
    assert.deepEqual(unroutable, { kind: 'retryable', reason: 'unroutable: no queue bound to reaper.cleanup with key p', persistent: 'unroutable' });
    const closed = classifyRunError(new PublishError('channel closed before the broker confirmed'));
    assert.equal(closed.kind, 'retryable');
    assert.equal('persistent' in closed, false);
  });

  test('anything unknown is retried, never a reason to fail a run', () => {
    assert.equal(classifyRunError(new Error('something odd')).kind, 'retryable');
    assert.equal(classifyRunError('a string').kind, 'retryable');
    assert.equal(classifyRunError(null).kind, 'retryable');
  });
});
