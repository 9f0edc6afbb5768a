import type * as amqp from 'amqplib';
import type { GetMessage } from 'amqplib';
import { connectBroker } from './connections';
import { FAILURES_HEADER, headersForRepublish } from '../../shared/amqp/headers';
import { ConfirmingPublisher, fixedConnection } from '../../shared/amqp/publisher';
import { brokerNames } from '../../shared/amqp/topology';
import type { DeadLetterReason } from '../../shared/contracts/batch';

/**
 * `reaper dlq list|requeue|purge`. Messages are read with basic.get; whatever a command does not
 * take is returned to the queue unchanged (nack with requeue), so listing never loses anything.
 */

export interface DeadLetterView {
  messageId: string | null;
  reason: DeadLetterReason | string;
  detail: string;
  policy: string | null;
  bytes: number;
  deadLetteredBy: 'worker' | 'broker';
}

/** The broker's own dead-lettering (delivery limit) leaves x-first-death-reason instead of our header. */
function describe(message: GetMessage): DeadLetterView {
  const headers = (message.properties.headers ?? {}) as Record<string, unknown>;
  const ours = typeof headers['x-reaper-reason'] === 'string';
  const brokerReason = String(headers['x-first-death-reason'] ?? 'unknown');
  return {
    messageId: (message.properties.messageId as string | undefined) ?? null,
    reason: ours ? String(headers['x-reaper-reason']) : brokerReason === 'delivery_limit' ? 'delivery-limit' : brokerReason,
    detail: ours ? String(headers['x-reaper-detail'] ?? '') : `dead-lettered by the broker (${brokerReason})`,
    policy: (headers['x-reaper-original-routing-key'] as string | undefined) ?? originalRoutingKey(headers),
    bytes: message.content.length,
    deadLetteredBy: ours ? 'worker' : 'broker',
  };
}

function originalRoutingKey(headers: Record<string, unknown>): string | null {
  const deaths = headers['x-death'];
  if (Array.isArray(deaths) && deaths.length > 0) {
    const keys = (deaths[deaths.length - 1] as { 'routing-keys'?: unknown })['routing-keys'];
    if (Array.isArray(keys) && typeof keys[0] === 'string') return keys[0];
  }
  return null;
}

async function withDeadLetters<T>(
  amqpUrl: string,
  prefix: string,
  work: (tools: {
    queue: string;
    take: (limit: number) => Promise<GetMessage[]>;
    ack: (message: GetMessage) => void;
    channel: amqp.ConfirmChannel;
    connection: amqp.ChannelModel;
  }) => Promise<T>,
): Promise<T> {
  const connection = await connectBroker({ amqpUrl }, { noDelay: true });
  try {
    const channel = await connection.createConfirmChannel();
    const queue = brokerNames(prefix).deadLetterQueue;
    await channel.checkQueue(queue).catch(() => {
      throw new Error(`dead-letter queue ${queue} does not exist (has a reaper service with REAPER_AMQP_PREFIX=${prefix} ever started?)`);
    });
    const taken: GetMessage[] = [];
    const acked = new Set<GetMessage>();
    const take = async (limit: number): Promise<GetMessage[]> => {
      const got: GetMessage[] = [];
      while (got.length < limit) {
        const message = await channel.get(queue, { noAck: false });
        if (message === false) break;
        got.push(message);
      }
      taken.push(...got);
      return got;
    };
    const ack = (message: GetMessage): void => {
      channel.ack(message);
      acked.add(message);
    };
    const result = await work({ queue, take, ack, channel, connection });
    // Give back what was not taken care of explicitly and wait for the broker to have handled it
    // all: closing a channel right after an ack can return the acked message too (seen with
    // quorum queues on RabbitMQ 3.10), and requeue would then send a batch twice.
    for (const message of taken) if (!acked.has(message)) channel.nack(message, false, true);
    await channel.checkQueue(queue);
    return result;
  } finally {
    await connection.close();
  }
}

export function deadLettersList(amqpUrl: string, prefix: string, limit: number): Promise<DeadLetterView[]> {
  return withDeadLetters(amqpUrl, prefix, async ({ take }) => (await take(limit)).map(describe));
}

/** A dead letter that could not be sent back: it stays in the dead-letter queue. */
export interface RequeueFailure {
  messageId: string | null;
  policy: string;
  error: string;
}

export interface RequeueResult {
  requeued: number;
  /** Left in the queue on purpose: another reason than --reason, or no policy to route to. */
  skipped: number;
  /** Left in the queue because the broker did not take it (e.g. its work queue is gone). */
  failed: number;
  failures: RequeueFailure[];
}

/**
 * Publishes dead letters back to the work exchange under their policy's routing key, then acks
 * each. Only messages with `reason` when given. A dead letter is acked only after the broker
 * confirmed AND routed its copy: with `mandatory`, a copy no queue takes (its work queue was
 * deleted, or the policy no longer exists) is returned, and a confirm channel confirms a returned
 * message too, so the confirm alone is not enough. ConfirmingPublisher turns a return, a nack, a
 * closed channel or no confirm into a PublishError; such a dead letter is not acked, stays in the
 * dead-letter queue, and is reported.
 */
export function deadLettersRequeue(
  amqpUrl: string,
  prefix: string,
  options: { limit: number; reason?: string | undefined },
): Promise<RequeueResult> {
  return withDeadLetters(amqpUrl, prefix, async ({ take, ack, connection }) => {
    const names = brokerNames(prefix);
    // Its own confirm channel: a publish that closes it (a missing exchange) must not take the
    // channel holding the dead letters with it. It reopens for the next message.
    const publisher = new ConfirmingPublisher(fixedConnection(connection));
    const result: RequeueResult = { requeued: 0, skipped: 0, failed: 0, failures: [] };
    for (const message of await take(options.limit)) {
      const view = describe(message);
      if ((options.reason && view.reason !== options.reason) || !view.policy) {
        result.skipped += 1;
        continue; // given back (nack, requeue) at the end
      }
      const headers = headersForRepublish(message.properties.headers, ['x-reaper-reason', 'x-reaper-detail', FAILURES_HEADER]);
      const contentType = message.properties.contentType as string | undefined;
      try {
        await publisher.publish(names.workExchange, view.policy, message.content, {
          ...(contentType ? { contentType } : {}),
          ...(view.messageId ? { messageId: view.messageId } : {}),
          headers,
        });
      } catch (error) {
        result.failed += 1;
        result.failures.push({ messageId: view.messageId, policy: view.policy, error: (error as Error).message });
        continue; // not acked: given back at the end, so it stays in the dead-letter queue
      }
      ack(message);
      result.requeued += 1;
    }
    return result;
  });
}

/** The text `reaper dlq requeue` prints (without --json). */
export function describeRequeue(result: RequeueResult): string {
  const lines = [`requeued ${result.requeued}, left ${result.skipped + result.failed} in the dead-letter queue`];
  if (result.failed > 0) {
    lines.push(`${result.failed} could not be requeued and stayed in the dead-letter queue:`);
    for (const failure of result.failures) lines.push(`  ${failure.messageId ?? '(no message id)'} (policy ${failure.policy}): ${failure.error}`);
  }
  return lines.join('\n');
}

export function deadLettersPurge(amqpUrl: string, prefix: string): Promise<number> {
  return withDeadLetters(amqpUrl, prefix, async ({ channel, queue }) => (await channel.purgeQueue(queue)).messageCount);
}
