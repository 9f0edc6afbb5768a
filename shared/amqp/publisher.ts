import type { ChannelModel, ConfirmChannel, Options } from 'amqplib';
import type { ReconnectingConnection } from './connection';

/** A publish the broker did not take responsibility for: the caller must not ack what it carries. */
export class PublishError extends Error {
  readonly code = 'PUBLISH_FAILED';
  constructor(message: string) {
    super(message);
    this.name = 'PublishError';
  }
}

/**
 * Publishes with publisher confirms and `mandatory`. A publish resolves only when the broker
 * confirmed it AND routed it to a queue; a return (unroutable), a nack, a closed channel or no
 * confirm within `confirmTimeoutMs` rejects with PublishError. The confirm channel is reopened
 * after every reconnect.
 */
export class ConfirmingPublisher {
  private channel: ConfirmChannel | null = null;
  /** Message ids the broker returned as unroutable; checked when their confirm arrives. */
  private readonly returned = new Set<string>();
  private readonly pending = new Set<(error: Error) => void>();
  private sequence = 0;
  private opening: Promise<void> | null = null;

  constructor(
    private readonly connection: ReconnectingConnection,
    private readonly confirmTimeoutMs = 10_000,
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
    const channel = await this.currentChannel();
    // Each publish gets its own message id for return correlation unless the caller set one.
    const messageId = options.messageId ?? `reaper-publish-${process.pid}-${++this.sequence}`;
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
            return finish(new PublishError(`unroutable: no queue bound to ${exchange || '(default)'} with key ${routingKey}`));
          }
          finish(null);
        });
      } catch (error) {
        finish(new PublishError((error as Error).message));
      }
    });
  }
}
