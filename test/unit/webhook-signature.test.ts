import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { test } from 'node:test';
import { signWebhook, verifyWebhook, WEBHOOK_TOLERANCE_SECONDS } from '../../services/scheduler/webhooks';

/**
 * Issue 7 item 19: the exact string the README documents, so a sender in any language can sign:
 * HMAC-SHA256(secret, "<timestamp>.<METHOD>.<path>.<body>"), hex, as "sha256=<hex>".
 */
const SECRET = 'webhook-secret-for-tests-0123456789';
const body = '{"id":"資産 1"}';

test('the signature is HMAC-SHA256 over "<timestamp>.<METHOD>.<path>.<body>"', () => {
  const expected = createHmac('sha256', SECRET).update('1764446400.POST./webhooks/media-assets.{"id":"資産 1"}').digest('hex');
  assert.equal(signWebhook(SECRET, { timestamp: '1764446400', method: 'POST', path: '/webhooks/media-assets', body }), `sha256=${expected}`);
  assert.equal(signWebhook(SECRET, { timestamp: '1764446400', method: 'post', path: '/webhooks/media-assets', body: Buffer.from(body) }), `sha256=${expected}`, 'method upper-cased; body as bytes');
});

test('verification binds timestamp, method, path and body', () => {
  const now = 1_764_446_400;
  const timestamp = String(now);
  const signature = signWebhook(SECRET, { timestamp, method: 'POST', path: '/webhooks/a', body });
  const request = (overrides: { method?: string; url?: string; timestamp?: string } = {}) => ({
    method: overrides.method ?? 'POST',
    url: overrides.url ?? '/webhooks/a',
    headers: { 'x-reaper-timestamp': overrides.timestamp ?? timestamp, 'x-reaper-signature': signature },
  });
  const verdict = verifyWebhook(SECRET, request(), Buffer.from(body), now);
  assert.equal(verdict.ok, true);
  assert.equal(verdict.ok && verdict.signature, signature.slice('sha256='.length));
  assert.equal(verdict.ok && verdict.timestampSeconds, now);
  for (const [name, changed, changedBody] of [
    ['another path', request({ url: '/webhooks/b' }), body],
    ['another path with a query', request({ url: '/webhooks/a?x=1' }), body],
    ['another method', request({ method: 'PUT' }), body],
    ['another timestamp', request({ timestamp: String(now - 1) }), body],
    ['another body', request(), '{"id":"other"}'],
  ] as const) {
    const refused = verifyWebhook(SECRET, changed, Buffer.from(changedBody), now);
    assert.deepEqual(refused, { ok: false, refusal: 'signature does not match' }, name);
  }
  assert.deepEqual(verifyWebhook(SECRET, request(), Buffer.from(body), now + WEBHOOK_TOLERANCE_SECONDS + 1), { ok: false, refusal: 'timestamp more than 5 minutes off' });
});
