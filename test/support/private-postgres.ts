import { execFile } from 'node:child_process';
import { appendFileSync, chownSync, existsSync, mkdtempSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir, userInfo } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { atTestProcessExit } from './processes';
import { POSTGRES_BIN_DIRS } from './requirements';
import { postmasterPid, stampedSuffix, stopPostmaster } from './sweeper';

const run = promisify(execFile);

/**
 * A PostgreSQL cluster of the test's own (initdb into a temporary folder, `pg_ctl` on a free port),
 * for a fault test that restarts the database: the machine's shared PostgreSQL serves every other
 * test running at the moment and is never restarted for one. Needs the server's programs
 * (`initdb`, `pg_ctl`: Debian's postgresql-15 package). PostgreSQL refuses to run as root: as
 * root, the programs run as the `postgres` user.
 *
 * Nothing survives the test process: if it exits without close(), an exit handler stops the
 * server and removes the folder; after a SIGKILL the next run's sweeper (test/support/sweeper.ts)
 * does (the folder is `reaper-test-...`, its name stamped, the data directory `<folder>/data`).
 */
export interface PrivatePostgres {
  /** Admin URL (database `postgres`, user `postgres`, trust): makeTestBed's `adminDatabaseUrl`. */
  url: string;
  port: number;
  /** `pg_ctl restart -m immediate`: every backend killed at once, crash recovery at start; resolves when it accepts connections again. */
  restartImmediately(): Promise<void>;
  close(): Promise<void>;
}

/** The folder of PostgreSQL's server programs ('' when they are on PATH). */
export function postgresBinDir(): string {
  for (const dir of POSTGRES_BIN_DIRS) if (existsSync(path.join(dir, 'pg_ctl'))) return dir;
  return '';
}

/** Runs one of PostgreSQL's server programs, as the `postgres` user when this process is root. */
export function runPostgresTool(name: string, args: readonly string[], timeoutMs = 120_000): Promise<{ stdout: string; stderr: string }> {
  const tool = postgresBinDir() ? path.join(postgresBinDir(), name) : name;
  return userInfo().uid === 0 ? run('runuser', ['-u', 'postgres', '--', tool, ...args], { timeout: timeoutMs }) : run(tool, [...args], { timeout: timeoutMs });
}

/** A folder the `postgres` user may write (as root; otherwise it is already this user's). */
export async function ownedByPostgres(dir: string): Promise<void> {
  if (userInfo().uid !== 0) return;
  chownSync(dir, Number((await run('id', ['-u', 'postgres'])).stdout.trim()), Number((await run('id', ['-g', 'postgres'])).stdout.trim()));
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

export async function startPrivatePostgres(label: string): Promise<PrivatePostgres> {
  const name = `${label}_${stampedSuffix()}`.replace(/[^a-z0-9_]/gi, '_').toLowerCase();
  const dir = mkdtempSync(path.join(tmpdir(), `reaper-test-pg-${name}-`));
  const data = path.join(dir, 'data');
  const forget = atTestProcessExit(() => {
    const postmaster = postmasterPid(data);
    if (postmaster !== undefined) stopPostmaster(postmaster);
    rmSync(dir, { recursive: true, force: true });
  });
  const port = await freePort();
  const pgCtl = (args: string[]) => runPostgresTool('pg_ctl', ['-D', data, '-w', '-t', '60', ...args], 90_000);
  const close = async () => {
    try {
      if (postmasterPid(data) !== undefined) await pgCtl(['-m', 'immediate', 'stop']).catch(() => undefined); // stopped meanwhile
    } finally {
      rmSync(dir, { recursive: true, force: true });
      forget();
    }
  };
  try {
    await ownedByPostgres(dir);
    await runPostgresTool('initdb', ['-D', data, '-U', 'postgres', '--auth=trust', '-E', 'UTF8', '--no-sync']);
    // Durability against a crash of the server process is what the tests need, not against a
    // crash of the machine: fsync off keeps a loaded machine's tests fast.
    appendFileSync(
      path.join(data, 'postgresql.conf'),
      [`port = ${port}`, `listen_addresses = '127.0.0.1'`, `unix_socket_directories = '${dir}'`, 'fsync = off', 'shared_buffers = 32MB', 'max_connections = 60', ''].join('\n'),
    );
    await pgCtl(['-l', path.join(dir, 'log'), 'start']);
  } catch (error) {
    await close();
    throw error;
  }
  return {
    url: `postgres://postgres@127.0.0.1:${port}/postgres`,
    port,
    restartImmediately: async () => void (await pgCtl(['-m', 'immediate', '-l', path.join(dir, 'log'), 'restart'])),
    close,
  };
}
