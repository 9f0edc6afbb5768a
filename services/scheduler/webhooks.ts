import { createHmac, timingSafeEqual } from 'node:crypto';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { z } from 'zod';
import type { Logger } from 'pino';
import type { PolicySet } from '../../shared/config/policies';
import { withTransaction, type Pool } from '../../shared/db/pool';
import { expiringRowGetIfExpired, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import { ledgerRecordCandidates } from '../../shared/db/queries/ledger';
import { runsInsertManualUnlessOneWaits } from '../../shared/db/queries/runs';
import { reply, type RouteHandler } from '../../shared/observability/http';

/**
 * POST /webhooks/<policy>: a remote system says "asset X has expired". The webhook only PROPOSES
 * work: it records the same operation the scan would (same key, from the row's own expiry), and
 * asks for a run unless one is already waiting. It never calls the remote API itself.
 *
 * Signed with HMAC-SHA256 over "<timestamp>.<body>" (headers x-reaper-timestamp in Unix seconds,
 * x-reaper-signature: sha256=<hex>); refused with 401 when the signature is wrong or the timestamp
 * is more than 5 minutes off.
 */
export const WEBHOOK_TOLERANCE_SECONDS = 300;
export const WEBHOOK_MAX_BODY_BYTES = 16 * 1024;

const webhookBody = z.strictObject({ id: z.string().min(1).max(512) });

export function signWebhook(secret: string, timestamp: string, body: string | Buffer): string {
  return `sha256=${createHmac('sha256', secret).update(`${timestamp}.`).update(body).digest('hex')}`;
}

/** Checks signature and freshness; returns the reason for refusal, or null when valid. */
export function verifyWebhook(secret: string, headers: IncomingMessage['headers'], body: Buffer, nowSeconds = Date.now() / 1000): string | null {
  const timestamp = headers['x-reaper-timestamp'];
  const signature = headers['x-reaper-signature'];
  if (typeof timestamp !== 'string' || !/^\d{1,12}$/.test(timestamp)) return 'x-reaper-timestamp missing or not Unix seconds';
  if (typeof signature !== 'string') return 'x-reaper-signature missing';
  if (Math.abs(nowSeconds - Number(timestamp)) > WEBHOOK_TOLERANCE_SECONDS) return 'timestamp more than 5 minutes off';
  const expected = Buffer.from(signWebhook(secret, timestamp, body));
  const given = Buffer.from(signature);
  if (expected.length !== given.length || !timingSafeEqual(expected, given)) return 'signature does not match';
  return null;
}

export function makeWebhookRoutes(deps: {
  secret: string | undefined;
  pool: Pool;
  policies: PolicySet;
  targets: ReadonlyMap<string, ResolvedTarget>;
  log: Logger;
  onRunProposed: () => void;
}): Record<string, RouteHandler> {
  const handle = async (request: IncomingMessage, body: Buffer, response: ServerResponse): Promise<void> => {
    const name = decodeURIComponent((request.url ?? '').split('?')[0]!.slice('/webhooks/'.length));
    if (!deps.secret) return reply(response, 503, { error: 'webhooks are disabled: REAPER_WEBHOOK_SECRET is not set' });
    const refusal = verifyWebhook(deps.secret, request.headers, body);
    if (refusal) {
      deps.log.warn({ policy: name, refusal }, 'webhook refused');
      return reply(response, 401, { error: refusal });
    }
    const policy = deps.policies.get(name);
    if (!policy) return reply(response, 404, { error: `unknown policy "${name}"` });
    if (policy.kind !== 'remote-delete') return reply(response, 400, { error: `policy "${name}" is ${policy.kind}; webhooks are for remote-delete policies` });
    let parsed: z.infer<typeof webhookBody>;
    try {
      const result = webhookBody.safeParse(JSON.parse(body.toString('utf8')));
      if (!result.success) return reply(response, 400, { error: result.error.issues.map((i) => `${i.path.join('.') || 'body'}: ${i.message}`).join('; ') });
      parsed = result.data;
    } catch {
      return reply(response, 400, { error: 'body is not JSON; expected {"id": "<asset id>"}' });
    }
    const target = deps.targets.get(name)!;
    const recorded = await withTransaction(deps.pool, async (client) => {
      const row = await expiringRowGetIfExpired(client, target, parsed.id);
      if (!row) return null;
      const candidates = await ledgerRecordCandidates(client, target, {
        policy: name,
        runId: null,
        cutoff: row.now,
        items: [{ id: row.id, observedExpiry: row.observedExpiry }],
        source: 'webhook',
      });
      return { operationKey: candidates.known[0]!, created: candidates.inserted === 1 };
    }).catch((error: { code?: string }) => {
      if (typeof error.code === 'string' && error.code.startsWith('22')) return 'bad-key' as const;
      throw error;
    });
    if (recorded === 'bad-key') return reply(response, 400, { error: `id "${parsed.id}" is not a valid key for ${policy.table}` });
    if (!recorded) return reply(response, 409, { error: `asset "${parsed.id}" is not there, not expired, or its guard does not hold` });
    const run = await runsInsertManualUnlessOneWaits(deps.pool, name);
    if (run) deps.onRunProposed();
    deps.log.info({ policy: name, operationKey: recorded.operationKey, created: recorded.created, runId: run?.runId }, 'webhook recorded an operation');
    reply(response, 202, { operationKey: recorded.operationKey, created: recorded.created, runId: run?.runId ?? null });
  };
  return { '/webhooks/': handle };
}
