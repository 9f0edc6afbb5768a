import { once } from 'node:events';
import net from 'node:net';

/**
 * A TCP proxy between a reaper process and RabbitMQ that reads the AMQP 0-9-1 frames going both
 * ways, to see what the broker sees: which deliveries it made (with their redelivered flag) and
 * how each was settled (basic.ack, basic.reject, basic.nack, with their requeue flags), and which
 * consumers the process cancelled (basic.cancel, basic.cancel-ok). A worker started with AMQP_URL
 * pointing at `url` runs unchanged; nothing is mocked, every byte is passed on as it came, frame by
 * frame, in order. Only the frames needed to tell these apart are decoded. One frame can be held
 * back on request (`holdNextCancelOk`): a slow broker answer, made to last as long as a test needs.
 */
export type WireEvent =
  | { kind: 'deliver'; connection: number; channel: number; deliveryTag: bigint; redelivered: boolean; routingKey: string; batchId: string | null }
  | { kind: 'ack' | 'reject' | 'nack'; connection: number; channel: number; deliveryTag: bigint; multiple: boolean; requeue: boolean; batchId: string | null }
  | { kind: 'publish'; connection: number; channel: number; exchange: string; routingKey: string }
  | { kind: 'cancel' | 'cancel-ok'; connection: number; channel: number; consumerTag: string };

/** A delivery or its settlement: the events that name a batch. */
export type BatchWireEvent = Extract<WireEvent, { batchId: string | null }>;

/** A basic.cancel-ok the proxy holds: the process still waits for it, the broker already sent it. */
export interface HeldFrame {
  /** Resolves with the held frame's consumer tag once the broker sent it (and it was held). */
  held: Promise<string>;
  /** Passes the frame on (at once if it is already held, else as soon as it comes). */
  release(): void;
}

export interface AmqpWiretap {
  /** AMQP_URL for the process under test (same credentials and vhost, the proxy's port). */
  url: string;
  events: WireEvent[];
  /** Events concerning one batch (deliveries and their settlements), in order. */
  eventsOf(batchId: string): BatchWireEvent[];
  /**
   * Holds the next basic.cancel-ok from the broker (any connection) until `release`; every other
   * frame passes. The process awaits it, so it sends no further RPC on that channel meanwhile (an
   * amqplib channel has one RPC outstanding at a time): the consumers it would cancel next stay
   * active on the broker. Acks and rejects are not RPCs and still pass.
   */
  holdNextCancelOk(): HeldFrame;
  close(): Promise<void>;
}

/** The armed hold: waiting for a cancel-ok (`frame` null), or holding one. */
interface HoldState {
  frame: { bytes: Buffer; to: net.Socket } | null;
  released: boolean;
  caught: (consumerTag: string) => void;
}

const FRAME_METHOD = 1;
const FRAME_HEADER = 2;
const FRAME_BODY = 3;
const FRAME_END = 0xce;
const BASIC = 60;
const METHODS: Record<number, 'cancel' | 'cancel-ok' | 'publish' | 'deliver' | 'ack' | 'reject' | 'nack'> = {
  30: 'cancel',
  31: 'cancel-ok',
  40: 'publish',
  60: 'deliver',
  80: 'ack',
  90: 'reject',
  120: 'nack',
};

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
  let hold: HoldState | null = null;

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
    const fromClient = frameReader(8, (bytes) => broker.write(bytes), (type, channel, payload) => {
      if (type !== FRAME_METHOD || payload.readUInt16BE(0) !== BASIC) return;
      const method = METHODS[payload.readUInt16BE(2)];
      if (method === 'cancel') {
        events.push({ kind: 'cancel', connection: id, channel, consumerTag: shortString(payload, 4).value });
      } else if (method === 'publish') {
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
    const toClient = (bytes: Buffer, frame: { type: number; payload: Buffer } | null) => {
      const cancelOk = frame !== null && frame.type === FRAME_METHOD && frame.payload.readUInt16BE(0) === BASIC && METHODS[frame.payload.readUInt16BE(2)] === 'cancel-ok';
      if (cancelOk && hold !== null && hold.frame === null) {
        const armed = hold;
        if (!armed.released) {
          armed.frame = { bytes: Buffer.from(bytes), to: client };
          armed.caught(shortString(frame.payload, 4).value);
          return;
        }
        hold = null;
      }
      client.write(bytes);
    };
    const fromBroker = frameReader(0, toClient, (type, channel, payload) => {
      if (type === FRAME_METHOD && payload.readUInt16BE(0) === BASIC && METHODS[payload.readUInt16BE(2)] === 'cancel-ok') {
        events.push({ kind: 'cancel-ok', connection: id, channel, consumerTag: shortString(payload, 4).value });
      } else if (type === FRAME_METHOD && payload.readUInt16BE(0) === BASIC && METHODS[payload.readUInt16BE(2)] === 'deliver') {
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
    client.on('data', fromClient);
    broker.on('data', fromBroker);
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const proxied = new URL(brokerUrl);
  proxied.hostname = '127.0.0.1';
  proxied.port = String((server.address() as net.AddressInfo).port);
  return {
    url: proxied.toString(),
    events,
    eventsOf: (batchId) => events.filter((event): event is BatchWireEvent => 'batchId' in event && event.batchId === batchId),
    holdNextCancelOk() {
      if (hold !== null) throw new Error('a cancel-ok is already held or awaited: release it first');
      let caught!: (consumerTag: string) => void;
      const held = new Promise<string>((resolve) => (caught = resolve));
      const armed: HoldState = { frame: null, released: false, caught };
      hold = armed;
      return {
        held,
        release() {
          armed.released = true;
          if (armed.frame !== null) {
            if (!armed.frame.to.destroyed) armed.frame.to.write(armed.frame.bytes);
            hold = null;
          }
        },
      };
    },
    async close() {
      for (const socket of sockets) socket.destroy();
      server.close();
      await once(server, 'close').catch(() => undefined);
    },
  };
}

/**
 * Splits a byte stream into AMQP frames (after `skip` leading bytes, passed on as they are): each
 * complete frame goes to `onFrame` to be read, then to `forward` with its bytes, in order.
 */
function frameReader(
  skip: number,
  forward: (bytes: Buffer, frame: { type: number; payload: Buffer } | null) => void,
  onFrame: (type: number, channel: number, payload: Buffer) => void,
): (chunk: Buffer) => void {
  let pending = Buffer.alloc(0);
  let toSkip = skip;
  let lost = false;
  return (chunk) => {
    if (lost) return forward(chunk, null);
    pending = Buffer.concat([pending, chunk]);
    if (toSkip > 0) {
      const skipped = Math.min(toSkip, pending.length);
      forward(pending.subarray(0, skipped), null);
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
        forward(pending, null);
        pending = Buffer.alloc(0);
        return;
      }
      const payload = pending.subarray(7, 7 + size);
      onFrame(pending.readUInt8(0), pending.readUInt16BE(1), payload);
      forward(pending.subarray(0, 8 + size), { type: pending.readUInt8(0), payload });
      pending = pending.subarray(8 + size);
    }
  };
}
