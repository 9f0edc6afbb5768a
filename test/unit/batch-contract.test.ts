/**
 * Unit tests for the batch message contract (shared/contracts/batch.ts): encode/decode round trip,
 * and exactly one rejection reason per bad message, checked in the documented order.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import {
  FLEET_BATCH_VERSION,
  NEWEST_BATCH_VERSION,
  MAX_BATCH_ITEMS,
  MAX_MESSAGE_BYTES,
  batchBytesAtMost,
  decodeBatch,
  encodeBatch,
  makeBatchId,
  type BatchV1,
  type DeadLetterReason,
} from '../../shared/contracts/batch';

const RUN_ID = '0f8e2c1e-7d7b-4c36-9b53-1d5a9e0b9d11';

/** The docs/design.md example, with a full id. */
function validBatch(overrides: Record<string, unknown> = {}): BatchV1 {
  return {
    version: 1,
    runId: RUN_ID,
    batchId: `${RUN_ID}:000042`,
    policy: 'seat-holds',
    cutoff: '2026-11-29T20:00:00.000000Z',
    items: [{ id: '6d1f7a52-3c1e-4f00-9a7e-1b2c3d4e5f60', observedExpiry: '2026-11-29T19:58:12.345678Z' }],
    ...overrides,
  } as BatchV1;
}

function items(count: number): BatchV1['items'] {
  return Array.from({ length: count }, (_, index) => ({
    id: `id-${index}`,
    observedExpiry: '2026-11-29T19:58:12.345678Z',
  }));
}

function decodeJson(document: unknown) {
  return decodeBatch(Buffer.from(JSON.stringify(document), 'utf8'));
}

function assertRejected(result: ReturnType<typeof decodeBatch>, reason: DeadLetterReason, detail?: RegExp): void {
  assert.equal(result.ok, false, `expected a rejection (${reason}), got ${JSON.stringify(result)}`);
  if (result.ok) return;
  assert.equal(result.reason, reason, `detail: ${result.detail}`);
  assert.ok(result.detail.length > 0, 'every rejection carries a human-readable detail');
  if (detail) assert.match(result.detail, detail);
}

// ---------------------------------------------------------------------------------------------
// Valid messages
// ---------------------------------------------------------------------------------------------

test('a valid v1 message (the docs/design.md example) decodes', () => {
  const text = `{
    "version": 1,
    "runId": "0f8e2c1e-7d7b-4c36-9b53-1d5a9e0b9d11",
    "batchId": "0f8e2c1e-7d7b-4c36-9b53-1d5a9e0b9d11:000042",
    "policy": "seat-holds",
    "cutoff": "2026-11-29T20:00:00.000000Z",
    "items": [
      { "id": "6d1f", "observedExpiry": "2026-11-29T19:58:12.345678Z" }
    ]
  }`;
  const result = decodeBatch(Buffer.from(text, 'utf8'));
  assert.ok(result.ok, JSON.stringify(result));
  assert.equal(result.batch.version, 1);
  assert.equal(result.batch.runId, RUN_ID);
  assert.equal(result.batch.batchId, `${RUN_ID}:000042`);
  assert.equal(result.batch.policy, 'seat-holds');
  assert.equal(result.batch.cutoff, '2026-11-29T20:00:00.000000Z');
  assert.deepEqual(result.batch.items, [{ id: '6d1f', observedExpiry: '2026-11-29T19:58:12.345678Z' }]);
});

test('encode then decode is the identity, microseconds included', () => {
  const batch = validBatch({ items: [...items(3), { id: '42', observedExpiry: '2026-11-29T19:58:12.000001Z' }] });
  const encoded = encodeBatch(batch);
  assert.ok(Buffer.isBuffer(encoded));
  const result = decodeBatch(encoded);
  assert.ok(result.ok, JSON.stringify(result));
  assert.deepEqual(result.batch, batch);
  assert.equal(result.batch.items[3]!.observedExpiry, '2026-11-29T19:58:12.000001Z');
});

test('encodeBatch writes UTF-8 JSON and non-ASCII ids survive the trip', () => {
  const batch = validBatch({ items: [{ id: 'média/é✓', observedExpiry: '2026-11-29T19:58:12.345678Z' }] });
  const encoded = encodeBatch(batch);
  assert.deepEqual(JSON.parse(encoded.toString('utf8')), batch);
  const result = decodeBatch(encoded);
  assert.ok(result.ok);
  assert.equal(result.batch.items[0]!.id, 'média/é✓');
});

test('exactly MAX_BATCH_ITEMS (1000) items is accepted', () => {
  assert.equal(MAX_BATCH_ITEMS, 1000);
  const result = decodeBatch(encodeBatch(validBatch({ items: items(1000) })));
  assert.ok(result.ok, JSON.stringify(result).slice(0, 300));
  assert.equal(result.batch.items.length, 1000);
});

test('makeBatchId is the run id plus a zero-padded six-digit sequence, deterministic', () => {
  assert.equal(makeBatchId(RUN_ID, 42), `${RUN_ID}:000042`);
  assert.equal(makeBatchId(RUN_ID, 1), `${RUN_ID}:000001`);
  assert.equal(makeBatchId(RUN_ID, 999999), `${RUN_ID}:999999`);
  assert.equal(makeBatchId(RUN_ID, 42), makeBatchId(RUN_ID, 42));
  assert.notEqual(makeBatchId(RUN_ID, 1), makeBatchId(RUN_ID, 2));
  // Sequences sort as strings in publish order (within six digits).
  assert.ok(makeBatchId(RUN_ID, 9) < makeBatchId(RUN_ID, 10));
  const decoded = decodeBatch(encodeBatch(validBatch({ batchId: makeBatchId(RUN_ID, 7) })));
  assert.ok(decoded.ok);
});

// ---------------------------------------------------------------------------------------------
// Rejections, in order: size, JSON, envelope, version, schema
// ---------------------------------------------------------------------------------------------

test('too-large: more than 1 MiB is refused before anything else, even when it is not JSON', () => {
  assert.equal(MAX_MESSAGE_BYTES, 1024 * 1024);
  assertRejected(decodeBatch(Buffer.alloc(MAX_MESSAGE_BYTES + 1, 'x')), 'too-large', /1048577/);
});

test('too-large: a 1 MiB + 1 byte message that would otherwise be valid JSON is still too-large', () => {
  const padding = ' '.repeat(MAX_MESSAGE_BYTES + 1 - encodeBatch(validBatch()).length);
  const content = Buffer.concat([encodeBatch(validBatch()), Buffer.from(padding)]);
  assert.equal(content.length, MAX_MESSAGE_BYTES + 1);
  assertRejected(decodeBatch(content), 'too-large');
});

test('exactly 1 MiB is not too-large', () => {
  const base = encodeBatch(validBatch());
  const content = Buffer.concat([base, Buffer.from(' '.repeat(MAX_MESSAGE_BYTES - base.length))]);
  assert.equal(content.length, MAX_MESSAGE_BYTES);
  const result = decodeBatch(content);
  assert.ok(result.ok, JSON.stringify(result));
});

test('invalid-json: not JSON, truncated JSON, empty body', () => {
  assertRejected(decodeBatch(Buffer.from('{not json', 'utf8')), 'invalid-json');
  assertRejected(decodeBatch(encodeBatch(validBatch()).subarray(0, 40)), 'invalid-json');
  assertRejected(decodeBatch(Buffer.alloc(0)), 'invalid-json');
});

test('invalid-message: a JSON value that is not an object', () => {
  for (const text of ['[]', '[{"version":1}]', 'null', '1', '"batch"', 'true']) {
    assertRejected(decodeBatch(Buffer.from(text, 'utf8')), 'invalid-message', /object/);
  }
});

test('invalid-message: a missing or non-integer version', () => {
  const { version: _version, ...withoutVersion } = validBatch();
  assertRejected(decodeJson(withoutVersion), 'invalid-message', /version/);
  assertRejected(decodeJson(validBatch({ version: '1' })), 'invalid-message', /version/);
  assertRejected(decodeJson(validBatch({ version: 1.5 })), 'invalid-message', /version/);
  assertRejected(decodeJson(validBatch({ version: 0 })), 'invalid-message', /version/);
  assertRejected(decodeJson(validBatch({ version: null })), 'invalid-message', /version/);
});

test('invalid-message: an unknown field, at the top level or in an item', () => {
  assertRejected(decodeJson({ ...validBatch(), priority: 'high' }), 'invalid-message', /priority/);
  assertRejected(
    decodeJson(validBatch({ items: [{ id: 'a', observedExpiry: '2026-11-29T19:58:12.345678Z', status: 'held' }] })),
    'invalid-message',
    /items\.0.*status/,
  );
});

test('invalid-message: a timestamp without six fractional digits', () => {
  for (const cutoff of [
    '2026-11-29T20:00:00.000Z', // milliseconds only: what Date#toISOString() gives
    '2026-11-29T20:00:00Z',
    '2026-11-29T20:00:00.0000000Z',
    '2026-11-29T20:00:00.000000+00:00',
    '2026-11-29 20:00:00.000000Z',
  ]) {
    assertRejected(decodeJson(validBatch({ cutoff })), 'invalid-message', /cutoff/);
  }
  assertRejected(
    decodeJson(validBatch({ items: [{ id: 'a', observedExpiry: '2026-11-29T19:58:12.345Z' }] })),
    'invalid-message',
    /items\.0\.observedExpiry/,
  );
});

test('invalid-message: a timestamp with six digits but an impossible date or time', () => {
  // Month 13 / day 45 / hour 25 match the digit pattern but are not instants. Let through, the
  // worker hands them to PostgreSQL and only finds out there.
  assertRejected(decodeJson(validBatch({ cutoff: '2026-13-45T20:00:00.000000Z' })), 'invalid-message', /cutoff/);
  assertRejected(
    decodeJson(validBatch({ items: [{ id: 'a', observedExpiry: '2026-11-29T25:61:00.000000Z' }] })),
    'invalid-message',
    /observedExpiry/,
  );
});

test('invalid-message: 0 items', () => {
  assertRejected(decodeJson(validBatch({ items: [] })), 'invalid-message', /items/);
});

test('invalid-message: 1001 items', () => {
  assertRejected(decodeJson(validBatch({ items: items(1001) })), 'invalid-message', /items/);
});

test('item 18: invalid-message: the same id twice in one batch, the detail naming the id (same or another expiry)', () => {
  const twice = [...items(3), { id: 'id-1', observedExpiry: '2026-11-29T19:58:12.345678Z' }];
  assertRejected(decodeJson(validBatch({ items: twice })), 'invalid-message', /"id-1" appears more than once/);
  const otherExpiry = [{ id: 'a/€', observedExpiry: '2026-11-29T19:58:12.345678Z' }, { id: 'a/€', observedExpiry: '2026-11-29T19:58:13.000001Z' }];
  assertRejected(decodeJson(validBatch({ items: otherExpiry })), 'invalid-message', /items\.1\.id: "a\/€" appears more than once \(also items\.0\)/);
  // Ids that only look alike are different ids.
  const alike = [
    { id: 'A', observedExpiry: '2026-11-29T19:58:12.345678Z' },
    { id: 'a', observedExpiry: '2026-11-29T19:58:12.345678Z' },
    { id: 'a ', observedExpiry: '2026-11-29T19:58:12.345678Z' },
  ];
  assert.equal(decodeJson(validBatch({ items: alike })).ok, true);
});

test('invalid-message: other field errors (runId not a uuid, empty id, numeric id, bad policy name)', () => {
  assertRejected(decodeJson(validBatch({ runId: 'run-1' })), 'invalid-message', /runId/);
  assertRejected(decodeJson(validBatch({ items: [{ id: '', observedExpiry: '2026-11-29T19:58:12.345678Z' }] })), 'invalid-message', /id/);
  assertRejected(decodeJson(validBatch({ items: [{ id: 42, observedExpiry: '2026-11-29T19:58:12.345678Z' }] })), 'invalid-message', /id/);
  assertRejected(decodeJson(validBatch({ policy: 'Seat Holds' })), 'invalid-message', /policy/);
});

test('unsupported-version: a version newer than the consumer accepts, even with fields it does not know', () => {
  assert.equal(NEWEST_BATCH_VERSION, 2);
  assertRejected(decodeJson(validBatch({ version: 3 })), 'unsupported-version', /3/);
  assertRejected(decodeJson({ ...validBatch({ version: 3 }), priority: 'high', items: [] }), 'unsupported-version');
  // A worker capped at 1 (the previous release) refuses a valid version-2 batch, and says which it accepts.
  const v2 = encodeBatch({ ...validBatch(), version: 2, policyVersion: '0123456789abcdef' });
  assertRejected(decodeBatch(v2, { highestVersion: 1 }), 'unsupported-version', /version 2 is newer than this worker understands \(1\)/);
});

test('version 2 decodes to the version-1 body with its policyVersion beside it; version 1 is unchanged', () => {
  const body = validBatch();
  const v2 = decodeBatch(encodeBatch({ ...body, version: 2, policyVersion: '0123456789abcdef' }));
  assert.deepEqual(v2, { ok: true, batch: body, version: 2, policyVersion: '0123456789abcdef' });
  const v1 = decodeBatch(encodeBatch(body));
  assert.deepEqual(v1, { ok: true, batch: body, version: 1, policyVersion: null });
  // Version 1 is encoded exactly as before version 2 existed: no new field, same key order.
  assert.equal(encodeBatch(body).toString('utf8'), JSON.stringify(body));
  assert.equal(FLEET_BATCH_VERSION, 1, 'schedulers publish version 1 unless told otherwise: the previous release accepts only 1');
});

test('version 2: policyVersion is required, has the hash form, and v1 refuses it as an unknown field', () => {
  assertRejected(decodeJson({ ...validBatch(), version: 2 }), 'invalid-message', /policyVersion/);
  assertRejected(decodeJson({ ...validBatch(), version: 2, policyVersion: 'not-a-hash' }), 'invalid-message', /policyVersion/);
  assertRejected(decodeJson({ ...validBatch(), policyVersion: '0123456789abcdef' }), 'invalid-message', /policyVersion/);
});

test('the order of checks: each message gets exactly the first failing reason', () => {
  // JSON before envelope: an unparseable array is invalid-json, not invalid-message.
  assertRejected(decodeBatch(Buffer.from('[1,', 'utf8')), 'invalid-json');
  // Envelope before version: a non-object is invalid-message whatever it contains.
  assertRejected(decodeBatch(Buffer.from('[{"version":2}]', 'utf8')), 'invalid-message');
  // Version before schema: v3 with a schema error is unsupported-version.
  assertRejected(decodeJson({ version: 3, items: [] }), 'unsupported-version');
  // Version check before schema: v1 with the same schema error is invalid-message.
  assertRejected(decodeJson({ version: 1, items: [] }), 'invalid-message');
});

test('batchBytesAtMost is never under the encoded size, whatever the ids hold (escapes, astral characters) and the batch id', () => {
  fc.assert(
    fc.property(
      fc.array(fc.record({ id: fc.oneof(fc.string({ unit: 'binary', minLength: 1, maxLength: 40 }), fc.string({ unit: fc.constantFrom('\u0001', '\u001f', '"', '\\', '界'), minLength: 1, maxLength: 40 })), observedExpiry: fc.oneof(fc.constant('2026-11-29T19:58:12.345678Z'), fc.string({ unit: 'binary', maxLength: 40 })) }), { minLength: 1, maxLength: 50 }),
      fc.stringMatching(/^[a-z0-9-]{1,80}$/),
      fc.constantFrom(1, 2),
      (items, policy, version) => {
        const longestId = `${RUN_ID}:${'9'.repeat(163)}`; // 200 characters, the contract's longest
        const batch = { ...validBatch({ items, policy, batchId: longestId }), ...(version === 2 ? { version: 2, policyVersion: '0123456789abcdef' } : {}) };
        const encoded = Buffer.byteLength(JSON.stringify(batch), 'utf8');
        assert.ok(batchBytesAtMost(policy, items) >= encoded, `${batchBytesAtMost(policy, items)} < ${encoded}`);
      },
    ),
    { numRuns: 2000 },
  );
});
