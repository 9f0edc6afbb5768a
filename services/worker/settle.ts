import type { Channel, ConsumeMessage, Options } from 'amqplib';
import type { Logger } from 'pino';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { FAILURES_HEADER, headersForRepublish } from '../../shared/amqp/headers';
import { DELAY_HEADER, pickDelayTier, type BrokerNames } from '../../shared/amqp/topology';
import type { DeadLetterReason } from '../../shared/contracts/batch';
import type { Metrics } from '../../shared/observability/metrics';
import type { BatchResult } from './results';

export interface SettleDeps {
  publisher: ConfirmingPublisher;
  names: BrokerNames;
  metrics: Metrics;
  deliveryLimit: number;
}

export interface Delivery {
  channel: Channel;
  message: ConsumeMessage;
  /** Policy the batch claims (from the message when it parsed, else the queue's routing key). */
  policy: string;
  deliveryCount: number;
  log: Logger;
}

/** What settle did, for the consumer (pause on database trouble) and for tests' logs. */
export type SettleAction = 'acked' | 'delayed' | 'dead-lettered' | 'requeued';

/**
 * Messages settle already handed to the broker (ack or reject). Acting twice on one delivery tag
 * is a channel error that closes the channel and returns every unacked message on it, so the
 * fallbacks below act only on a message that is not in here.
 */
const settled = new WeakSet<ConsumeMessage>();

/**
 * The one place a batch result becomes broker actions. Every path ends in exactly one of: ack
 * (after commit), publish-then-ack (delay tier or dead-letter, publish confirmed first), or
 * reject-with-requeue (database unreachable). An unexpected failure goes to a delay tier with a
 * growing back-off; the delivery limit counts every failed delivery of the batch. A publish that fails leaves the message unacked.
 *
 * It never throws: the caller runs it from a consumer callback, where a rejected promise would
 * be unhandled and end the process with every batch of the channel in flight. The broker action
 * comes first; metrics and logs come after it and a bug there is logged and nothing else (for a
 * `done` batch the transaction has committed, so the ack must not depend on a counter). A throw
 * before any broker action takes the safe path: a committed (`done`) batch is acked, anything else
 * is rejected with requeue.
 */
export async function settle(deps: SettleDeps, delivery: Delivery, result: BatchResult): Promise<SettleAction> {
  try {
    return await applyResult(deps, delivery, result);
  } catch (error) {
    try {
      delivery.log.error({ err: (error as Error).message, result: result.kind }, 'settle failed (a bug); taking the safe path');
    } catch {
      // The logger itself throws: the safe path below matters more than the report.
    }
    if (settled.has(delivery.message)) return result.kind === 'done' ? 'acked' : 'requeued';
    if (result.kind === 'done') {
      acknowledge(delivery);
      return 'acked';
    }
    rejectWithRequeue(delivery.channel, delivery.message);
    return 'requeued';
  }
}

/**
 * For the consumer's last line of defence (a throw outside settle): rejects with requeue unless
 * settle already acted on the message. True when it rejected.
 */
export function requeueIfUnsettled(channel: Channel, message: ConsumeMessage): boolean {
  if (settled.has(message)) return false;
  rejectWithRequeue(channel, message);
  return true;
}

async function applyResult(deps: SettleDeps, delivery: Delivery, result: BatchResult): Promise<SettleAction> {
  const { metrics } = deps;
  const { policy, log } = delivery;
  switch (result.kind) {
    case 'done': {
      const outcome = result.duplicate ? 'duplicate' : 'done';
      acknowledge(delivery);
      safely(log, 'recording a settled batch', () => {
        metrics.batchesTotal.inc({ policy, outcome });
        metrics.itemsTotal.inc({ policy, outcome: 'deleted' }, result.deleted);
        metrics.itemsTotal.inc({ policy, outcome: 'noop' }, result.noop);
      });
      safely(log, 'logging a settled batch', () => log.info({ outcome, deleted: result.deleted, noop: result.noop, ...result.detail }, 'batch settled'));
      return 'acked';
    }
    case 'retry':
      return toDelayTier(deps, delivery, { delayMs: result.delayMs, reason: result.reason, outcome: 'retry', message: 'batch delayed' });
    case 'dead-letter':
      return deadLetter(deps, delivery, result.reason, result.detail);
    case 'unknown': {
      const failures = failuresBefore(delivery.message) + delivery.deliveryCount;
      if (failures >= deps.deliveryLimit) {
        return deadLetter(deps, delivery, 'delivery-limit', `failed on ${failures} deliveries; last: ${result.reason}`);
      }
      // The database is out: consumption pauses until it answers (deliveries.ts), that is its back-off.
      if (result.databaseUnavailable) return requeue(deps, delivery, result.reason);
      return toDelayTier(deps, delivery, {
        delayMs: unexpectedFailureBackoffMs(failures),
        reason: result.reason,
        outcome: 'unknown',
        message: 'batch outcome unknown; retried after a back-off',
        headers: { [FAILURES_HEADER]: failures },
      });
    }
  }
}

/** Back-off after an unexpected failure: 250 ms, doubling, at most 30 s (20 failures take about 6 minutes). */
export const UNEXPECTED_BACKOFF_FIRST_MS = 250;
export const UNEXPECTED_BACKOFF_MAX_MS = 30_000;

/** The back-off before the next try of a batch whose `failures`-th delivery failed unexpectedly (a delay tier). */
export function unexpectedFailureBackoffMs(failures: number): number {
  return pickDelayTier(Math.min(UNEXPECTED_BACKOFF_FIRST_MS * 2 ** Math.max(0, failures - 1), UNEXPECTED_BACKOFF_MAX_MS));
}

function failuresBefore(message: ConsumeMessage): number {
  const value = Number(message.properties.headers?.[FAILURES_HEADER] ?? 0);
  return Number.isSafeInteger(value) && value > 0 ? value : 0;
}

/**
 * Publish-then-ack to a delay tier: a copy (a new message, same id and body) comes back to the work
 * queue after the tier's delay. The original is acked only once the broker confirmed the copy; a
 * publish that fails leaves it requeued, so nothing is lost.
 */
async function toDelayTier(
  deps: SettleDeps,
  delivery: Delivery,
  delay: { delayMs: number; reason: string; outcome: 'retry' | 'unknown'; message: string; headers?: Record<string, unknown> },
): Promise<SettleAction> {
  const { policy, log } = delivery;
  const tier = pickDelayTier(delay.delayMs);
  try {
    await deps.publisher.publish(deps.names.delayExchange, policy, delivery.message.content, {
      ...copyProperties(delivery.message),
      headers: { ...headersForRepublish(delivery.message.properties.headers), ...delay.headers, [DELAY_HEADER]: String(tier), 'x-reaper-retry-reason': delay.reason },
    });
  } catch (error) {
    return requeue(deps, delivery, `delay publish failed: ${(error as Error).message}`);
  }
  acknowledge(delivery);
  safely(log, 'recording a delayed batch', () => deps.metrics.batchesTotal.inc({ policy: deps.metrics.policyLabel(policy), outcome: delay.outcome }));
  const level = delay.outcome === 'retry' ? 'info' : 'warn';
  safely(log, 'logging a delayed batch', () => log[level]({ delayMs: delay.delayMs, tier, reason: delay.reason, ...delay.headers }, delay.message));
  return 'delayed';
}

async function deadLetter(deps: SettleDeps, delivery: Delivery, reason: DeadLetterReason, detail: string): Promise<SettleAction> {
  const { message, log } = delivery;
  try {
    await deps.publisher.publish('', deps.names.deadLetterQueue, message.content, {
      ...copyProperties(message),
      headers: {
        ...headersForRepublish(message.properties.headers),
        'x-reaper-reason': reason,
        'x-reaper-detail': detail.slice(0, 2000),
        'x-reaper-original-routing-key': message.fields.routingKey,
        'x-reaper-original-exchange': message.fields.exchange,
      },
    });
  } catch (error) {
    return requeue(deps, delivery, `dead-letter publish failed: ${(error as Error).message}`);
  }
  acknowledge(delivery);
  safely(log, 'recording a dead letter', () => {
    // A message may name any policy: only configured names become label values (bounded series).
    const policy = deps.metrics.policyLabel(delivery.policy);
    deps.metrics.deadLetteredTotal.inc({ reason, policy });
    deps.metrics.batchesTotal.inc({ policy, outcome: 'dead-lettered' });
  });
  safely(log, 'logging a dead letter', () => log.warn({ reason, detail }, 'message dead-lettered'));
  return 'dead-lettered';
}

function requeue(deps: SettleDeps, delivery: Delivery, reason: string): SettleAction {
  rejectWithRequeue(delivery.channel, delivery.message);
  safely(delivery.log, 'recording a requeue', () => deps.metrics.batchesTotal.inc({ policy: deps.metrics.policyLabel(delivery.policy), outcome: 'unknown' }));
  safely(delivery.log, 'logging a requeue', () => delivery.log.warn({ reason, deliveryCount: delivery.deliveryCount }, 'batch outcome unknown; requeued'));
  return 'requeued';
}

function rejectWithRequeue(channel: Channel, message: ConsumeMessage): void {
  settled.add(message);
  try {
    // basic.reject, not basic.nack: newer RabbitMQ counts only rejects toward the delivery limit.
    channel.reject(message, true);
  } catch {
    // Channel already closed: the broker requeues every unacked message of a closed channel.
  }
}

function acknowledge(delivery: Delivery): void {
  settled.add(delivery.message);
  try {
    delivery.channel.ack(delivery.message);
  } catch {
    // Channel already closed: the message comes back and its receipt makes it a counted no-op.
    safely(delivery.log, 'logging a failed ack', () => delivery.log.warn('ack failed: channel closed; the broker will redeliver'));
  }
}

/**
 * Runs bookkeeping that comes after the broker action (metrics, logs). A throw there is a bug in
 * that bookkeeping, not in the batch: it is logged (if logging itself works) and swallowed.
 */
function safely(log: Logger, what: string, work: () => void): void {
  try {
    work();
  } catch (error) {
    try {
      log.error({ err: (error as Error).message }, `${what} failed after the broker action; the batch is settled`);
    } catch {
      // The logger itself throws: there is nowhere left to report it, and the batch is settled.
    }
  }
}

/** Properties a republished copy keeps (undefined ones left out). */
function copyProperties(message: ConsumeMessage): Options.Publish {
  const p = message.properties;
  const copy: Options.Publish = {};
  if (p.contentType) copy.contentType = p.contentType as string;
  if (p.contentEncoding) copy.contentEncoding = p.contentEncoding as string;
  if (p.messageId) copy.messageId = p.messageId as string;
  if (p.correlationId) copy.correlationId = p.correlationId as string;
  if (p.timestamp) copy.timestamp = p.timestamp as number;
  return copy;
}

