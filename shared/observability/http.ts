import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Logger } from 'pino';
import type { Registry } from 'prom-client';

export type RouteHandler = (request: IncomingMessage, body: Buffer, response: ServerResponse) => Promise<void>;

export interface HealthServerOptions {
  port: number;
  registry: Registry;
  log: Logger;
  /** Ready = can do its job now (database and broker answer). Alive = the process is not wedged. */
  ready: () => boolean;
  /** Extra POST routes by path prefix, e.g. "/webhooks/". */
  postRoutes?: Record<string, RouteHandler>;
  maxBodyBytes?: number;
}

/**
 * GET /livez, GET /readyz, GET /metrics, plus the POST routes given. Services start it before they
 * connect to the broker: /livez answers 200 as long as the process runs (a broker or database
 * outage is for /readyz to report, not a reason to restart the pod).
 */
export async function startHealthServer(options: HealthServerOptions): Promise<Server & { boundPort: number }> {
  const maxBody = options.maxBodyBytes ?? 64 * 1024;
  const server = createServer((request, response) => {
    void route(request, response).catch((error: Error) => {
      options.log.error({ err: error.message }, 'http handler failed');
      if (!response.headersSent) reply(response, 500, { error: 'internal error' });
    });
  });

  async function route(request: IncomingMessage, response: ServerResponse): Promise<void> {
    const path = (request.url ?? '/').split('?')[0]!;
    if (request.method === 'GET' && path === '/livez') return reply(response, 200, { status: 'ok' });
    if (request.method === 'GET' && path === '/readyz') {
      const ready = options.ready();
      return reply(response, ready ? 200 : 503, { status: ready ? 'ready' : 'not ready' });
    }
    if (request.method === 'GET' && path === '/metrics') {
      response.writeHead(200, { 'content-type': options.registry.contentType });
      response.end(await options.registry.metrics());
      return;
    }
    if (request.method === 'POST') {
      const prefix = Object.keys(options.postRoutes ?? {}).find((candidate) => path.startsWith(candidate));
      if (prefix) {
        const body = await readBody(request, maxBody);
        if (body === null) return reply(response, 413, { error: `body larger than ${maxBody} bytes` });
        return options.postRoutes![prefix]!(request, body, response);
      }
    }
    reply(response, 404, { error: 'not found' });
  }

  // A port already taken is a start-up error with its reason, not a promise that never settles.
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(options.port, '0.0.0.0', () => {
      server.off('error', reject);
      resolve();
    });
  });
  const address = server.address();
  return Object.assign(server, { boundPort: typeof address === 'object' && address ? address.port : options.port });
}

export function reply(response: ServerResponse, status: number, body: unknown): void {
  response.writeHead(status, { 'content-type': 'application/json' });
  response.end(JSON.stringify(body));
}

/** Reads the body up to `limit` bytes; null when it is larger (the rest is not read). */
function readBody(request: IncomingMessage, limit: number): Promise<Buffer | null> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    request.on('data', (chunk: Buffer) => {
      size += chunk.length;
      if (size > limit) {
        resolve(null);
        request.destroy();
        return;
      }
      chunks.push(chunk);
    });
    request.on('end', () => resolve(Buffer.concat(chunks)));
    request.on('error', reject);
  });
}
