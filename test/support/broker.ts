import amqp from 'amqplib';
import type { ChannelModel, ConfirmChannel, GetMessage, Options } from 'amqplib';

/** A plain AMQP client for tests: publish what a test crafts, read what landed in a queue. */
export interface TestBroker {
  publish(exchange: string, routingKey: string, content: Buffer | string, options?: Options.Publish): Promise<void>;
  /** Takes (and acks) every message now in the queue. */
  drain(queue: string): Promise<GetMessage[]>;
  messageCount(queue: string): Promise<number>;
  /** Consumers the broker counts on the queue (a quorum queue counts one until it settled or returned what it held). */
  consumerCount(queue: string): Promise<number>;
  close(): Promise<void>;
}

export async function openTestBroker(amqpUrl: string): Promise<TestBroker> {
  const connection: ChannelModel = await amqp.connect(amqpUrl, { noDelay: true });
  const channel: ConfirmChannel = await connection.createConfirmChannel();
  return {
    async publish(exchange, routingKey, content, options = {}) {
      const body = typeof content === 'string' ? Buffer.from(content) : content;
      channel.publish(exchange, routingKey, body, { persistent: true, contentType: 'application/json', ...options });
      await channel.waitForConfirms();
    },
    async drain(queue) {
      const messages: GetMessage[] = [];
      for (;;) {
        const message = await channel.get(queue, { noAck: false });
        if (message === false) return messages;
        messages.push(message);
        channel.ack(message);
      }
    },
    async messageCount(queue) {
      return (await channel.checkQueue(queue)).messageCount;
    },
    async consumerCount(queue) {
      return (await channel.checkQueue(queue)).consumerCount;
    },
    async close() {
      await channel.close().catch(() => undefined); // the connection close below ends it anyway
      await connection.close();
    },
  };
}
