import { createServer, connect, type AddressInfo, type Server, type Socket } from 'node:net';

/**
 * A TCP proxy for network faults (toxiproxy and netem are not available here): a service is
 * pointed at the proxy's port instead of the server's, and the test then resets, stalls or slows
 * its connections. Only Node's `net`.
 *
 * - `resetAll()`: every open connection is reset (RST both ways) at once.
 * - `stallAll()`: every open connection stops moving bytes in both directions while both sockets
 *   stay open (what a hung middlebox or a frozen NAT entry does). New connections pass. `heal()`
 *   closes the stalled ones, as the dead path eventually would.
 * - `refusing`: while true, every new connection is reset as soon as it arrives (a server that is
 *   down), so a test can change the server's state while the client cannot see it.
 * - `latencyMs`: every chunk, in both directions, is delivered that much later (order kept).
 * - PostgreSQL links (`protocol: 'postgres'`) are also read, without changing a byte: the backend
 *   pid of each connection (BackendKeyData) is recorded, and `holdRepliesAfter(pattern)` stops the
 *   server's answers on the first connection that sends a statement matching `pattern`, after the
 *   statement itself went through: the statement runs and commits, its answer never arrives.
 */
export interface ProxyLink {
  readonly id: number;
  readonly client: Socket;
  readonly upstream: Socket;
  /** PostgreSQL backend pid, once the server sent it. */
  backendPid: number | null;
  stalled: boolean;
  /** Server answers held back (never delivered unless released). */
  holdingReplies: boolean;
  bytesUp: number;
  bytesDown: number;
}

export interface ProxyOptions {
  targetHost: string;
  targetPort: number;
  protocol?: 'postgres' | 'raw';
}

export class TcpProxy {
  readonly links = new Set<ProxyLink>();
  latencyMs = 0;
  /** While true, new connections are reset on arrival. */
  refusing = false;
  /** Bytes sent by clients through the proxy since it started (all links). */
  bytesUp = 0;
  private nextId = 1;
  private holdWaiters: Array<{ pattern: RegExp; resolve: (link: ProxyLink) => void }> = [];

  private constructor(
    private readonly server: Server,
    private readonly options: ProxyOptions,
  ) {}

  static async start(options: ProxyOptions): Promise<TcpProxy> {
    const server = createServer();
    const proxy = new TcpProxy(server, options);
    server.on('connection', (client) => proxy.accept(client));
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(0, '127.0.0.1', () => resolve());
    });
    return proxy;
  }

  get port(): number {
    return (this.server.address() as AddressInfo).port;
  }

  /** `url` with its host and port replaced by the proxy's. */
  urlFor(url: string): string {
    const parsed = new URL(url);
    parsed.hostname = '127.0.0.1';
    parsed.port = String(this.port);
    return parsed.toString();
  }

  private accept(client: Socket): void {
    if (this.refusing) {
      client.on('error', () => undefined);
      client.resetAndDestroy();
      return;
    }
    client.setNoDelay(true);
    const upstream = connect({ host: this.options.targetHost, port: this.options.targetPort });
    upstream.setNoDelay(true);
    const link: ProxyLink = { id: this.nextId++, client, upstream, backendPid: null, stalled: false, holdingReplies: false, bytesUp: 0, bytesDown: 0 };
    this.links.add(link);
    const postgres = this.options.protocol === 'postgres';
    const fromClient = postgres ? new PgMessageReader(true) : null;
    const fromServer = postgres ? new PgMessageReader(false) : null;
    // One queue per direction, drained by one timer: latency never reorders bytes (a timer per
    // chunk can: chunks due in the same millisecond may fire in either order).
    const up = new DelayedPipe(upstream, () => link.stalled, () => this.latencyMs);
    const down = new DelayedPipe(client, () => link.stalled, () => this.latencyMs);
    client.on('data', (chunk: Buffer) => {
      if (link.stalled) return;
      link.bytesUp += chunk.length;
      this.bytesUp += chunk.length;
      let holdAfter = false;
      if (fromClient) {
        for (const message of fromClient.push(chunk)) {
          // Parse and simple Query carry the text; Bind carries the statement's name (a named
          // statement sends its text only at its first execution on a connection).
          if (message.type !== 'P' && message.type !== 'Q' && message.type !== 'B') continue;
          const text = queryText(message);
          const waiter = this.holdWaiters.find((w) => w.pattern.test(text));
          if (waiter) {
            this.holdWaiters = this.holdWaiters.filter((w) => w !== waiter);
            holdAfter = true;
            waiter.resolve(link);
          }
        }
      }
      up.push(chunk);
      // Set after the statement was handed on: every answer from now on is held back.
      if (holdAfter) link.holdingReplies = true;
    });
    upstream.on('data', (chunk: Buffer) => {
      if (link.stalled) return;
      link.bytesDown += chunk.length;
      if (fromServer) {
        for (const message of fromServer.push(chunk)) {
          if (message.type === 'K' && message.body.length >= 4) link.backendPid = message.body.readInt32BE(0);
        }
      }
      if (link.holdingReplies) return;
      down.push(chunk);
    });
    const end = () => {
      this.links.delete(link);
      if (link.stalled) return; // a stalled path says nothing: the other side keeps waiting
      client.destroy();
      upstream.destroy();
    };
    client.on('close', end);
    upstream.on('close', end);
    client.on('error', () => undefined); // resets are what this proxy is for
    upstream.on('error', () => undefined);
  }

  /** Resets every open connection (RST to both sides). Returns how many there were. */
  resetAll(filter: (link: ProxyLink) => boolean = () => true): number {
    const chosen = [...this.links].filter(filter);
    for (const link of chosen) this.reset(link);
    return chosen.length;
  }

  reset(link: ProxyLink): void {
    this.links.delete(link);
    link.client.resetAndDestroy();
    link.upstream.resetAndDestroy();
  }

  /** Stops every open connection's bytes; the sockets stay open. New connections are not affected. */
  stallAll(): ProxyLink[] {
    const stalled = [...this.links];
    for (const link of stalled) {
      link.stalled = true;
      link.client.pause();
      link.upstream.pause();
    }
    this.stalledLinks.push(...stalled);
    return stalled;
  }

  private stalledLinks: ProxyLink[] = [];

  /** Closes the stalled connections (the servers see them go, as they would once the path is declared dead). */
  heal(): void {
    for (const link of this.stalledLinks.splice(0)) {
      this.links.delete(link);
      link.client.destroy();
      link.upstream.destroy();
    }
  }

  /**
   * Resolves with the link on which the next statement matching `pattern` is sent; from then on
   * that link's answers are held back (the client waits for an answer that never comes).
   */
  holdRepliesAfter(pattern: RegExp): Promise<ProxyLink> {
    return new Promise((resolve) => this.holdWaiters.push({ pattern, resolve }));
  }

  /** Drops a link without a word to the client beyond the socket closing (its held answer is lost). */
  drop(link: ProxyLink): void {
    this.links.delete(link);
    link.client.destroy();
    link.upstream.destroy();
  }

  async close(): Promise<void> {
    this.holdWaiters = [];
    this.heal();
    for (const link of [...this.links]) this.drop(link);
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

interface PgMessage {
  type: string;
  body: Buffer;
}

/**
 * Splits a PostgreSQL protocol byte stream into messages (type byte + int32 length). The client's
 * first message (startup, or an SSL request before it) has no type byte.
 */
class PgMessageReader {
  private buffer = Buffer.alloc(0);
  private untyped: boolean;

  constructor(fromClient: boolean) {
    this.untyped = fromClient;
  }

  push(chunk: Buffer): PgMessage[] {
    this.buffer = Buffer.concat([this.buffer, chunk]);
    const messages: PgMessage[] = [];
    for (;;) {
      if (this.untyped) {
        if (this.buffer.length < 8) break;
        const length = this.buffer.readInt32BE(0);
        if (this.buffer.length < length) break;
        const code = this.buffer.readInt32BE(4);
        this.buffer = this.buffer.subarray(length);
        // SSLRequest / GSSENCRequest: another untyped message (the startup) follows.
        if (code !== 80877103 && code !== 80877104) this.untyped = false;
        continue;
      }
      if (this.buffer.length < 5) break;
      const length = this.buffer.readInt32BE(1);
      if (this.buffer.length < 1 + length) break;
      messages.push({ type: String.fromCharCode(this.buffer[0]!), body: this.buffer.subarray(5, 1 + length) });
      this.buffer = this.buffer.subarray(1 + length);
    }
    return messages;
  }
}

/** The SQL text of a Query ('Q': text) or Parse ('P': name, text) message. */
/** Q: the query; P (name, text, ...): the text; B (portal, statement, ...): the statement's name. */
function queryText(message: PgMessage): string {
  if (message.type === 'Q') return message.body.toString('utf8', 0, Math.max(0, message.body.length - 1));
  const nameEnd = message.body.indexOf(0);
  const textEnd = message.body.indexOf(0, nameEnd + 1);
  return message.body.toString('utf8', nameEnd + 1, textEnd < 0 ? undefined : textEnd);
}

/** One direction of a link: chunks written `latency()` ms after they came, strictly in order. */
class DelayedPipe {
  private readonly queue: Array<{ chunk: Buffer; due: number }> = [];
  private timer: NodeJS.Timeout | null = null;

  constructor(
    private readonly to: Socket,
    private readonly stalled: () => boolean,
    private readonly latency: () => number,
  ) {}

  push(chunk: Buffer): void {
    const latency = this.latency();
    if (latency <= 0 && this.queue.length === 0) return this.write(chunk);
    this.queue.push({ chunk, due: Date.now() + latency });
    this.schedule();
  }

  private write(chunk: Buffer): void {
    if (this.stalled() || this.to.destroyed) return;
    this.to.write(chunk);
  }

  private schedule(): void {
    if (this.timer || this.queue.length === 0) return;
    this.timer = setTimeout(() => {
      this.timer = null;
      const now = Date.now();
      while (this.queue.length > 0 && this.queue[0]!.due <= now) this.write(this.queue.shift()!.chunk);
      this.schedule();
    }, Math.max(1, this.queue[0]!.due - Date.now()));
  }
}
