import assert from 'node:assert/strict';
import { test } from 'node:test';
import { parsePolicies, policyVersion } from '../../shared/config/policies';
import { encodeExpiryEvent, expiryEventId, expiryEventMessageId, expiryEventRoutingKey, type ExpiryEventV2 } from '../../shared/contracts/expiry-event';
import type { Db } from '../../shared/db/pool';
import { makeOutboxLimitCheck, OUTBOX_CHECK_TTL_MS } from '../../services/worker/outbox-limit';

const base = `policies:
  - name: seat-holds
    kind: row-delete
    schedule: "* * * * *"
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
`;
const parse = (yaml: string) => parsePolicies(yaml, 'test.yaml', {}).get('seat-holds')!;

test('events: off when absent (the policy version is the same as before the key existed), defaults when on, validated by name', () => {
  const without = parse(base);
  assert.equal(without.events, undefined);
  // The version of a policy without `events` is computed exactly as before: no defaulted key is added.
  assert.equal(policyVersion(without), policyVersion(parse(base)));
  assert.ok(!('events' in without));
  const on = parse(`${base}    events: { enabled: true }\n`);
  assert.deepEqual(on.events, { enabled: true, maxOutbox: 100_000 });
  assert.notEqual(policyVersion(on), policyVersion(without), 'turning events on is a change of the rule');
  assert.throws(() => parse(`${base}    events: { enabled: true, maxOutbox: 0 }\n`), /events\.maxOutbox/);
  assert.throws(() => parse(`${base}    events: { enabeld: true }\n`), /events/);
});

test('the event: message id is the decision and its deletion, routing key <policy>.expired, body versioned', () => {
  const event: ExpiryEventV2 = {
    version: 2,
    eventId: expiryEventId({ policy: 'seat-holds', key: 'a b/%', observedExpiry: '2026-11-29T20:00:00.123456Z' }, '42'),
    policy: 'seat-holds',
    key: 'a b/%',
    observedExpiry: '2026-11-29T20:00:00.123456Z',
    cutoff: null,
    runId: null,
    batchId: null,
    deletedAt: '2026-11-29T20:00:01.000000Z',
    policyVersion: 'abc',
  };
  assert.equal(expiryEventMessageId(event), 'seat-holds:a b/%:2026-11-29T20:00:00.123456Z:42');
  // The same row deleted again (restored, expired again at the same instant): another id.
  assert.notEqual(expiryEventId({ policy: 'seat-holds', key: 'a b/%', observedExpiry: '2026-11-29T20:00:00.123456Z' }, '43'), event.eventId);
  assert.equal(expiryEventRoutingKey('seat-holds'), 'seat-holds.expired');
  assert.deepEqual(JSON.parse(encodeExpiryEvent(event).toString()), event);
});

test('the outbox limit check: reads at most once per TTL, sooner when its own deletions would reach the limit', async () => {
  const policy = parse(`${base}    events: { enabled: true, maxOutbox: 10 }\n`);
  let outbox = 0;
  let reads = 0;
  const countUpTo = async (_db: unknown, _policy: string, cap: number) => {
    reads += 1;
    return Math.min(outbox, cap);
  };
  const db = null as unknown as Db; // never used: the count is the injected function
  let clock = 0;
  const check = makeOutboxLimitCheck(policy, { now: () => clock, countUpTo });
  assert.equal(await check.over(db), false);
  assert.equal(await check.over(db), false);
  assert.equal(reads, 1, 'cached within the TTL');
  outbox = 10;
  check.deleted(10); // this worker's own deletions reach the limit: the next check reads again
  assert.equal(await check.over(db), true);
  assert.equal(reads, 2);
  assert.equal(await check.over(db), true, 'over is never taken from the cache');
  assert.equal(reads, 3);
  outbox = 0;
  clock += OUTBOX_CHECK_TTL_MS;
  assert.equal(await check.over(db), false, 'the relay caught up: deletions resume');
  const off = makeOutboxLimitCheck(parse(base));
  assert.equal(await off.over(db), false, 'a policy without events is never over');
});
