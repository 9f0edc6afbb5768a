import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import amqp from 'amqplib';
import pg from 'pg';
import { loadEnv, type Env } from '../../shared/config/env';
import { migrate } from '../../shared/db/migrate';
import { findServers } from './servers';

/**
 * One test file's private world: its own database (migrated), its own broker name prefix and a
 * temp folder for its policies file. `close()` drops the database and deletes every queue and
 * exchange under the prefix, so files run in parallel and leave nothing behind.
 */
export interface TestBed {
  databaseUrl: string;
  amqpUrl: string;
  prefix: string;
  pool: pg.Pool;
  /** Writes a policies file (YAML text) and returns its path. */
  writePolicies(yaml: string): string;
  /** Environment for a reaper process or for loadEnv(), with overrides. */
  processEnv(overrides?: Record<string, string>): NodeJS.ProcessEnv;
  env(overrides?: Record<string, string>): Env;
  close(): Promise<void>;
}

export async function makeTestBed(label: string): Promise<TestBed> {
  const servers = await findServers();
  const suffix = randomBytes(4).toString('hex');
  const safeLabel = label.replace(/[^a-z0-9]/gi, '_').toLowerCase();
  const database = `reaper_test_${safeLabel}_${suffix}`;
  const prefix = `test-${safeLabel.replace(/_/g, '-')}-${suffix}`;
  const admin = new pg.Client({ connectionString: servers.databaseUrl });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${pg.escapeIdentifier(database)}`);
  await admin.end();
  const url = new URL(servers.databaseUrl);
  url.pathname = `/${database}`;
  const databaseUrl = url.toString();
  await migrate(databaseUrl);
  const pool = new pg.Pool({ connectionString: databaseUrl, max: 4 });
  const folder = mkdtempSync(path.join(tmpdir(), `reaper-${safeLabel}-`));
  let policiesPath = '';

  const processEnv = (overrides: Record<string, string> = {}): NodeJS.ProcessEnv => ({
    PATH: process.env.PATH,
    HOME: process.env.HOME,
    DATABASE_URL: databaseUrl,
    AMQP_URL: servers.amqpUrl,
    REAPER_AMQP_PREFIX: prefix,
    LOG_LEVEL: process.env.TEST_LOG_LEVEL ?? 'info',
    ...(policiesPath ? { REAPER_POLICIES: policiesPath } : {}),
    ...overrides,
  });

  return {
    databaseUrl,
    amqpUrl: servers.amqpUrl,
    prefix,
    pool,
    writePolicies(yaml) {
      policiesPath = path.join(folder, `policies-${randomBytes(3).toString('hex')}.yaml`);
      writeFileSync(policiesPath, yaml);
      return policiesPath;
    },
    processEnv,
    env: (overrides) => loadEnv(processEnv(overrides)),
    async close() {
      await pool.end();
      await deleteBrokerObjects(servers.amqpUrl, prefix);
      const cleanup = new pg.Client({ connectionString: servers.databaseUrl });
      await cleanup.connect();
      await cleanup.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(database)} WITH (FORCE)`);
      await cleanup.end();
      rmSync(folder, { recursive: true, force: true });
    },
  };
}

/** Deletes the queues and exchanges whose names start with `<prefix>.`, found with rabbitmqctl. */
async function deleteBrokerObjects(amqpUrl: string, prefix: string): Promise<void> {
  const { queues, exchanges } = await listBrokerObjects(prefix);
  const connection = await amqp.connect(amqpUrl);
  try {
    const channel = await connection.createChannel();
    for (const queue of queues) await channel.deleteQueue(queue);
    for (const exchange of exchanges) await channel.deleteExchange(exchange);
    await channel.close();
  } finally {
    await connection.close();
  }
}

export async function listBrokerObjects(prefix: string): Promise<{ queues: string[]; exchanges: string[] }> {
  const { execFile } = await import('node:child_process');
  const run = (args: string[]) =>
    new Promise<string[]>((resolve, reject) =>
      execFile('rabbitmqctl', [...args, '-q', '--no-table-headers'], (error, stdout) =>
        error ? reject(error) : resolve(stdout.split('\n').map((line) => line.trim()).filter((name) => name.startsWith(`${prefix}.`))),
      ),
    );
  return { queues: await run(['list_queues', 'name']), exchanges: await run(['list_exchanges', 'name']) };
}
