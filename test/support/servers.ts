import pg from 'pg';
import amqp from 'amqplib';

/**
 * Finds the PostgreSQL and RabbitMQ the tests use, in this order: DATABASE_URL / AMQP_URL, then the
 * local default ports, then testcontainers when a Docker engine answers; otherwise it fails with a
 * message that says how to start them. Never a mock.
 */
export interface Servers {
  /** Admin connection URL (any database); test databases are made beside it. */
  databaseUrl: string;
  amqpUrl: string;
}

const LOCAL_DATABASE = 'postgres://postgres@127.0.0.1:5432/postgres';
const LOCAL_AMQP = 'amqp://guest:guest@127.0.0.1:5672';

let found: Promise<Servers> | null = null;

export function findServers(): Promise<Servers> {
  found ??= locate();
  return found;
}

/**
 * The servers already running (DATABASE_URL / AMQP_URL, or the local ports), never a container:
 * for the sweeper, which has nothing to sweep on servers a run starts fresh.
 */
export async function findRunningServers(): Promise<Servers | undefined> {
  const databaseUrl = process.env.DATABASE_URL ?? ((await postgresAnswers(LOCAL_DATABASE)) ? LOCAL_DATABASE : undefined);
  const amqpUrl = process.env.AMQP_URL ?? ((await rabbitAnswers(LOCAL_AMQP)) ? LOCAL_AMQP : undefined);
  return databaseUrl && amqpUrl ? { databaseUrl, amqpUrl } : undefined;
}

async function locate(): Promise<Servers> {
  const databaseUrl = process.env.DATABASE_URL ?? ((await postgresAnswers(LOCAL_DATABASE)) ? LOCAL_DATABASE : await startPostgresContainer());
  const amqpUrl = process.env.AMQP_URL ?? ((await rabbitAnswers(LOCAL_AMQP)) ? LOCAL_AMQP : await startRabbitContainer());
  return { databaseUrl, amqpUrl };
}

async function postgresAnswers(url: string): Promise<boolean> {
  const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 2000 });
  try {
    await client.connect();
    await client.query('SELECT 1');
    return true;
  } catch {
    return false; // not there: try the next way
  } finally {
    await client.end().catch(() => undefined);
  }
}

async function rabbitAnswers(url: string): Promise<boolean> {
  try {
    const connection = await amqp.connect(url, { timeout: 2000 });
    await connection.close();
    return true;
  } catch {
    return false; // not there: try the next way
  }
}

const HOW_TO_START = `Start the servers the tests need:
  PostgreSQL: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start   (or set DATABASE_URL)
  RabbitMQ:   rabbitmq-server -detached                                                   (or set AMQP_URL)
or make a Docker engine reachable so testcontainers can start them.`;

async function dockerAvailable(): Promise<boolean> {
  try {
    const { getContainerRuntimeClient } = await import('testcontainers');
    await getContainerRuntimeClient();
    return true;
  } catch {
    return false; // no Docker engine: the caller explains how to start the servers instead
  }
}

async function startPostgresContainer(): Promise<string> {
  if (!(await dockerAvailable())) throw new Error(`PostgreSQL does not answer at ${LOCAL_DATABASE} and no Docker engine is reachable.\n${HOW_TO_START}`);
  const { GenericContainer, Wait } = await import('testcontainers');
  const container = await new GenericContainer('postgres:15')
    .withEnvironment({ POSTGRES_HOST_AUTH_METHOD: 'trust' })
    .withExposedPorts(5432)
    .withWaitStrategy(Wait.forLogMessage(/database system is ready to accept connections/, 2))
    .start();
  return `postgres://postgres@${container.getHost()}:${container.getMappedPort(5432)}/postgres`;
}

async function startRabbitContainer(): Promise<string> {
  if (!(await dockerAvailable())) throw new Error(`RabbitMQ does not answer at ${LOCAL_AMQP} and no Docker engine is reachable.\n${HOW_TO_START}`);
  const { GenericContainer, Wait } = await import('testcontainers');
  const container = await new GenericContainer('rabbitmq:3.10')
    .withExposedPorts(5672)
    .withWaitStrategy(Wait.forLogMessage(/Server startup complete/))
    .start();
  return `amqp://guest:guest@${container.getHost()}:${container.getMappedPort(5672)}`;
}
