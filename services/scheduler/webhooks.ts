import { createHmac, timingSafeEqual } from 'node:crypto';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { z } from 'zod';
import type { Logger } from 'pino';
import type { PolicySet } from '../../shared/config/policies';
import { withTransaction, type Pool } from '../../shared/db/pool';
import { expiringRowGetIfExpired } from '../../shared/db/queries/expiring-rows';
import type { ResolvedTarget } from '../../shared/db/queries/target';
import { ledgerRecordCandidates } from '../../shared/db/queries/ledger';
import { runsInsertManualUnlessOneWaits } from '../../shared/db/queries/runs';
import { webhookSignaturesDeleteExpired, webhookSignaturesRecordIfNew } from '../../shared/db/queries/webhooks';
import { reply, type RouteHandler } from '../../shared/observability/http';

/**
 * POST /webhooks/<policy>: a remote system says "asset X has expired". The webhook only PROPOSES
 * work: it records the same operation the scan would (same key, from the row's own expiry), and
 * asks for a run unless one is already waiting. It never calls the remote API itself.
 *
 * Signed with HMAC-SHA256 over "<timestamp>.<METHOD>.<path>.<body>" (headers x-reaper-timestamp
 * in Unix seconds, x-reaper-signature: sha256=<hex>), where <path> is the request target exactly as
 * sent on the request line (e.g. "/webhooks/media-assets"): a request signed for one policy does
 * not verify on another policy's path. Refused with 401 when the signature is wrong, the timestamp
 * is more than 5 minutes off, or the signature was already accepted (remembered in PostgreSQL, so
 * every scheduler replica refuses the replay).
 */
export const WEBHOOK_TOLERANCE_SECONDS = 300;
export const WEBHOOK_MAX_BODY_BYTES = 16 * 1024;
/**
 * A used signature is kept until its timestamp is out of the window, plus this margin: the window
 * is judged by each scheduler's clock and the pruning by the database's, which may disagree.
 */
export const WEBHOOK_SIGNATURE_KEEP_MARGIN_SECONDS = 300;

const webhookBody = z.strictObject({ id: z.string().min(1).max(512) });

/** The signed string's parts; the body is taken as bytes, exactly as sent. */
export interface WebhookSigned {
  timestamp: string;
  method: string;
  path: string;
  body: string | Buffer;
}

export function signWebhook(secret: string, request: WebhookSigned): string {
  return `sha256=${createHmac('sha256', secret).update(`${request.timestamp}.${request.method.toUpperCase()}.${request.path}.`).update(request.body).digest('hex')}`;
}

export type WebhookVerdict = { ok: true; signature: string; timestampSeconds: number } | { ok: false; refusal: string };

/** Checks signature and freshness (not yet whether it was used: that needs the database). */
export function verifyWebhook(
  secret: string,
  request: Pick<IncomingMessage, 'headers' | 'method' | 'url'>,
  body: Buffer,
  nowSeconds = Date.now() / 1000,
): WebhookVerdict {
  const timestamp = request.headers['x-reaper-timestamp'];
  const signature = request.headers['x-reaper-signature'];
  if (typeof timestamp !== 'string' || !/^\d{1,12}$/.test(timestamp)) return { ok: false, refusal: 'x-reaper-timestamp missing or not Unix seconds' };
  if (typeof signature !== 'string') return { ok: false, refusal: 'x-reaper-signature missing' };
  if (Math.abs(nowSeconds - Number(timestamp)) > WEBHOOK_TOLERANCE_SECONDS) return { ok: false, refusal: 'timestamp more than 5 minutes off' };
  const expected = Buffer.from(signWebhook(secret, { timestamp, method: request.method ?? '', path: request.url ?? '', body }));
  const given = Buffer.from(signature);
  if (expected.length !== given.length || !timingSafeEqual(expected, given)) return { ok: false, refusal: 'signature does not match' };
  return { ok: true, signature: expected.toString().slice('sha256='.length), timestampSeconds: Number(timestamp) };
}

/** The policy named by the path; '' when the path is not valid percent-encoding (no policy has that name). */
function policyNameOf(url: string): string {
  try {
    return decodeURIComponent(url.split('?')[0]!.slice('/webhooks/'.length));
  } catch {
    return '';
  }
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
    const name = policyNameOf(request.url ?? '');
    if (!deps.secret) return reply(response, 503, { error: 'webhooks are disabled: REAPER_WEBHOOK_SECRET is not set' });
    const verdict = verifyWebhook(deps.secret, request, body);
    if (!verdict.ok) {
      deps.log.warn({ policy: name, refusal: verdict.refusal }, 'webhook refused');
      return reply(response, 401, { error: verdict.refusal });
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
      // Same transaction as the work: a request that took effect is never taken twice, and one
      // that failed (rolled back) may be sent again.
      await webhookSignaturesDeleteExpired(client);
      const fresh = await webhookSignaturesRecordIfNew(client, {
        signature: verdict.signature,
        policy: name,
        timestampSeconds: verdict.timestampSeconds,
        keepSeconds: WEBHOOK_TOLERANCE_SECONDS + WEBHOOK_SIGNATURE_KEEP_MARGIN_SECONDS,
      });
      if (!fresh) return 'replayed' as const;
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
    if (recorded === 'replayed') {
      const refusal = 'signature already used: send a new timestamp and signature';
      deps.log.warn({ policy: name, refusal }, 'webhook refused');
      return reply(response, 401, { error: refusal });
    }
    if (recorded === 'bad-key') return reply(response, 400, { error: `id "${parsed.id}" is not a valid key for ${policy.table}` });
    if (!recorded) return reply(response, 409, { error: `asset "${parsed.id}" is not there, not expired, or its guard does not hold` });
    const run = await runsInsertManualUnlessOneWaits(deps.pool, name);
    if (run) deps.onRunProposed();
    deps.log.info({ policy: name, operationKey: recorded.operationKey, created: recorded.created, runId: run?.runId }, 'webhook recorded an operation');
    reply(response, 202, { operationKey: recorded.operationKey, created: recorded.created, runId: run?.runId ?? null });
  };
  return { '/webhooks/': handle };
}
