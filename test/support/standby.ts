import { execFile, spawnSync } from 'node:child_process';
import { appendFileSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir, userInfo } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import { eventually } from './eventually';
import { freePort, ownedByPostgres, runPostgresTool } from './private-postgres';
import { atTestProcessExit } from './processes';
import { findExecutable, POSTGRES_BIN_DIRS } from './requirements';
import { dropSlotSql, postmasterPid, stampedSuffix, stopPostmaster } from './sweeper';

const run = promisify(execFile);

/**
 * A real streaming standby of the test PostgreSQL, for the replica-lag brake: `pg_basebackup -R`
 * into a temporary directory, started with `pg_ctl` on a free port, stopped and removed by
 * `close()` (call it in `finally`). Needs the server's binaries on this machine and a pg_hba line
 * allowing replication from 127.0.0.1 (.ci/run adds it; a test checks with requireTool(t,
 * streamingStandby(url)) first). PostgreSQL refuses to run as root: as root, the commands run as
 * the `postgres` user.
 *
 * Nothing survives the test process: if it exits without close() (a signal, --test-force-exit
 * after a timeout), an exit handler stops the standby, removes its folder and drops its slot. Its
 * name and folder carry their creation time: after a SIGKILL, the next run's sweeper
 * (test/support/sweeper.ts) removes them once they are an hour old.
 */
export interface Standby {
  /** Its application_name in the primary's pg_stat_replication. */
  name: string;
  port: number;
  query<T extends pg.QueryResultRow>(sql: string): Promise<T[]>;
  pauseReplay(): Promise<void>;
  resumeReplay(): Promise<void>;
  close(): Promise<void>;
}

/** A standby's name (its slot's too: stamped, for the sweeper) and its folder, made now. */
export function standbyPlace(label: string): { name: string; dir: string } {
  const name = `reaper_standby_${label}_${stampedSuffix()}`.replace(/[^a-z0-9_]/gi, '_').toLowerCase();
  return { name, dir: mkdtempSync(path.join(tmpdir(), `reaper-test-standby-${name}-`)) };
}

/**
 * What close() does, synchronously, for an exit handler: stop the standby's server if it runs,
 * remove its folder, drop its slot (whether or not pg_basebackup got as far as making it:
 * dropSlotSql is conditional) through psql.
 */
export function removeStandbyNow(primaryUrl: string, name: string, dir: string): void {
  const postmaster = postmasterPid(path.join(dir, 'data'));
  if (postmaster !== undefined) stopPostmaster(postmaster);
  rmSync(dir, { recursive: true, force: true });
  spawnSync(findExecutable('psql', POSTGRES_BIN_DIRS) ?? 'psql', [primaryUrl, '-Atqc', dropSlotSql(name)], { timeout: 20_000, stdio: 'ignore' });
}

export async function startStandby(primaryUrl: string, label: string): Promise<Standby> {
  const primary = new URL(primaryUrl);
  const asRoot = userInfo().uid === 0;
  const exec = runPostgresTool;
  const { name, dir } = standbyPlace(label);
  const data = path.join(dir, 'data');
  const port = await freePort();
  let started = false;
  const settings = new pg.Client({ connectionString: primaryUrl });
  const forget = atTestProcessExit(() => removeStandbyNow(primaryUrl, name, dir));
  const close = async () => {
    try {
      if (started) await exec('pg_ctl', ['-D', data, '-m', 'immediate', '-w', '-t', '30', 'stop'], 60_000).catch(() => undefined); // already stopped
    } finally {
      rmSync(dir, { recursive: true, force: true });
      const admin = new pg.Client({ connectionString: primaryUrl });
      await admin.connect();
      await admin.query(dropSlotSql(name)).finally(() => admin.end());
      forget();
    }
  };
  try {
    await ownedByPostgres(dir);
    await settings.connect();
    // A hot standby needs these at least as high as on the primary.
    const values = new Map(
      (await settings.query<{ name: string; setting: string }>(
        `SELECT name, setting FROM pg_settings WHERE name IN ('max_connections', 'max_worker_processes', 'max_wal_senders', 'max_prepared_transactions', 'max_locks_per_transaction')`,
      )).rows.map((row) => [row.name, row.setting]),
    );
    // A physical slot keeps the WAL the standby still needs: without it, a busy server recycles the
    // segments written between the end of the base backup and the standby's start. Slots of earlier
    // runs that died before close() are the sweeper's (an inactive slot may be another file's
    // between its base backup and its start).
    await settings.end();
    await exec('pg_basebackup', ['-h', primary.hostname, '-p', primary.port || '5432', '-U', decodeURIComponent(primary.username || 'postgres'), '-D', data, '-R', '-X', 'stream', '-C', '-S', name, '-c', 'fast']);
    // Debian keeps postgresql.conf outside the data directory: the standby gets its own.
    const conf = [
      `port = ${port}`,
      `listen_addresses = '127.0.0.1'`,
      `unix_socket_directories = '${dir}'`,
      ...[...values].map(([key, value]) => `${key} = ${value}`),
      'shared_buffers = 16MB',
      'hot_standby = on',
      'wal_receiver_status_interval = 1s',
      `hba_file = '${data}/pg_hba.conf'`,
      `ident_file = '${data}/pg_ident.conf'`,
      `cluster_name = '${name}'`,
    ];
    writeFileSync(path.join(data, 'postgresql.conf'), `${conf.join('\n')}\n`);
    // Its name in the primary's pg_stat_replication. -R wrote primary_conninfo in
    // postgresql.auto.conf, read after postgresql.conf: the last setting there wins.
    appendFileSync(
      path.join(data, 'postgresql.auto.conf'),
      `primary_conninfo = 'host=${primary.hostname} port=${primary.port || '5432'} user=${decodeURIComponent(primary.username || 'postgres')} application_name=${name}'\nprimary_slot_name = '${name}'\n`,
    );
    writeFileSync(path.join(data, 'pg_hba.conf'), 'local all all trust\nhost all all 127.0.0.1/32 trust\n');
    writeFileSync(path.join(data, 'pg_ident.conf'), '');
    if (asRoot) await run('chown', ['-R', 'postgres:postgres', data]);
    await exec('pg_ctl', ['-D', data, '-l', path.join(dir, 'log'), '-w', '-t', '60', 'start']);
    started = true;
  } catch (error) {
    await settings.end().catch(() => undefined);
    await close();
    throw error;
  }
  const url = `postgres://postgres@127.0.0.1:${port}/postgres`;
  const query = async <T extends pg.QueryResultRow>(sql: string): Promise<T[]> => {
    const client = new pg.Client({ connectionString: url });
    await client.connect();
    try {
      return (await client.query<T>(sql)).rows;
    } finally {
      await client.end();
    }
  };
  const watcher = new pg.Client({ connectionString: primaryUrl });
  try {
    await watcher.connect();
    await eventually(`standby ${name} streaming`, async () => (await watcher.query(`SELECT 1 FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'`, [name])).rowCount === 1, { timeoutMs: 120_000 });
  } catch (error) {
    await close();
    throw error;
  } finally {
    await watcher.end().catch(() => undefined);
  }
  return {
    name,
    port,
    query,
    pauseReplay: async () => void (await query('SELECT pg_wal_replay_pause()')),
    resumeReplay: async () => void (await query('SELECT pg_wal_replay_resume()')),
    close,
  };
}
