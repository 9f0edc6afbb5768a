/**
 * Unit tests for error classification in the worker (services/worker/errors.ts): which errors mean
 * "unknown, do not ack" (and whether the database is down) and which mean "this batch is bad".
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { classifyHandlerError } from '../../services/worker/errors';

/** An Error with a code, shaped like pg's DatabaseError or Node's system errors. */
function coded(code: string, message = `error ${code}`): Error {
  return Object.assign(new Error(message), { code });
}

function assertUnavailable(error: unknown): void {
  const result = classifyHandlerError(error);
  assert.equal(result.kind, 'unknown', JSON.stringify(result));
  if (result.kind !== 'unknown') return;
  assert.equal(result.databaseUnavailable, true, JSON.stringify(result));
  assert.ok(result.reason.length > 0);
}

test('pg connection exceptions (SQLSTATE class 08) -> unknown, database unavailable', () => {
  for (const code of ['08000', '08001', '08003', '08004', '08006', '08P01']) assertUnavailable(coded(code));
});

test('admin shutdown, crash shutdown, cannot connect now, too many connections -> unknown, database unavailable', () => {
  for (const code of ['57P01', '57P02', '57P03', '53300']) assertUnavailable(coded(code));
});

test('socket errors (ECONNREFUSED and friends) -> unknown, database unavailable', () => {
  for (const code of ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH']) {
    assertUnavailable(coded(code, `connect ${code} 127.0.0.1:5432`));
  }
});

test('pg client messages without a code ("Connection terminated unexpectedly", timeouts) -> database unavailable', () => {
  assertUnavailable(new Error('Connection terminated unexpectedly'));
  assertUnavailable(new Error('Connection terminated due to connection timeout'));
  assertUnavailable(new Error('Client has encountered a connection error and is not queryable'));
});

test('55000 "database is not currently accepting connections" (ALLOW_CONNECTIONS false) -> database unavailable; other 55000 errors are not', () => {
  assertUnavailable(coded('55000', 'database "app" is not currently accepting connections'));
  const other = classifyHandlerError(coded('55000', 'cannot execute DELETE in a read-only transaction'));
  assert.equal(other.kind, 'unknown', JSON.stringify(other));
  if (other.kind === 'unknown') assert.equal(other.databaseUnavailable, false);
});

test('the reason carries the original message', () => {
  const result = classifyHandlerError(coded('ECONNREFUSED', 'connect ECONNREFUSED 10.0.0.5:5432'));
  assert.equal(result.kind, 'unknown');
  if (result.kind === 'unknown') assert.match(result.reason, /10\.0\.0\.5:5432/);
});

test('22P02 (invalid text representation, e.g. an id that is not a uuid) -> dead-letter invalid-message', () => {
  const result = classifyHandlerError(coded('22P02', 'invalid input syntax for type uuid: "not-a-uuid"'));
  assert.equal(result.kind, 'dead-letter', JSON.stringify(result));
  if (result.kind !== 'dead-letter') return;
  assert.equal(result.reason, 'invalid-message');
  assert.match(result.detail, /22P02/);
  assert.match(result.detail, /not-a-uuid/);
});

test('other data exceptions (class 22) -> dead-letter invalid-message', () => {
  for (const code of ['22007', '22008', '22003']) {
    const result = classifyHandlerError(coded(code));
    assert.equal(result.kind, 'dead-letter', `${code}: ${JSON.stringify(result)}`);
    if (result.kind === 'dead-letter') assert.equal(result.reason, 'invalid-message');
  }
});

test('statement timeout (57014) -> unknown, database NOT unavailable (counted toward the delivery limit)', () => {
  const result = classifyHandlerError(coded('57014', 'canceling statement due to statement timeout'));
  assert.equal(result.kind, 'unknown', JSON.stringify(result));
  if (result.kind === 'unknown') assert.equal(result.databaseUnavailable, false);
});

test('lock not available, deadlock, serialization failure -> retry from a delay tier (not counted toward the delivery limit)', () => {
  for (const code of ['55P03', '40P01', '40001']) {
    const result = classifyHandlerError(coded(code, `error ${code}`));
    assert.equal(result.kind, 'retry', `${code}: ${JSON.stringify(result)}`);
    if (result.kind !== 'retry') continue;
    assert.ok(result.delayMs > 0, code);
    assert.match(result.reason, new RegExp(code));
  }
});

test('a random Error -> unknown, database NOT unavailable (never acked, never dead-lettered directly)', () => {
  const result = classifyHandlerError(new Error('something odd happened'));
  assert.equal(result.kind, 'unknown', JSON.stringify(result));
  if (result.kind !== 'unknown') return;
  assert.equal(result.databaseUnavailable, false);
  assert.match(result.reason, /something odd happened/);
});

test('an unexpected SQLSTATE (e.g. 42P01 undefined table) -> unknown, database NOT unavailable', () => {
  const result = classifyHandlerError(coded('42P01', 'relation "seat_reservations" does not exist'));
  assert.equal(result.kind, 'unknown');
  if (result.kind === 'unknown') {
    assert.equal(result.databaseUnavailable, false);
    assert.match(result.reason, /42P01/);
  }
});

test('non-Error throwables (string, plain object, numeric code, number) -> unknown', () => {
  for (const thrown of ['plain string', { weird: true }, { code: 8006 }, 42]) {
    const result = classifyHandlerError(thrown);
    assert.equal(result.kind, 'unknown', `${String(thrown)}: ${JSON.stringify(result)}`);
    if (result.kind === 'unknown') assert.equal(result.databaseUnavailable, false);
  }
  const fromString = classifyHandlerError('plain string');
  if (fromString.kind === 'unknown') assert.match(fromString.reason, /plain string/);
});

test('a handler rejecting with undefined or null -> unknown, and classifying it does not throw', () => {
  // The worker calls classifyHandlerError inside its catch; if this throws, onMessage rejects
  // (fire-and-forget: an unhandled rejection) and the worker process dies.
  for (const thrown of [undefined, null]) {
    let result: ReturnType<typeof classifyHandlerError> | undefined;
    assert.doesNotThrow(() => {
      result = classifyHandlerError(thrown);
    }, `classifying ${String(thrown)}`);
    assert.equal(result?.kind, 'unknown');
    if (result?.kind === 'unknown') assert.equal(result.databaseUnavailable, false);
  }
});

test('a pool checkout timeout (every pooled connection busy) -> retry, database NOT unavailable', () => {
  const result = classifyHandlerError(new Error('timeout exceeded when trying to connect'));
  assert.equal(result.kind, 'unknown');
  assert.equal(result.kind === 'unknown' && result.databaseUnavailable, false);
});
