import { randomBytes } from 'node:crypto';
import amqp, { type Channel, type ChannelModel } from 'amqplib';
import { makeTopology, type Topology } from '../../shared/amqp/topology';

/**
 * The benchmark's broker objects: everything lives under a prefix of its own
 * (reaper-bench-<random>), so a run never touches a queue of the demo, the tests or another
 * engineer. Names come from the product's topology (makeTopology), the same data the services
 * assert, so cleanup deletes exactly what they created.
 */
export class BenchBroker {
  readonly prefix = `reaper-bench-${randomBytes(4).toString('hex')}`;
  private readonly policies = new Set<string>();
  private connection: ChannelModel | null = null;

  constructor(private readonly amqpUrl: string) {}

  /**
   * Runs `work` on a channel of its own: a missing queue makes the broker close the channel it was
   * asked on, and that must not break the next call.
   */
  private async withChannel<T>(work: (channel: Channel) => Promise<T>): Promise<T> {
    if (!this.connection) {
      this.connection = await amqp.connect(this.amqpUrl, { noDelay: true });
      this.connection.on('error', () => undefined); // channel-level errors arrive as rejected calls
    }
    const channel = await this.connection.createChannel();
    channel.on('error', () => undefined);
    try {
      return await work(channel);
    } finally {
      await channel.close().catch(() => undefined); // closed by the broker after an error: nothing to close
    }
  }

  private topology(): Topology {
    return makeTopology({ prefix: this.prefix, policies: [...this.policies], deliveryLimit: 20 });
  }

  /**
   * Remembers the policies a phase uses (for cleanup) and empties their queues, so a phase cut
   * short by its time bound leaves nothing for the next one to count.
   */
  async preparePhase(policies: readonly string[]): Promise<void> {
    for (const policy of policies) this.policies.add(policy);
    for (const queue of this.topology().queues) {
      // A queue the services have not declared yet has nothing to purge.
      await this.withChannel((channel) => channel.purgeQueue(queue.name)).catch(() => undefined);
    }
  }

  /** Messages ready in a queue and consumers attached (passive declare). */
  async queueState(queue: string): Promise<{ messages: number; consumers: number }> {
    const state = await this.withChannel((channel) => channel.checkQueue(queue));
    return { messages: state.messageCount, consumers: state.consumerCount };
  }

  /** Deletes every queue and exchange the phases' topology named. */
  async deleteAll(): Promise<void> {
    const topology = this.topology();
    for (const queue of topology.queues) await this.withChannel((channel) => channel.deleteQueue(queue.name)).catch(() => undefined);
    for (const exchange of topology.exchanges) await this.withChannel((channel) => channel.deleteExchange(exchange.name)).catch(() => undefined);
    await this.close();
  }

  async close(): Promise<void> {
    const connection = this.connection;
    this.connection = null;
    if (connection) await connection.close().catch(() => undefined); // already closed by the broker: nothing to release
  }
}
