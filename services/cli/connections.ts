import type { ChannelModel } from 'amqplib';
import type { Env } from '../../shared/config/env';
import { connectAny, splitAmqpUrls } from '../../shared/amqp/connection';

/**
 * Failures to reach a server, said so that the operator knows which variable to fix and what it
 * pointed at: "cannot connect to PostgreSQL at 127.0.0.1:5433 (database reaper, from DATABASE_URL):
 * connect ECONNREFUSED 127.0.0.1:5433". Never the password.
 */
export class ConnectionError extends Error {}

/**
 * The database has no reaper schema (or an older one without the table asked for): the advice
 * names the database, so `reaper migrate` is not run against the wrong one.
 */
export class SchemaMissingError extends Error {}

/** Where a PostgreSQL URL points, for messages: `127.0.0.1:5432 (database reaper_demo, from DATABASE_URL)`. */
export function describeDatabaseUrl(databaseUrl: string): string {
  const url = new URL(databaseUrl);
  const database = decodeURIComponent(url.pathname.slice(1)) || decodeURIComponent(url.username) || 'postgres';
  return `${url.hostname || 'localhost'}:${url.port || '5432'} (database ${database}, from DATABASE_URL)`;
}

/** Where AMQP_URL points (each URL of its list), for messages: `127.0.0.1:5672 (vhost /, from AMQP_URL)`. */
export function describeAmqpUrl(amqpUrl: string): string {
  const places = splitAmqpUrls(amqpUrl).map((value) => {
    try {
      const url = new URL(value);
      return `${url.hostname || 'localhost'}:${url.port || (url.protocol === 'amqps:' ? '5671' : '5672')}`;
    } catch {
      return '(an unparseable URL)';
    }
  });
  const vhost = (() => {
    try {
      return decodeURIComponent(new URL(splitAmqpUrls(amqpUrl)[0]!).pathname.slice(1)) || '/';
    } catch {
      return '/';
    }
  })();
  return `${places.join(', ')} (vhost ${vhost}, from AMQP_URL)`;
}

/** Socket errors (no server there, no route, no name) and PostgreSQL's refusals at connect time. */
const CONNECT_ERRNO_CODES = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH', 'ECONNRESET', 'EPIPE']);
/**
 * SQLSTATEs a server answers a connection with: class 08 (connection exception), 28 (invalid
 * authorization: no such role, wrong password, pg_hba), 3D000 (no such database), 57P03 (starting up).
 */
function isConnectSqlState(code: string): boolean {
  return code.startsWith('08') || code.startsWith('28') || code === '3D000' || code === '57P03';
}
/** pg's own words for a connection attempt that timed out (connectionTimeoutMillis). */
const CONNECT_TIMEOUT_MESSAGES = [/^timeout expired$/, /connection timeout/i];

function messageOf(error: unknown): string {
  const { message, code } = error as { message?: string; code?: string };
  return message || code || String(error);
}

/**
 * An error from a PostgreSQL pool or client, as the operator should see it: a failure to connect
 * names DATABASE_URL and where it points; a missing reaper table names the database to migrate;
 * anything else is returned as it is.
 */
export function explainDatabaseError(databaseUrl: string, error: unknown): unknown {
  if (error instanceof ConnectionError || error instanceof SchemaMissingError) return error;
  const { code, message } = error as { code?: unknown; message?: unknown };
  const text = typeof message === 'string' ? message : '';
  const connectFailure =
    (typeof code === 'string' && (CONNECT_ERRNO_CODES.has(code) || isConnectSqlState(code))) || CONNECT_TIMEOUT_MESSAGES.some((pattern) => pattern.test(text));
  if (connectFailure) return new ConnectionError(`cannot connect to PostgreSQL at ${describeDatabaseUrl(databaseUrl)}: ${messageOf(error)}`);
  // undefined_table on one of reaper's own tables (a policy's missing table is another problem).
  if (code === '42P01' && /relation "(public\.)?(cleanup_|reaper_)/.test(text)) {
    return new SchemaMissingError(
      `${text}: the database at ${describeDatabaseUrl(databaseUrl)} has no reaper schema (or an older one); run \`reaper migrate\` with this DATABASE_URL first`,
    );
  }
  return error;
}

/**
 * A one-off broker connection for a CLI command (the first of AMQP_URL's list that answers); a
 * failure names AMQP_URL and where it points, never the password.
 */
export async function connectBroker(env: Pick<Env, 'amqpUrl'>, options: Record<string, unknown> = {}): Promise<ChannelModel> {
  try {
    return await connectAny(env.amqpUrl, options);
  } catch (error) {
    throw brokerConnectionError(env.amqpUrl, error);
  }
}

/** The ConnectionError for a broker that could not be reached. */
export function brokerConnectionError(amqpUrl: string, error: unknown): ConnectionError {
  return new ConnectionError(`cannot connect to RabbitMQ at ${describeAmqpUrl(amqpUrl)}: ${messageOf(error)}`);
}
