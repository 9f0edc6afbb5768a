import { EventEmitter } from 'node:events';
import { amqplib } from '../lazy-modules';
import type { ChannelModel } from 'amqplib';
import type { Logger } from 'pino';
import { redactUrl } from '../observability/logger';
import { assertTopology, type Topology } from './topology';

/**
 * The broker refused our topology because an object of the same name exists with other arguments
 * (406 PRECONDITION_FAILED, e.g. a queue pre-declared with another x-delivery-limit). Retrying can
 * never fix it: the process must stop and say which queue and which argument.
 */
export class TopologyConflictError extends Error {
  readonly code = 'TOPOLOGY_CONFLICT';
  constructor(brokerMessage: string) {
    super(
      `the broker refused reaper's topology: ${brokerMessage}. ` +
        'Align the queue with `reaper topology` (same REAPER_AMQP_PREFIX and REAPER_DELIVERY_LIMIT) or delete it so reaper declares it again',
    );
    this.name = 'TopologyConflictError';
  }
}

/** amqplib puts the AMQP reply code on the error; 406 on a declare is an argument conflict. */
function asTopologyError(error: unknown): unknown {
  const { code, message } = error as { code?: unknown; message?: unknown };
  if (code !== 406 || typeof message !== 'string') return error;
  // "Operation failed: QueueDeclare; 406 (PRECONDITION-FAILED) with message "PRECONDITION_FAILED - ...""
  const quoted = /with message "(.*)"$/s.exec(message);
  return new TopologyConflictError(quoted ? quoted[1]! : message);
}

/**
 * AMQP_URL may name several brokers, comma-separated (the nodes of a RabbitMQ cluster). Each entry
 * is a full URL; surrounding spaces are ignored and empty entries refused.
 */
export function splitAmqpUrls(value: string): string[] {
  const urls = value.split(',').map((url) => url.trim());
  if (urls.some((url) => url === '')) throw new Error('AMQP_URL has an empty entry in its comma-separated list');
  return urls;
}

/**
 * A one-off connection (CLI commands) to the first broker of AMQP_URL's list that answers; the
 * last failure is thrown when none does.
 */
export async function connectAny(value: string, options: Record<string, unknown> = {}): Promise<ChannelModel> {
  let lastError: unknown;
  for (const url of splitAmqpUrls(value)) {
    try {
      return await amqplib().connect(url, options);
    } catch (error) {
      lastError = error;
    }
  }
  throw lastError;
}

/**
 * One AMQP connection that comes back by itself. After every (re)connect it asserts the topology
 * and calls each `onReady` hook (which opens channels and consumers again). Backoff doubles from
 * 200 ms to 10 s with jitter.
 *
 * With several URLs (AMQP_URL="amqp://a,amqp://b,amqp://c") each connect attempt takes the next
 * URL in turn, starting after the one that last worked, so a lost node is left for the next one
 * at once; the backoff only grows once every URL has failed in a row.
 *
 * What retrying cannot fix is not retried: a topology conflict (TopologyConflictError) rejects
 * `start()` before the first connect, and later (at a reconnect or a re-assert) is emitted as
 * 'fatal' to whoever listens; the service exits 1 with that message. Without a 'fatal' listener
 * the connection logs it at error level and keeps retrying, so a service is never left silently
 * disconnected.
 */
export class ReconnectingConnection extends EventEmitter {
  private model: ChannelModel | null = null;
  private closing = false;
  private attempt = 0;
  private readonly readyHooks: Array<(connection: ChannelModel) => Promise<void>> = [];
  private retryTimer: NodeJS.Timeout | null = null;
  private readonly urls: string[];
  /** Index of the URL the next attempt uses. */
  private next = 0;
  /** Attempts failed in a row since the last success (across URLs). */
  private failuresInRow = 0;

  constructor(
    private readonly options: { url: string; connectionName: string; topology: Topology; log: Logger },
  ) {
    super();
    this.urls = splitAmqpUrls(options.url);
  }

  get connected(): boolean {
    return this.model !== null;
  }

  /** Registers a hook run after every successful connect (and at once if connected now). */
  onReady(hook: (connection: ChannelModel) => Promise<void>): void {
    this.readyHooks.push(hook);
  }

  /**
   * Connects, retrying until it works or close() is called. Resolves on the first success; rejects
   * with TopologyConflictError when the broker's queues cannot be reconciled with ours.
   */
  async start(): Promise<void> {
    await new Promise<void>((resolve, reject) => {
      const onReady = (): void => {
        this.off('fatal', onFatal);
        resolve();
      };
      const onFatal = (error: Error): void => {
        this.off('ready', onReady);
        reject(error);
      };
      this.once('ready', onReady);
      this.once('fatal', onFatal);
      void this.connect();
    });
  }

  private async connect(): Promise<void> {
    this.retryTimer = null;
    if (this.closing) return;
    const log = this.options.log;
    let model: ChannelModel | null = null;
    const url = this.urls[this.next % this.urls.length]!;
    try {
      model = await amqplib().connect(url, {
        // Batches are several KB: without noDelay, Nagle's algorithm holds each confirm ~40 ms.
        noDelay: true,
        clientProperties: { connection_name: this.options.connectionName },
      });
      model.on('error', (error: Error) => log.warn({ err: error.message }, 'amqp connection error'));
      await this.assertTopologyOn(model);
      for (const hook of this.readyHooks) await hook(model);
    } catch (error) {
      if (model) await model.close().catch(() => undefined); // already broken; nothing more to release
      const classified = asTopologyError(error);
      if (classified instanceof TopologyConflictError && this.reportFatal(classified)) return;
      log.warn({ err: (error as Error).message, url: redactUrl(url), attempt: this.attempt }, 'amqp connect failed');
      this.next = (this.next + 1) % this.urls.length;
      this.failuresInRow += 1;
      this.scheduleReconnect();
      return;
    }
    if (this.closing) {
      await model.close().catch(() => undefined);
      return;
    }
    this.model = model;
    this.attempt = 0;
    this.failuresInRow = 0;
    model.once('close', () => {
      if (this.model !== model) return;
      this.model = null;
      this.emit('lost');
      if (!this.closing) {
        log.warn('amqp connection closed; reconnecting');
        // The node that just went away is the least likely to answer: try the next one first.
        if (this.urls.length > 1) this.next = (this.next + 1) % this.urls.length;
        this.scheduleReconnect();
      }
    });
    log.info({ connection: this.options.connectionName, ...(this.urls.length > 1 ? { url: redactUrl(url) } : {}) }, 'amqp connected');
    this.emit('ready', model);
  }

  /** Declares the topology on a channel of its own (a refused declare closes that channel only). */
  private async assertTopologyOn(model: ChannelModel): Promise<void> {
    const setup = await model.createChannel();
    // The broker closing the channel also rejects the pending declare, which is what we report.
    setup.on('error', () => undefined);
    try {
      await assertTopology(setup, this.options.topology);
    } catch (error) {
      throw asTopologyError(error);
    }
    await setup.close();
  }

  /**
   * Declares the topology again on the live connection: after the broker cancelled a consumer
   * (its queue was deleted) the queue must exist before consuming from it again. Rejects with
   * TopologyConflictError (also reported as 'fatal') or with the broker's error.
   */
  async reassertTopology(): Promise<void> {
    const model = this.model;
    if (!model) throw new Error('amqp not connected');
    try {
      await this.assertTopologyOn(model);
    } catch (error) {
      if (error instanceof TopologyConflictError) this.reportFatal(error);
      throw error;
    }
  }

  /** True when a 'fatal' listener took it (the connection is then closed for good). */
  private reportFatal(error: TopologyConflictError): boolean {
    if (this.listenerCount('fatal') === 0) {
      this.options.log.error({ err: error.message }, 'amqp topology conflict; retrying, but this needs an operator');
      return false;
    }
    this.options.log.error({ err: error.message }, 'amqp topology conflict: giving up');
    void this.close();
    this.emit('fatal', error);
    return true;
  }

  private scheduleReconnect(): void {
    if (this.closing || this.retryTimer) return;
    // Another URL of the list is still untried in this round: go to it after the shortest wait.
    if (this.urls.length > 1 && this.failuresInRow > 0 && this.failuresInRow % this.urls.length !== 0) {
      this.retryTimer = setTimeout(() => void this.connect(), 50);
      return;
    }
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
