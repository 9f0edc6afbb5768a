import { hostname, userInfo } from 'node:os';
import { loadEnv, type Env } from '../../shared/config/env';
import { loadPolicies, type PolicySet } from '../../shared/config/policies';
import { makePool, type Pool } from '../../shared/db/pool';
import { clockCheckCutoff } from '../../shared/db/queries/clock';
import { explainDatabaseError } from './connections';

/** What every command group of the CLI shares: usage errors, configuration, a short-lived pool. */

/** A user mistake on the command line: message only, exit code 2. */
export class UsageError extends Error {}

/** Something asked for does not exist (a run id, say): message only, exit code 1, as for grep. */
export class NotFoundError extends Error {}

/** ISO 8601 with a time zone, up to microseconds: what `--cutoff` and `--until` accept. */
export const ISO_INPUT = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$/;

export function context(): { env: Env; policies: PolicySet } {
  const env = loadEnv();
  return { env, policies: loadPolicies(env.policiesPath) };
}

/**
 * A short-lived pool for one command. A failure to connect is said naming DATABASE_URL and where it
 * points, a missing reaper table naming the database to migrate (connections.ts).
 */
export async function withPool<T>(env: Env, work: (pool: Pool) => Promise<T>): Promise<T> {
  const pool = makePool(env.databaseUrl, 2, 'reaper-cli', env.sessionTimeouts);
  try {
    return await work(pool);
  } catch (error) {
    throw explainDatabaseError(env.databaseUrl, error);
  } finally {
    await pool.end();
  }
}

/**
 * A cutoff given on the command line, checked against the DATABASE clock: a cutoff can only narrow
 * what is eligible, so one later than now (a typo of a year would delete live data) is a usage
 * error naming `option`. Returns it in the microsecond form batches carry.
 */
export async function pastCutoff(pool: Pool, cutoff: string, option = '--cutoff'): Promise<string> {
  if (!ISO_INPUT.test(cutoff)) throw new UsageError(`${option}: "${cutoff}" is not an ISO 8601 timestamp with a time zone`);
  const checked = await clockCheckCutoff(pool, cutoff).catch((error: { code?: string; message: string }) => {
    if (String(error.code).startsWith('22')) throw new UsageError(`${option}: "${cutoff}" is not a valid timestamp (${error.message})`);
    throw error;
  });
  if (checked.inFuture) {
    throw new UsageError(`${option}: ${checked.cutoff} is later than the database clock (${checked.now}); only the past can be looked at`);
  }
  return checked.cutoff;
}

/** Who placed a hold or decided on a run: REAPER_OPERATOR, else the user on this host. */
export function operatorName(): string {
  if (process.env.REAPER_OPERATOR) return process.env.REAPER_OPERATOR;
  try {
    return `${userInfo().username}@${hostname()}`;
  } catch {
    return `unknown@${hostname()}`; // no passwd entry for this uid (a container): the host still says where
  }
}

