import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import path from 'node:path';
import { z } from 'zod';
import { ConfigError } from './errors';
import type { SessionTimeouts } from '../db/pool';

/** The demo policies shipped in the repository: used when REAPER_POLICIES is not set. */
export const DEMO_POLICIES_PATH = path.resolve(__dirname, '..', '..', '..', 'infra', 'policies.demo.yaml');

const envSchema = z.object({
  // Checked here so a malformed URL is refused at start naming DATABASE_URL (its value hidden),
  // not later by pg with a stack trace (or a URIError from a bad %-escape in the password).
  DATABASE_URL: z.string().min(1).superRefine((value, context) => {
    const problem = databaseUrlProblem(value);
    if (problem !== null) context.addIssue({ code: 'custom', message: `not a PostgreSQL URL (postgres://user:password@host:5432/database): ${problem}` });
  }).default('postgres://postgres@127.0.0.1:5432/postgres'),
  /** One broker URL, or several comma-separated (cluster nodes), tried in turn at every (re)connect. */
  AMQP_URL: z
    .string()
    .min(1)
    .refine((value) => value.split(',').every((url) => url.trim() !== ''), 'a comma-separated list of URLs without empty entries')
    .default('amqp://guest:guest@127.0.0.1:5672'),
  REAPER_AMQP_PREFIX: z
    .string()
    .regex(/^[a-zA-Z0-9_-]+$/, 'letters, digits, "-" and "_" only')
    .default('reaper'),
  REAPER_POLICIES: z.string().min(1).default(DEMO_POLICIES_PATH),
  REAPER_WORKER_ID: z.string().min(1).default(`${hostname()}:${process.pid}`),
  LOG_LEVEL: z.enum(['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent']).default('info'),
  HTTP_PORT: z.string().trim().regex(/^\d+$/, 'must be a port number (0-65535)').transform(Number).pipe(z.number().int().min(0).max(65535)).optional(),
  /** Unacknowledged batches a worker holds at once per queue (AMQP consumer prefetch); unset: per policy kind (PREFETCH_DEFAULTS). */
  REAPER_PREFETCH: z.coerce.number().int().min(1).max(1000).optional(),
  /** PostgreSQL connections per process. */
  REAPER_DB_POOL_SIZE: z.coerce.number().int().min(1).max(100).default(4),
  /** How many times the broker redelivers a batch that keeps failing before dead-lettering it. */
  REAPER_DELIVERY_LIMIT: z.coerce.number().int().min(1).max(1000).default(20),
  /** Shared secret for POST /webhooks/<policy> (HMAC-SHA256). Webhooks are refused while unset. */
  REAPER_WEBHOOK_SECRET: z.string().min(16, 'at least 16 characters').optional(),
  /** PostgreSQL statement_timeout per session (0 turns it off). */
  REAPER_STATEMENT_TIMEOUT_MS: z.coerce.number().int().min(0).max(86_400_000).default(60_000),
  /** PostgreSQL lock_timeout per session: a DELETE waiting this long for a row lock is retried later. */
  REAPER_LOCK_TIMEOUT_MS: z.coerce.number().int().min(0).max(86_400_000).default(5_000),
  /** How often the scheduler reads the backlog gauges from PostgreSQL (one bounded query per policy per pass). */
  REAPER_BACKLOG_REFRESH_MS: z.coerce.number().int().min(100).max(300_000).default(10_000),
  /**
   * AMQP heartbeat in seconds requested for every URL of AMQP_URL that has no `heartbeat=` of its
   * own. A stalled link (bytes stop, socket open) is noticed within about two heartbeats. Unset:
   * the broker's proposal (60 s on RabbitMQ), so about two minutes.
   */
  REAPER_AMQP_HEARTBEAT_S: z.coerce.number().int().min(1).max(3600).optional(),
  /**
   * Replicas of each quorum queue reaper declares (x-quorum-initial-group-size), e.g. 3 on a
   * three-node cluster. Unset: the argument is not declared (the broker's default, every node up
   * to its own limit). Changing it for an existing queue is a topology conflict (RabbitMQ checks
   * the argument at every declare); RabbitMQ 3.10 accepts a size larger than the cluster and uses
   * the nodes it has.
   */
  REAPER_QUORUM_GROUP_SIZE: z.coerce.number().int().min(1).max(99).optional(),
  /** TCP keepalive idle time of PostgreSQL connections (0 turns keepalive off). */
  REAPER_DB_KEEPALIVE_MS: z.coerce.number().int().min(0).max(3_600_000).default(10_000),
});

export interface Prefetch {
  rowDelete: number;
  remoteDelete: number;
}

/**
 * REAPER_PREFETCH unset. row-delete: the batches a worker holds for a policy go to the database
 * as one statement (services/worker/coalescer.ts), so more in hand means fewer, bigger statements
 * and fewer transactions, admissions and acks per row: 32 against 8 took 19% less CPU per row
 * (Node, PostgreSQL and RabbitMQ together) and drained 1.23x as fast in the same bench rounds
 * (bench/results/2026-12-03-cost-quick-ab-pf32.md); statement size stays bounded by the admission
 * (maxRowsPerStatement). remote-delete: a batch waits its turn at a shared API rate in the worker
 * or is parked in the ledger, so holding more only parks more: 8. REAPER_PREFETCH, when set,
 * applies to every queue.
 */
export const PREFETCH_DEFAULTS: Readonly<Prefetch> = Object.freeze({ rowDelete: 32, remoteDelete: 8 });

export type Env = {
  databaseUrl: string;
  /** AMQP_URL as given (one URL or a comma-separated list), with REAPER_AMQP_HEARTBEAT_S folded in. */
  amqpUrl: string;
  amqpPrefix: string;
  quorumGroupSize: number | undefined;
  policiesPath: string;
  workerId: string;
  logLevel: z.infer<typeof envSchema>['LOG_LEVEL'];
  httpPort: number | undefined;
  /** Unacknowledged batches per worker and queue, by the kind of policy the queue carries. */
  prefetch: Prefetch;
  dbPoolSize: number;
  deliveryLimit: number;
  webhookSecret: string | undefined;
  sessionTimeouts: SessionTimeouts;
  backlogRefreshMs: number;
};

/** Variables that may hold secrets: each may instead name a file through `<NAME>_FILE`. */
/** Why a DATABASE_URL cannot be used (null when it can); never repeats the value (it holds a password). */
function databaseUrlProblem(value: string): string | null {
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    return 'it does not parse as a URL';
  }
  if (url.protocol !== 'postgres:' && url.protocol !== 'postgresql:') return `the scheme is "${url.protocol}", expected postgres: or postgresql:`;
  try {
    decodeURIComponent(url.username);
    decodeURIComponent(url.password);
    decodeURIComponent(url.pathname);
  } catch {
    return 'a %-escape in the user, password or database name is invalid';
  }
  return null;
}

const SECRET_CAPABLE = ['DATABASE_URL', 'AMQP_URL', 'REAPER_WEBHOOK_SECRET'] as const;

/**
 * Reads `NAME` or, when `NAME_FILE` is set, the trimmed content of that file. Setting both is
 * refused: one of them would silently win.
 */
export function readVariable(source: NodeJS.ProcessEnv, name: string): string | undefined {
  const direct = source[name];
  const file = source[`${name}_FILE`];
  if (file !== undefined && file !== '') {
    if (direct !== undefined && direct !== '') {
      throw new ConfigError(`both ${name} and ${name}_FILE are set; set only one`);
    }
    try {
      return readFileSync(file, 'utf8').trim();
    } catch (error) {
      throw new ConfigError(`${name}_FILE=${file}: cannot read the file (${(error as Error).message})`);
    }
  }
  return direct === '' ? undefined : direct;
}

/** Validates the environment once, at start-up. Errors name the variable and its value. */
export function loadEnv(source: NodeJS.ProcessEnv = process.env): Env {
  const raw: Record<string, string | undefined> = {};
  for (const key of Object.keys(envSchema.shape)) {
    raw[key] = (SECRET_CAPABLE as readonly string[]).includes(key) ? readVariable(source, key) : emptyAsUnset(source[key]);
  }
  const parsed = envSchema.safeParse(raw);
  if (!parsed.success) {
    const lines = parsed.error.issues.map((issue) => {
      const key = String(issue.path[0]);
      const shown = (SECRET_CAPABLE as readonly string[]).includes(key) ? '(hidden)' : JSON.stringify(raw[key]);
      return `${key}=${shown}: ${issue.message}`;
    });
    throw new ConfigError(`invalid environment:\n  ${lines.join('\n  ')}`);
  }
  const env = parsed.data;
  return {
    databaseUrl: env.DATABASE_URL,
    amqpUrl: withHeartbeat(env.AMQP_URL, env.REAPER_AMQP_HEARTBEAT_S),
    quorumGroupSize: env.REAPER_QUORUM_GROUP_SIZE,
    amqpPrefix: env.REAPER_AMQP_PREFIX,
    policiesPath: env.REAPER_POLICIES,
    workerId: env.REAPER_WORKER_ID,
    logLevel: env.LOG_LEVEL,
    httpPort: env.HTTP_PORT,
    prefetch: env.REAPER_PREFETCH === undefined ? PREFETCH_DEFAULTS : { rowDelete: env.REAPER_PREFETCH, remoteDelete: env.REAPER_PREFETCH },
    dbPoolSize: env.REAPER_DB_POOL_SIZE,
    deliveryLimit: env.REAPER_DELIVERY_LIMIT,
    webhookSecret: env.REAPER_WEBHOOK_SECRET,
    sessionTimeouts: {
      statementTimeoutMs: env.REAPER_STATEMENT_TIMEOUT_MS,
      lockTimeoutMs: env.REAPER_LOCK_TIMEOUT_MS,
      keepAliveMs: env.REAPER_DB_KEEPALIVE_MS,
    },
    backlogRefreshMs: env.REAPER_BACKLOG_REFRESH_MS,
  };
}

/**
 * Adds `heartbeat=<seconds>` (amqplib's own URL parameter) to each URL of the list that has none:
 * the services pass AMQP_URL straight to the connection, so the setting travels inside it.
 */
export function withHeartbeat(urls: string, seconds: number | undefined): string {
  if (seconds === undefined) return urls;
  return urls
    .split(',')
    .map((raw) => {
      const url = raw.trim();
      if (/[?&]heartbeat=/.test(url)) return url;
      return `${url}${url.includes('?') ? '&' : '?'}heartbeat=${seconds}`;
    })
    .join(',');
}

function emptyAsUnset(value: string | undefined): string | undefined {
  return value === '' ? undefined : value;
}
