import amqp from 'amqplib';
import type { Channel, ChannelModel, ConfirmChannel, GetMessage, Options } from 'amqplib';
import { managementApi } from './broker-admin';
import { rabbitmqctl } from './rabbitmqctl';

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

/** Takes (and acks) every message now in the queue, on the caller's channel (one that may read an exclusive queue). */
export async function drainQueue(channel: Channel, queue: string): Promise<GetMessage[]> {
  const messages: GetMessage[] = [];
  for (;;) {
    const message = await channel.get(queue, { noAck: false });
    if (message === false) return messages;
    messages.push(message);
    channel.ack(message);
  }
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
    drain: (queue) => drainQueue(channel, queue),
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

export interface BrokerObjects {
  queues: string[];
  exchanges: string[];
}

/**
 * Every queue and exchange on the broker's virtual host, by name, so clean-up can delete all that
 * a test made under its prefix (not only what reaper's topology declares: a test's own probe
 * queues too). AMQP cannot list: the management HTTP API when it answers, else `rabbitmqctl` for a
 * broker on this machine; undefined when neither can (a remote broker without the management
 * plugin), and the caller deletes the names it knows.
 */
export async function listBrokerObjects(amqpUrl: string): Promise<BrokerObjects | undefined> {
  return (await listOverHttp(amqpUrl)) ?? (await listWithRabbitmqctl(amqpUrl));
}

async function listOverHttp(amqpUrl: string): Promise<BrokerObjects | undefined> {
  const api = await managementApi(amqpUrl);
  if (!api) return undefined; // no management plugin there: the next way
  const vhost = encodeURIComponent(decodeURIComponent(new URL(amqpUrl).pathname.slice(1)) || '/');
  const names = async (kind: 'queues' | 'exchanges') => ((await api.request('GET', `${kind}/${vhost}?columns=name`, { timeoutMs: 3_000 })) as Array<{ name: string }>).map((entry) => entry.name);
  try {
    return { queues: await names('queues'), exchanges: await names('exchanges') };
  } catch {
    return undefined; // the API stopped answering (or refuses this vhost): the next way
  }
}

async function listWithRabbitmqctl(amqpUrl: string): Promise<BrokerObjects | undefined> {
  const url = new URL(amqpUrl);
  if (!['127.0.0.1', 'localhost', '::1', '[::1]'].includes(url.hostname)) return undefined; // rabbitmqctl speaks to this machine's node only
  const vhost = decodeURIComponent(url.pathname.slice(1)) || '/';
  const names = (output: string) => output.split('\n').map((line) => line.trim()).filter(Boolean);
  try {
    const [queues, exchanges] = await Promise.all([
      rabbitmqctl(['-q', '--no-table-headers', 'list_queues', '-p', vhost, 'name'], 30_000),
      rabbitmqctl(['-q', '--no-table-headers', 'list_exchanges', '-p', vhost, 'name'], 30_000),
    ]);
    return { queues: names(queues), exchanges: names(exchanges) };
  } catch {
    return undefined; // no rabbitmqctl (or not allowed to use it)
  }
}

/** The listed names that belong to one of `prefixes` (reaper names everything `<prefix>.<...>`). */
export function namesUnder(objects: BrokerObjects, prefixes: readonly string[]): BrokerObjects {
  const under = (name: string) => prefixes.some((prefix) => name.startsWith(`${prefix}.`));
  return { queues: objects.queues.filter(under), exchanges: objects.exchanges.filter(under) };
}

/** Deletes these queues and exchanges over AMQP (a name that is already gone is not an error in RabbitMQ). */
export async function deleteBrokerNames(amqpUrl: string, objects: BrokerObjects): Promise<void> {
  if (objects.queues.length === 0 && objects.exchanges.length === 0) return;
  const connection = await amqp.connect(amqpUrl, { timeout: 5_000 });
  try {
    const channel = await connection.createChannel();
    for (const queue of objects.queues) await channel.deleteQueue(queue);
    for (const exchange of objects.exchanges) await channel.deleteExchange(exchange);
    await channel.close();
  } finally {
    await connection.close().catch(() => undefined); // already closed by the broker: nothing left to release
  }
}

/**
 * What the broker answers when `work` runs on a fresh channel of a connection to `amqpUrl`: 'ok',
 * 'ACCESS_REFUSED' (the channel closes with it), or the broker's other message. For the
 * least-privilege tests, which log in as each reaper user and try what it may and may not do.
 */
export async function brokerAnswerAt(amqpUrl: string, work: (channel: amqp.Channel) => Promise<unknown>): Promise<string> {
  const connection = await amqp.connect(amqpUrl);
  try {
    const channel = await connection.createChannel();
    channel.on('error', () => undefined); // the refusal is the answer; it is returned below
    try {
      await work(channel);
      await channel.close();
      return 'ok';
    } catch (error) {
      const message = String((error as Error).message);
      return message.includes('ACCESS_REFUSED') ? 'ACCESS_REFUSED' : message;
    }
  } finally {
    await connection.close().catch(() => undefined);
  }
}
