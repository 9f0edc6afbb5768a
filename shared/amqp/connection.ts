import { EventEmitter } from 'node:events';
import amqp from 'amqplib';
import type { ChannelModel } from 'amqplib';
import type { Logger } from 'pino';
import { redactUrl } from '../observability/logger';
import { assertTopology, type Topology } from './topology';

/**
 * One AMQP connection that comes back by itself. After every (re)connect it asserts the topology
 * and calls each `onReady` hook (which opens channels and consumers again). Backoff doubles from
 * 200 ms to 10 s with jitter.
 */
export class ReconnectingConnection extends EventEmitter {
  private model: ChannelModel | null = null;
  private closing = false;
  private attempt = 0;
  private readonly readyHooks: Array<(connection: ChannelModel) => Promise<void>> = [];
  private retryTimer: NodeJS.Timeout | null = null;

  constructor(
    private readonly options: { url: string; connectionName: string; topology: Topology; log: Logger },
  ) {
    super();
  }

  get connected(): boolean {
    return this.model !== null;
  }

  /** Registers a hook run after every successful connect (and at once if connected now). */
  onReady(hook: (connection: ChannelModel) => Promise<void>): void {
    this.readyHooks.push(hook);
  }

  /** Connects, retrying until it works or close() is called. Resolves on the first success. */
  async start(): Promise<void> {
    await new Promise<void>((resolve) => {
      this.once('ready', () => resolve());
      void this.connect();
    });
  }

  private async connect(): Promise<void> {
    this.retryTimer = null;
    if (this.closing) return;
    const log = this.options.log;
    let model: ChannelModel | null = null;
    try {
      model = await amqp.connect(this.options.url, {
        // Batches are several KB: without noDelay, Nagle's algorithm holds each confirm ~40 ms.
        noDelay: true,
        clientProperties: { connection_name: this.options.connectionName },
      });
      model.on('error', (error: Error) => log.warn({ err: error.message }, 'amqp connection error'));
      const setup = await model.createChannel();
      await assertTopology(setup, this.options.topology);
      await setup.close();
      for (const hook of this.readyHooks) await hook(model);
    } catch (error) {
      log.warn({ err: (error as Error).message, url: redactUrl(this.options.url), attempt: this.attempt }, 'amqp connect failed');
      if (model) await model.close().catch(() => undefined); // already broken; nothing more to release
      this.scheduleReconnect();
      return;
    }
    if (this.closing) {
      await model.close().catch(() => undefined);
      return;
    }
    this.model = model;
    this.attempt = 0;
    model.once('close', () => {
      if (this.model !== model) return;
      this.model = null;
      this.emit('lost');
      if (!this.closing) {
        log.warn('amqp connection closed; reconnecting');
        this.scheduleReconnect();
      }
    });
    log.info({ connection: this.options.connectionName }, 'amqp connected');
    this.emit('ready', model);
  }

  private scheduleReconnect(): void {
    if (this.closing || this.retryTimer) return;
    const base = Math.min(10_000, 200 * 2 ** this.attempt);
    this.attempt += 1;
    const delay = base / 2 + Math.random() * (base / 2);
    this.retryTimer = setTimeout(() => void this.connect(), delay);
  }

  /** Resolves when connected (now or later); rejects after `timeoutMs`. */
  waitReady(timeoutMs: number): Promise<ChannelModel> {
    if (this.model) return Promise.resolve(this.model);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.off('ready', onReady);
        reject(new Error(`amqp not connected within ${timeoutMs} ms`));
      }, timeoutMs);
      const onReady = (model: ChannelModel): void => {
        clearTimeout(timer);
        resolve(model);
      };
      this.once('ready', onReady);
    });
  }

  async close(): Promise<void> {
    this.closing = true;
    if (this.retryTimer) clearTimeout(this.retryTimer);
    const model = this.model;
    this.model = null;
    if (model) await model.close().catch(() => undefined); // closing anyway; a dead socket is fine
  }
}
