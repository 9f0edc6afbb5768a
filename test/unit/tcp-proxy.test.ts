import assert from 'node:assert/strict';
import { createServer, connect, type AddressInfo, type Socket } from 'node:net';
import { test } from 'node:test';
import { TcpProxy } from '../support/tcp-proxy';

/**
 * The fault proxy's latency must never reorder bytes: a reordered chunk corrupts the protocol
 * stream (a PostgreSQL server then waits for the rest of a message that never comes, and the
 * client for an answer: a hang the test under latency would blame on reaper).
 */
test('the fault proxy under latency delivers every byte, in order, in both directions', async () => {
  const received: Buffer[] = [];
  const echoed: Buffer[] = [];
  const sink = createServer((socket: Socket) => {
    socket.on('data', (chunk: Buffer) => {
      received.push(chunk);
      socket.write(chunk); // back the other way, through the proxy's downstream delay
    });
  });
  await new Promise<void>((resolve) => sink.listen(0, '127.0.0.1', () => resolve()));
  const proxy = await TcpProxy.start({ targetHost: '127.0.0.1', targetPort: (sink.address() as AddressInfo).port });
  proxy.latencyMs = 3;
  const client = connect({ host: '127.0.0.1', port: proxy.port });
  client.setNoDelay(true);
  client.on('data', (chunk: Buffer) => echoed.push(chunk));
  try {
    await new Promise<void>((resolve) => client.once('connect', () => resolve()));
    // Many small writes spread over many event-loop turns and milliseconds: each arrives at the
    // proxy as its own chunk, due at its own instant.
    const count = 15_000;
    const expected = Buffer.alloc(count * 4);
    for (let i = 0; i < count; i++) {
      expected.writeUInt32BE(i, i * 4);
      client.write(expected.subarray(i * 4, i * 4 + 4));
      if (i % 3 === 0) await new Promise((resolve) => setImmediate(resolve));
    }
    const deadline = Date.now() + 30_000;
    while (Buffer.concat(echoed).length < expected.length && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 20));
    assert.ok(Buffer.concat(received).equals(expected), 'upstream: the bytes arrive as sent');
    assert.ok(Buffer.concat(echoed).equals(expected), 'downstream: the bytes arrive as sent');
  } finally {
    client.destroy();
    await proxy.close();
    await new Promise<void>((resolve) => sink.close(() => resolve()));
  }
});

/**
 * `refusing` stands for a server that is down: a connection made meanwhile is reset before it
 * reaches the server (a test changes the server's state while the client cannot see it), and one
 * made afterwards passes again.
 */
test('the fault proxy while refusing resets new connections before they reach the server; afterwards they pass', async () => {
  let accepted = 0;
  const sink = createServer((socket: Socket) => {
    accepted += 1;
    socket.end('hello');
  });
  await new Promise<void>((resolve) => sink.listen(0, '127.0.0.1', () => resolve()));
  const proxy = await TcpProxy.start({ targetHost: '127.0.0.1', targetPort: (sink.address() as AddressInfo).port });
  const attempt = () =>
    new Promise<{ data: string; error: string | null }>((resolve) => {
      const client = connect({ host: '127.0.0.1', port: proxy.port });
      let data = '';
      let error: string | null = null;
      client.on('data', (chunk: Buffer) => (data += chunk.toString()));
      client.on('error', (e: NodeJS.ErrnoException) => (error = e.code ?? e.message));
      client.on('close', () => resolve({ data, error }));
    });
  try {
    proxy.refusing = true;
    const refused = await attempt();
    assert.equal(refused.data, '', 'nothing from the server while refusing');
    assert.equal(refused.error, 'ECONNRESET');
    assert.equal(accepted, 0, 'the server never saw the refused connection');
    assert.equal(proxy.links.size, 0);
    proxy.refusing = false;
    assert.deepEqual(await attempt(), { data: 'hello', error: null });
    assert.equal(accepted, 1);
  } finally {
    await proxy.close();
    await new Promise<void>((resolve) => sink.close(() => resolve()));
  }
});
