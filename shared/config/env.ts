import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import path from 'node:path';
import { z } from 'zod';
import { ConfigError } from './errors';
import type { SessionTimeouts } from '../db/pool';

/** The demo policies shipped in the repository: used when REAPER_POLICIES is not set. */
export const DEMO_POLICIES_PATH = path.resolve(__dirname, '..', '..', '..', 'infra', 'policies.demo.yaml');

const envSchema = z.object({
  DATABASE_URL: z.string().min(1).default('postgres://postgres@127.0.0.1:5432/postgres'),
  AMQP_URL: z.string().min(1).default('amqp://guest:guest@127.0.0.1:5672'),
  REAPER_AMQP_PREFIX: z
    .string()
    .regex(/^[a-zA-Z0-9_-]+$/, 'letters, digits, "-" and "_" only')
    .default('reaper'),
  REAPER_POLICIES: z.string().min(1).default(DEMO_POLICIES_PATH),
  REAPER_WORKER_ID: z.string().min(1).default(`${hostname()}:${process.pid}`),
  LOG_LEVEL: z.enum(['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent']).default('info'),
  HTTP_PORT: z.string().trim().regex(/^\d+$/, 'must be a port number (0-65535)').transform(Number).pipe(z.number().int().min(0).max(65535)).optional(),
  /** Unacknowledged batches a worker holds at once (AMQP prefetch). */
  REAPER_PREFETCH: z.coerce.number().int().min(1).max(1000).default(8),
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
});

export type Env = {
  databaseUrl: string;
  amqpUrl: string;
  amqpPrefix: string;
  policiesPath: string;
  workerId: string;
  logLevel: z.infer<typeof envSchema>['LOG_LEVEL'];
  httpPort: number | undefined;
  prefetch: number;
  dbPoolSize: number;
  deliveryLimit: number;
  webhookSecret: string | undefined;
  sessionTimeouts: SessionTimeouts;
  backlogRefreshMs: number;
};

/** Variables that may hold secrets: each may instead name a file through `<NAME>_FILE`. */
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
    amqpUrl: env.AMQP_URL,
    amqpPrefix: env.REAPER_AMQP_PREFIX,
    policiesPath: env.REAPER_POLICIES,
    workerId: env.REAPER_WORKER_ID,
    logLevel: env.LOG_LEVEL,
    httpPort: env.HTTP_PORT,
    prefetch: env.REAPER_PREFETCH,
    dbPoolSize: env.REAPER_DB_POOL_SIZE,
    deliveryLimit: env.REAPER_DELIVERY_LIMIT,
    webhookSecret: env.REAPER_WEBHOOK_SECRET,
    sessionTimeouts: { statementTimeoutMs: env.REAPER_STATEMENT_TIMEOUT_MS, lockTimeoutMs: env.REAPER_LOCK_TIMEOUT_MS },
    backlogRefreshMs: env.REAPER_BACKLOG_REFRESH_MS,
  };
}

function emptyAsUnset(value: string | undefined): string | undefined {
  return value === '' ? undefined : value;
}
