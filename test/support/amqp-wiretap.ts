import { once } from 'node:events';
import net from 'node:net';

/**
 * A TCP proxy between a reaper process and RabbitMQ that reads the AMQP 0-9-1 frames going both
 * ways, to see what the broker sees: which deliveries it made (with their redelivered flag) and
 * how each was settled (basic.ack, basic.reject, basic.nack, with their requeue flags). A worker
 * started with AMQP_URL pointing at `url` runs unchanged; nothing is mocked, every byte is passed
 * on as it came. Only the frames needed to tell these apart are decoded.
 */
export type WireEvent =
  | { kind: 'deliver'; connection: number; channel: number; deliveryTag: bigint; redelivered: boolean; routingKey: string; batchId: string | null }
  | { kind: 'ack' | 'reject' | 'nack'; connection: number; channel: number; deliveryTag: bigint; multiple: boolean; requeue: boolean; batchId: string | null }
  | { kind: 'publish'; connection: number; channel: number; exchange: string; routingKey: string };

export interface AmqpWiretap {
  /** AMQP_URL for the process under test (same credentials and vhost, the proxy's port). */
  url: string;
  events: WireEvent[];
  /** Events concerning one batch (deliveries and their settlements), in order. */
  eventsOf(batchId: string): WireEvent[];
  close(): Promise<void>;
}

const FRAME_METHOD = 1;
const FRAME_HEADER = 2;
const FRAME_BODY = 3;
const FRAME_END = 0xce;
const BASIC = 60;
const METHODS: Record<number, 'publish' | 'deliver' | 'ack' | 'reject' | 'nack'> = { 40: 'publish', 60: 'deliver', 80: 'ack', 90: 'reject', 120: 'nack' };

function shortString(buffer: Buffer, offset: number): { value: string; next: number } {
  const length = buffer.readUInt8(offset);
  return { value: buffer.toString('utf8', offset + 1, offset + 1 + length), next: offset + 1 + length };
}

export async function startAmqpWiretap(brokerUrl: string): Promise<AmqpWiretap> {
  const upstream = new URL(brokerUrl);
  const events: WireEvent[] = [];
  /** Batch id per `${connection}/${channel}/${deliveryTag}`, read from the delivered body. */
  const batchOf = new Map<string, string | null>();
  const sockets = new Set<net.Socket>();
  let connections = 0;

  const server = net.createServer((client) => {
    const id = ++connections;
    const broker = net.connect(Number(upstream.port || 5672), upstream.hostname);
    sockets.add(client).add(broker);
    const closeBoth = () => {
      client.destroy();
      broker.destroy();
    };
    client.on('error', closeBoth).on('close', closeBoth);
    broker.on('error', closeBoth).on('close', closeBoth);
    // Client to broker: the 8-byte protocol header, then frames.
    const fromClient = frameReader(8, (type, channel, payload) => {
      if (type !== FRAME_METHOD || payload.readUInt16BE(0) !== BASIC) return;
      const method = METHODS[payload.readUInt16BE(2)];
      if (method === 'publish') {
        const exchange = shortString(payload, 6); // reserved short, then exchange
        const routingKey = shortString(payload, exchange.next);
        events.push({ kind: 'publish', connection: id, channel, exchange: exchange.value, routingKey: routingKey.value });
      } else if (method === 'ack' || method === 'reject' || method === 'nack') {
        const deliveryTag = payload.readBigUInt64BE(4);
        const bits = payload.readUInt8(12);
        const multiple = method !== 'reject' && (bits & 1) === 1;
        const requeue = method === 'reject' ? (bits & 1) === 1 : method === 'nack' && (bits & 2) === 2;
        events.push({ kind: method, connection: id, channel, deliveryTag, multiple, requeue, batchId: batchOf.get(`${id}/${channel}/${deliveryTag}`) ?? null });
      }
    });
    // Broker to client: frames only. A delivery's body follows its method and header frames.
    const bodies = new Map<number, { key: string; size: number; chunks: Buffer[]; event: WireEvent & { kind: 'deliver' } }>();
    const fromBroker = frameReader(0, (type, channel, payload) => {
      if (type === FRAME_METHOD && payload.readUInt16BE(0) === BASIC && METHODS[payload.readUInt16BE(2)] === 'deliver') {
        const consumerTag = shortString(payload, 4);
        const deliveryTag = payload.readBigUInt64BE(consumerTag.next);
        const redelivered = (payload.readUInt8(consumerTag.next + 8) & 1) === 1;
        const exchange = shortString(payload, consumerTag.next + 9);
        const routingKey = shortString(payload, exchange.next);
        const event = { kind: 'deliver' as const, connection: id, channel, deliveryTag, redelivered, routingKey: routingKey.value, batchId: null as string | null };
        events.push(event);
        bodies.set(channel, { key: `${id}/${channel}/${deliveryTag}`, size: -1, chunks: [], event });
      } else if (type === FRAME_HEADER && bodies.has(channel)) {
        bodies.get(channel)!.size = Number(payload.readBigUInt64BE(4));
      } else if (type === FRAME_BODY && bodies.has(channel)) {
        const body = bodies.get(channel)!;
        body.chunks.push(Buffer.from(payload));
        const content = Buffer.concat(body.chunks);
        if (content.length >= body.size) {
          bodies.delete(channel);
          let batchId: string | null = null;
          try {
            const parsed = JSON.parse(content.toString('utf8')) as { batchId?: unknown };
            batchId = typeof parsed.batchId === 'string' ? parsed.batchId : null;
          } catch {
            // not a batch: recorded without an id
          }
          body.event.batchId = batchId;
          batchOf.set(body.key, batchId);
        }
      }
    });
    client.on('data', (chunk: Buffer) => {
      fromClient(chunk);
      broker.write(chunk);
    });
    broker.on('data', (chunk: Buffer) => {
      fromBroker(chunk);
      client.write(chunk);
    });
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const proxied = new URL(brokerUrl);
  proxied.hostname = '127.0.0.1';
  proxied.port = String((server.address() as net.AddressInfo).port);
  return {
    url: proxied.toString(),
    events,
    eventsOf: (batchId) => events.filter((event) => event.kind !== 'publish' && event.batchId === batchId),
    async close() {
      for (const socket of sockets) socket.destroy();
      server.close();
      await once(server, 'close').catch(() => undefined);
    },
  };
}

/** Splits a byte stream into AMQP frames (after `skip` leading bytes) and hands each to `onFrame`. */
function frameReader(skip: number, onFrame: (type: number, channel: number, payload: Buffer) => void): (chunk: Buffer) => void {
  let pending = Buffer.alloc(0);
  let toSkip = skip;
  let lost = false;
  return (chunk) => {
    if (lost) return;
    pending = Buffer.concat([pending, chunk]);
    if (toSkip > 0) {
      const skipped = Math.min(toSkip, pending.length);
      pending = pending.subarray(skipped);
      toSkip -= skipped;
    }
    while (pending.length >= 7) {
      const size = pending.readUInt32BE(3);
      if (pending.length < 7 + size + 1) return;
      if (pending.readUInt8(7 + size) !== FRAME_END) {
        // Out of sync (cannot happen with a conforming peer): stop reading; the bytes still pass.
        // Assertions on the events then fail for want of them, never silently pass.
        lost = true;
        return;
      }
      onFrame(pending.readUInt8(0), pending.readUInt16BE(1), pending.subarray(7, 7 + size));
      pending = pending.subarray(8 + size);
    }
  };
}
