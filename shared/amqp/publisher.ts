import type { ChannelModel, ConfirmChannel, Options } from 'amqplib';
import { testTimings } from '../config/test-timings';

/** How long a publish waits for the broker's confirm (a test may shorten it: REAPER_TEST_CONFIRM_TIMEOUT_MS). */
export const CONFIRM_TIMEOUT_MS = 10_000;

/**
 * Where the publisher gets its connection: a ReconnectingConnection (services), or one plain
 * connection (`fixedConnection`, for a CLI command that lives for one connection).
 */
export interface ConnectionSource {
  onReady(hook: (model: ChannelModel) => Promise<void>): void;
  waitReady(timeoutMs: number): Promise<ChannelModel>;
}

export function fixedConnection(model: ChannelModel): ConnectionSource {
  return { onReady: () => undefined, waitReady: () => Promise.resolve(model) };
}

/** A publish the broker did not take responsibility for: the caller must not ack what it carries. */
export class PublishError extends Error {
  readonly code = 'PUBLISH_FAILED';
  constructor(message: string) {
    super(message);
    this.name = 'PublishError';
  }
}

/**
 * The broker confirmed the message but routed it to no queue (a `mandatory` return): nothing is
 * bound for its routing key. The relay tells this apart from a broker failure: it waits per
 * routing key, not for everything (services/relay/relay.ts).
 */
export class UnroutableError extends PublishError {}

/**
 * Publishes with publisher confirms and `mandatory`. A publish resolves only when the broker
 * confirmed it AND routed it to a queue; a return (unroutable), a nack, a closed channel or no
 * confirm within `confirmTimeoutMs` rejects with PublishError. The confirm channel is reopened
 * after every reconnect.
 *
 * How a return is matched to its publish: RabbitMQ sends basic.return before the basic.ack of the
 * same message, and a return carries the message's properties but no delivery tag, so returns are
 * correlated by message id. Two publishes in flight with the same id (a duplicate delivery of one
 * batch settled twice at once) could not be told apart, and an ack with `multiple` could then
 * resolve the wrong one; so publishes sharing a message id run one after the other.
 */
export class ConfirmingPublisher {
  private channel: ConfirmChannel | null = null;
  /** Message ids the broker returned as unroutable; checked when their confirm arrives. */
  private readonly returned = new Set<string>();
  private readonly pending = new Set<(error: Error) => void>();
  private sequence = 0;
  private opening: Promise<void> | null = null;
  /** The publish in flight per caller-given message id (see the class comment). */
  private readonly inFlightById = new Map<string, Promise<void>>();

  constructor(
    private readonly connection: ConnectionSource,
    private readonly confirmTimeoutMs = testTimings().confirmTimeoutMs ?? CONFIRM_TIMEOUT_MS,
  ) {
    connection.onReady((model) => this.open(model));
  }

  private async open(model: ChannelModel): Promise<void> {
    const channel = await model.createConfirmChannel();
    channel.on('return', (message: { properties: { messageId?: string } }) => {
      if (message.properties.messageId) this.returned.add(message.properties.messageId);
    });
    channel.on('error', () => undefined); // 'close' follows and fails what is pending
    channel.on('close', () => {
      if (this.channel === channel) this.channel = null;
      for (const fail of this.pending) fail(new PublishError('channel closed before the broker confirmed'));
    });
    this.channel = channel;
  }

  get ready(): boolean {
    return this.channel !== null;
  }

  /**
   * The open confirm channel, reopened on demand: a channel error (e.g. publishing to an exchange
   * an operator deleted) closes only the channel, and the connection's ready hook will not run again.
   */
  private async currentChannel(): Promise<ConfirmChannel> {
    if (this.channel) return this.channel;
    const model = await this.connection.waitReady(this.confirmTimeoutMs).catch((error: Error) => {
      throw new PublishError(error.message);
    });
    if (!this.channel) {
      this.opening ??= this.open(model).finally(() => {
        this.opening = null;
      });
      await this.opening.catch((error: Error) => {
        throw new PublishError(`cannot open a confirm channel: ${error.message}`);
      });
    }
    if (!this.channel) throw new PublishError('no confirm channel');
    return this.channel;
  }

  async publish(exchange: string, routingKey: string, content: Buffer, options: Options.Publish): Promise<void> {
    // Each publish gets its own message id for return correlation unless the caller set one.
    const messageId = options.messageId ?? `reaper-publish-${process.pid}-${++this.sequence}`;
    const before = this.inFlightById.get(messageId);
    const mine = (before ?? Promise.resolve())
      .catch(() => undefined) // the earlier publish's failure is its caller's to handle
      .then(() => this.publishOnce(exchange, routingKey, content, options, messageId));
    this.inFlightById.set(messageId, mine);
    try {
      await mine;
    } finally {
      if (this.inFlightById.get(messageId) === mine) this.inFlightById.delete(messageId);
    }
  }

  private async publishOnce(exchange: string, routingKey: string, content: Buffer, options: Options.Publish, messageId: string): Promise<void> {
    const channel = await this.currentChannel();
    this.returned.delete(messageId); // a stale mark (its confirm never came) must not fail this one
    await new Promise<void>((resolve, reject) => {
      let settled = false;
      const finish = (error: Error | null): void => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        this.pending.delete(fail);
        if (error) reject(error);
        else resolve();
      };
      const fail = (error: Error): void => finish(error);
      const timer = setTimeout(() => finish(new PublishError(`no confirm within ${this.confirmTimeoutMs} ms`)), this.confirmTimeoutMs);
      this.pending.add(fail);
      try {
        channel.publish(exchange, routingKey, content, { ...options, messageId, mandatory: true, persistent: true }, (error) => {
          if (error) return finish(new PublishError(`broker nacked the message (${String(error)})`));
          if (this.returned.delete(messageId)) {
            return finish(new UnroutableError(`unroutable: no queue bound to ${exchange || '(default)'} with key ${routingKey}`));
          }
          finish(null);
        });
      } catch (error) {
        finish(new PublishError((error as Error).message));
      }
    });
  }
}
