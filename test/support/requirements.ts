import { accessSync, appendFileSync, constants } from 'node:fs';
import path from 'node:path';
import type { TestContext } from 'node:test';
import pg from 'pg';

/**
 * What a few tests need from the machine beyond PostgreSQL and RabbitMQ. `npm test` must pass on a
 * fresh machine with only those two running: a test whose tool is missing is skipped with one line
 * saying what is missing and the command that provides it. CI (.ci/run) installs everything and
 * sets REAPER_TEST_REQUIRE_ALL=1, which turns each such skip into a failure: CI never skips silently.
 */
export interface Requirement {
  /** What the test needs, as the skip line says it. */
  what: string;
  /** Undefined when present; otherwise why not and the exact command that provides it. */
  missing(): Promise<string | undefined>;
}

/** The executable's path if `name` is on PATH (or in one of `extraDirs`). */
export function findExecutable(name: string, extraDirs: readonly string[] = []): string | undefined {
  for (const dir of [...extraDirs, ...(process.env.PATH ?? '').split(path.delimiter)]) {
    if (!dir) continue;
    const candidate = path.join(dir, name);
    try {
      accessSync(candidate, constants.X_OK);
      return candidate;
    } catch {
      // not here: the next directory
    }
  }
  return undefined;
}

export const PROMETHEUS: Requirement = {
  what: 'the `prometheus` server (Debian package)',
  missing: async () => (findExecutable('prometheus') ? undefined : '`prometheus` is not on PATH; install it with: apt-get install -y prometheus'),
};

/** Where Debian (and a source build) keep PostgreSQL's server programs, which are not on PATH. */
export const POSTGRES_BIN_DIRS = ['/usr/lib/postgresql/15/bin', '/usr/local/pgsql/bin'];

/** `pgbench` (Debian: in the postgresql-15 package, beside the server's programs; elsewhere on PATH). */
export const PGBENCH: Requirement = {
  what: '`pgbench` (an application whose rate does not depend on the test process)',
  missing: async () => (findExecutable('pgbench', POSTGRES_BIN_DIRS) ? undefined : '`pgbench` not found; install it with: apt-get install -y postgresql-15'),
};

/**
 * A streaming standby made on this machine (test/support/standby.ts): the server's programs, and
 * a pg_hba.conf entry that lets `pg_basebackup` connect for replication from 127.0.0.1 (the `all`
 * database keyword does not cover replication). Tried for real: a replication connection.
 */
export function streamingStandby(primaryUrl: string): Requirement {
  return {
    what: 'a local streaming standby (pg_basebackup, and replication allowed from 127.0.0.1 in pg_hba.conf)',
    missing: async () => {
      const absent = ['pg_basebackup', 'pg_ctl'].filter((tool) => !findExecutable(tool, POSTGRES_BIN_DIRS));
      if (absent.length > 0) return `${absent.join(' and ')} not found; install them with: apt-get install -y postgresql-15`;
      const url = new URL(primaryUrl);
      const client = new pg.Client({ connectionString: primaryUrl, replication: true, connectionTimeoutMillis: 5_000 } as pg.ClientConfig);
      client.on('error', () => undefined); // a refused connection is the answer, read from connect() below
      try {
        await client.connect();
        return undefined;
      } catch (error) {
        const hba = await hbaFile(primaryUrl);
        return (
          `a replication connection to ${url.hostname}:${url.port || 5432} is refused (${(error as Error).message}); allow it with: ` +
          `echo 'host replication all 127.0.0.1/32 trust' >> ${hba} && psql -h ${url.hostname} -U ${decodeURIComponent(url.username || 'postgres')} -c 'SELECT pg_reload_conf()'`
        );
      } finally {
        await client.end().catch(() => undefined); // never connected: nothing to close
      }
    },
  };
}

async function hbaFile(primaryUrl: string): Promise<string> {
  const client = new pg.Client({ connectionString: primaryUrl });
  try {
    await client.connect();
    return (await client.query<{ hba_file: string }>('SHOW hba_file')).rows[0]!.hba_file;
  } catch {
    return '"$(psql -Atc \'SHOW hba_file\')"'; // not allowed to read it: the command finds it
  } finally {
    await client.end().catch(() => undefined);
  }
}

/** True when REAPER_TEST_REQUIRE_ALL=1: a missing tool fails the test instead of skipping it. */
export function requireAll(env: NodeJS.ProcessEnv = process.env): boolean {
  return env.REAPER_TEST_REQUIRE_ALL === '1';
}

/**
 * At the start of a test: true when every requirement is met. Otherwise the test is skipped with
 * one line (and the line is recorded for test/run.js's summary) and false is returned, so the test
 * returns at once; with REAPER_TEST_REQUIRE_ALL=1 it throws instead.
 */
export async function requireTool(t: TestContext, ...requirements: Requirement[]): Promise<boolean> {
  for (const requirement of requirements) {
    const missing = await requirement.missing();
    if (missing === undefined) continue;
    const line = `needs ${requirement.what}: ${missing}`;
    if (requireAll()) throw new Error(`${line} (REAPER_TEST_REQUIRE_ALL=1: a missing tool is a failure)`);
    t.skip(line);
    if (process.env.REAPER_TEST_SKIP_LOG) appendFileSync(process.env.REAPER_TEST_SKIP_LOG, `${t.name}: ${line}\n`);
    return false;
  }
  return true;
}
