import type { Channel, ConsumeMessage, Options } from 'amqplib';
import type { Logger } from 'pino';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { headersForRepublish } from '../../shared/amqp/headers';
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
 * The one place a batch result becomes broker actions. Every path ends in exactly one of: ack
 * (after commit), publish-then-ack (delay tier or dead-letter, publish confirmed first), or
 * reject-with-requeue (outcome unknown). A publish that fails leaves the message unacked.
 */
export async function settle(deps: SettleDeps, delivery: Delivery, result: BatchResult): Promise<SettleAction> {
  const { metrics } = deps;
  const { policy, log } = delivery;
  switch (result.kind) {
    case 'done': {
      const outcome = result.duplicate ? 'duplicate' : 'done';
      metrics.batchesTotal.inc({ policy, outcome });
      metrics.itemsTotal.inc({ policy, outcome: 'deleted' }, result.deleted);
      metrics.itemsTotal.inc({ policy, outcome: 'noop' }, result.noop);
      acknowledge(delivery);
      log.info({ outcome, deleted: result.deleted, noop: result.noop, ...result.detail }, 'batch settled');
      return 'acked';
    }
    case 'retry': {
      const tier = pickDelayTier(result.delayMs);
      try {
        await deps.publisher.publish(deps.names.delayExchange, policy, delivery.message.content, {
          ...copyProperties(delivery.message),
          headers: { ...headersForRepublish(delivery.message.properties.headers), [DELAY_HEADER]: String(tier), 'x-reaper-retry-reason': result.reason },
        });
      } catch (error) {
        return requeue(deps, delivery, `delay publish failed: ${(error as Error).message}`);
      }
      metrics.batchesTotal.inc({ policy, outcome: 'retry' });
      acknowledge(delivery);
      log.info({ delayMs: result.delayMs, tier, reason: result.reason }, 'batch delayed');
      return 'delayed';
    }
    case 'dead-letter':
      return deadLetter(deps, delivery, result.reason, result.detail);
    case 'unknown':
      if (delivery.deliveryCount >= deps.deliveryLimit) {
        return deadLetter(deps, delivery, 'delivery-limit', `failed on ${delivery.deliveryCount} deliveries; last: ${result.reason}`);
      }
      return requeue(deps, delivery, result.reason);
  }
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
  // A message may name any policy: only configured names become label values (bounded series).
  const policy = deps.metrics.policyLabel(delivery.policy);
  deps.metrics.deadLetteredTotal.inc({ reason, policy });
  deps.metrics.batchesTotal.inc({ policy, outcome: 'dead-lettered' });
  acknowledge(delivery);
  log.warn({ reason, detail }, 'message dead-lettered');
  return 'dead-lettered';
}

function requeue(deps: SettleDeps, delivery: Delivery, reason: string): SettleAction {
  deps.metrics.batchesTotal.inc({ policy: deps.metrics.policyLabel(delivery.policy), outcome: 'unknown' });
  delivery.log.warn({ reason, deliveryCount: delivery.deliveryCount }, 'batch outcome unknown; requeued');
  try {
    // basic.reject, not basic.nack: newer RabbitMQ counts only rejects toward the delivery limit.
    delivery.channel.reject(delivery.message, true);
  } catch {
    // Channel already closed: the broker requeues every unacked message of a closed channel.
  }
  return 'requeued';
}

function acknowledge(delivery: Delivery): void {
  try {
    delivery.channel.ack(delivery.message);
  } catch {
    // Channel already closed: the message comes back and its receipt makes it a counted no-op.
    delivery.log.warn('ack failed: channel closed; the broker will redeliver');
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

