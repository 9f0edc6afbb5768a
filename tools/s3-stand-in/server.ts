/**
 * A stand-in object store for the tests, the demo and the benchmark: s3rver (a real S3-protocol
 * server from npm, run in this process on a free port) behind a small HTTP proxy that records
 * every request and can inject what real S3 does under load or refusal:
 *
 * - `slowDown(n)`: the next n DeleteObjects requests are answered 503 SlowDown (never forwarded);
 * - `keyErrors`: object key -> error code (AccessDenied, InternalError, ...): such keys are taken
 *   out of the DeleteObjects request before it is forwarded (the object stays), and the answer
 *   gets a per-key <Error> for each, as S3 reports a refusal of one key among many;
 * - `holdAnswers`: requests are forwarded (the deletion happens) but the answers are held back
 *   until `releaseAnswers()` (a lost answer, as seen by the client).
 *
 * The record (`calls`) says when each request arrived, its keys and its status, so a caller can
 * count requests per 1,000 keys, keys in any one-second window, and keys sent more than once.
 *
 * s3rver is a development dependency: `startS3StandIn` loads it when called, so code that imports
 * this module but never starts the stand-in does not need it.
 */
import { PutObjectCommand, S3Client } from '@aws-sdk/client-s3';
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer, request as httpRequest, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';

export interface S3Call {
  method: string;
  /** Path and query as received (e.g. "/media-bucket?delete"). */
  target: string;
  /** DeleteObjects only: the object keys the request named. */
  keys: string[];
  arrivedAt: number;
  status: number | null;
  /** Why the proxy answered itself, if it did. */
  injected: 'slow-down' | null;
}

export interface S3StandIn {
  /** Point the policy's remote.endpoint here (the proxy). */
  endpoint: string;
  /** s3rver itself, without the proxy. */
  directEndpoint: string;
  bucket: string;
  /** Credentials s3rver accepts (its fixed development pair): tests and the demo put them in the environment. */
  credentials: { accessKeyId: string; secretAccessKey: string };
  calls: S3Call[];
  keyErrors: Map<string, string>;
  holdAnswers: boolean;
  slowDown(requests: number): void;
  releaseAnswers(): void;
  /** DeleteObjects requests recorded (forwarded or injected). */
  deleteCalls(): S3Call[];
  /** Most keys of forwarded DeleteObjects requests arriving within any `windowMs`. */
  maxKeysInWindow(windowMs: number): number;
  close(): Promise<void>;
}

interface S3rverInstance {
  run(): Promise<AddressInfo>;
  close(): Promise<void>;
}
type S3rverConstructor = new (options: Record<string, unknown>) => S3rverInstance;

const S3RVER_CREDENTIALS = { accessKeyId: 'S3RVER', secretAccessKey: 'S3RVER' };

const XML_ENTITIES: Record<string, string> = { '&amp;': '&', '&lt;': '<', '&gt;': '>', '&quot;': '"', '&apos;': "'" };
const decodeXml = (text: string): string => text.replace(/&(amp|lt|gt|quot|apos);/g, (entity) => XML_ENTITIES[entity]!).replace(/&#(\d+);/g, (_m, code: string) => String.fromCodePoint(Number(code)));
const encodeXml = (text: string): string => text.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;');

/** The keys a DeleteObjects body names, in order. */
export function keysOfDeleteBody(body: string): string[] {
  return [...body.matchAll(/<Key>([\s\S]*?)<\/Key>/g)].map((match) => decodeXml(match[1]!));
}

function readBody(message: IncomingMessage): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    message.on('data', (chunk: Buffer) => chunks.push(chunk));
    message.on('end', () => resolve(Buffer.concat(chunks)));
    message.on('error', reject);
  });
}

/**
 * s3rver keeps objects as files in folders per "/" of the key and removes a folder once it is
 * empty; two deletions of one DeleteObjects request that empty a folder together race on that
 * (ENOENT, answered 500 InternalError). A small object kept in each of `keepPrefixes` keeps the
 * folder, as real S3 has no folders at all.
 */
const KEEP_OBJECT = '.stand-in-keep';

export async function startS3StandIn(options: { bucket: string; port?: number; keepPrefixes?: readonly string[] }): Promise<S3StandIn> {
  // eslint-disable-next-line @typescript-eslint/no-require-imports -- loaded on use: a development dependency
  const S3rver = require('s3rver') as S3rverConstructor;
  const directory = mkdtempSync(path.join(tmpdir(), 'reaper-s3-'));
  const s3rver = new S3rver({ port: 0, address: '127.0.0.1', silent: true, directory, configureBuckets: [{ name: options.bucket }] });
  const direct = await s3rver.run();
  const keeper = new S3Client({ region: 'us-east-1', endpoint: `http://127.0.0.1:${direct.port}`, forcePathStyle: true, credentials: S3RVER_CREDENTIALS });
  for (const prefix of options.keepPrefixes ?? ['media/']) await keeper.send(new PutObjectCommand({ Bucket: options.bucket, Key: `${prefix}${KEEP_OBJECT}`, Body: 'kept' }));
  keeper.destroy();
  const calls: S3Call[] = [];
  let slowDownLeft = 0;
  const held: Array<() => void> = [];

  const stand: S3StandIn = {
    endpoint: '',
    directEndpoint: `http://127.0.0.1:${direct.port}`,
    bucket: options.bucket,
    credentials: S3RVER_CREDENTIALS,
    calls,
    keyErrors: new Map(),
    holdAnswers: false,
    slowDown(requests) {
      slowDownLeft = requests;
    },
    releaseAnswers() {
      for (const release of held.splice(0)) release();
    },
    deleteCalls: () => calls.filter((call) => call.method === 'POST' && /[?&]delete(=|&|$)/.test(call.target)),
    maxKeysInWindow(windowMs) {
      const forwarded = stand.deleteCalls().filter((call) => call.injected === null).sort((a, b) => a.arrivedAt - b.arrivedAt);
      let most = 0;
      let sum = 0;
      let start = 0;
      for (let end = 0; end < forwarded.length; end++) {
        sum += forwarded[end]!.keys.length;
        while (forwarded[end]!.arrivedAt - forwarded[start]!.arrivedAt >= windowMs) sum -= forwarded[start++]!.keys.length;
        most = Math.max(most, sum);
      }
      return most;
    },
    async close() {
      stand.releaseAnswers();
      await new Promise<void>((resolve) => proxy.close(() => resolve()));
      proxy.closeAllConnections();
      await s3rver.close();
      rmSync(directory, { recursive: true, force: true });
    },
  };

  const proxy = createServer((incoming: IncomingMessage, outgoing: ServerResponse) => {
    // Arrival is when the request's head arrives, not when its body (some 50 KB for 1,000 keys) has been read.
    const arrivedAt = Date.now();
    void (async () => {
      const body = await readBody(incoming);
      const target = incoming.url ?? '/';
      const isDelete = incoming.method === 'POST' && /[?&]delete(=|&|$)/.test(target);
      const call: S3Call = { method: incoming.method ?? '', target, keys: isDelete ? keysOfDeleteBody(body.toString('utf8')) : [], arrivedAt, status: null, injected: null };
      calls.push(call);
      if (isDelete && slowDownLeft > 0) {
        slowDownLeft -= 1;
        call.injected = 'slow-down';
        call.status = 503;
        outgoing.writeHead(503, { 'content-type': 'application/xml' });
        outgoing.end('<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>');
        return;
      }
      let forwardBody = body;
      const refused = isDelete ? call.keys.filter((key) => stand.keyErrors.has(key)) : [];
      if (refused.length > 0) {
        // Take the refused keys' <Object> entries out: the store never sees them (the objects stay).
        const text = body.toString('utf8').replace(/<Object>([\s\S]*?)<\/Object>/g, (entry, inner: string) => {
          const key = keysOfDeleteBody(inner)[0];
          return key !== undefined && stand.keyErrors.has(key) ? '' : entry;
        });
        forwardBody = Buffer.from(text, 'utf8');
      }
      const headers = { ...incoming.headers, 'content-length': String(forwardBody.length) };
      const upstream = httpRequest({ host: '127.0.0.1', port: direct.port, method: incoming.method, path: target, headers }, (answer) => {
        void (async () => {
          let answerBody = await readBody(answer);
          if (refused.length > 0 && (answer.statusCode ?? 0) === 200) {
            const errors = refused.map((key) => `<Error><Key>${encodeXml(key)}</Key><Code>${stand.keyErrors.get(key)}</Code><Message>injected by the stand-in</Message></Error>`).join('');
            answerBody = Buffer.from(answerBody.toString('utf8').replace('</DeleteResult>', `${errors}</DeleteResult>`), 'utf8');
          }
          const send = () => {
            call.status = answer.statusCode ?? 0;
            const answerHeaders = { ...answer.headers, 'content-length': String(answerBody.length) };
            delete answerHeaders['transfer-encoding'];
            outgoing.writeHead(answer.statusCode ?? 502, answerHeaders);
            outgoing.end(answerBody);
          };
          if (isDelete && stand.holdAnswers) held.push(send);
          else send();
        })().catch(() => outgoing.destroy());
      });
      upstream.on('error', () => outgoing.destroy());
      upstream.end(forwardBody);
    })().catch(() => outgoing.destroy());
  });
  await new Promise<void>((resolve) => proxy.listen(options.port ?? 0, '127.0.0.1', resolve));
  stand.endpoint = `http://127.0.0.1:${(proxy.address() as AddressInfo).port}`;
  return stand;
}
