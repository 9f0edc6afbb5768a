import { randomBytes } from 'node:crypto';
import { readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { deleteBrokerNames, listBrokerObjects, type BrokerObjects } from './broker';
import { OWNER_ENV, processStartTicks } from './processes';
import { findRunningServers, type Servers } from './servers';

/**
 * A test file that is SIGKILLed runs none of its clean-up: its database, broker queues, standby
 * (a running PostgreSQL with a replication slot on the primary) and services stay. test/run.js
 * calls sweepLeftovers() once before a run; it removes what earlier runs left, and only what is
 * older than an hour: test files of other runs on the same servers may be running right now.
 *
 * Age: the names carry their creation time (stampedSuffix(): base-36 milliseconds, then random
 * hex), so it is read from the name. Of names made before the stamp, a database is judged by its
 * directory's creation time; an unstamped queue, exchange or slot has no age to read and is left.
 * Processes: a service started by a test (marked with REAPER_TEST_OWNER) whose test process is
 * gone, by its own start time; a standby by the age of its folder.
 */
export const SWEEP_AGE_MS = 60 * 60 * 1000;

/** `<time base-36, 8 characters><6 hex>`: unique, and it says when it was made. */
export function stampedSuffix(now = Date.now()): string {
  return `${now.toString(36).padStart(8, '0')}${randomBytes(3).toString('hex')}`;
}

/** The creation time in a name made with stampedSuffix(), if it holds one (a plausible one: 2020 to tomorrow). */
export function stampOf(name: string): number | undefined {
  for (const match of name.matchAll(/(?:^|[-_.])([0-9a-z]{8})[0-9a-f]{6}(?=$|[-_.])/g)) {
    const at = parseInt(match[1]!, 36);
    if (at > Date.UTC(2020, 0, 1) && at < Date.now() + 86_400_000) return at;
  }
  return undefined;
}

export interface SweepOptions {
  /** Only what is older than this is removed (tests of the sweeper pass 0). */
  olderThanMs?: number;
  /** Only names (database, broker prefix, slot, folder, service prefix) containing this (tests of the sweeper). */
  scope?: string;
  servers?: Servers;
}

export interface SweepReport {
  processes: string[];
  standbys: string[];
  slots: string[];
  databases: string[];
  roles: string[];
  brokerObjects: string[];
  folders: string[];
  /** What could not be looked at (and why): the sweep goes on without it. */
  skipped: string[];
}

export async function sweepLeftovers(options: SweepOptions = {}): Promise<SweepReport> {
  const olderThanMs = options.olderThanMs ?? SWEEP_AGE_MS;
  const inScope = (name: string) => options.scope === undefined || name.includes(options.scope);
  const old = (at: number | undefined) => at !== undefined && Date.now() - at >= olderThanMs;
  const report: SweepReport = { processes: [], standbys: [], slots: [], databases: [], roles: [], brokerObjects: [], folders: [], skipped: [] };
  const servers = options.servers ?? (await findRunningServers());
  if (!servers) return { ...report, skipped: ['the servers: none is running yet (a run on fresh containers has nothing to sweep)'] };
  const step = async (what: string, action: () => Promise<void> | void) => {
    try {
      await action();
    } catch (error) {
      report.skipped.push(`${what}: ${(error as Error).message}`);
    }
  };
  // Services first (they hold connections and consumers), then standbys (they hold their slot).
  await step('processes', () => killOrphanedServices(report, inScope, old));
  await step('folders', () => removeTestFolders(report, inScope, old));
  const admin = new pg.Client({ connectionString: servers.databaseUrl });
  await step('PostgreSQL', async () => {
    await admin.connect();
    try {
      await dropSlots(admin, report, inScope, old);
      await dropDatabases(admin, report, inScope, old);
      await dropTestRoles(admin, report, inScope, old);
    } finally {
      await admin.end();
    }
  });
  await step('broker', () => deleteBrokerLeftovers(servers.amqpUrl, report, inScope, old));
  return report;
}

/** One line per kind of thing removed (for test/run.js). */
export function describeSweep(report: SweepReport): string[] {
  // Broker objects by prefix: a prefix has a few dozen.
  const prefixes = [...new Set(report.brokerObjects.map((name) => name.split('.')[0]!))].map((prefix) => `${prefix}.* (${report.brokerObjects.filter((name) => name.startsWith(`${prefix}.`)).length})`);
  const lines = (['processes', 'standbys', 'slots', 'databases', 'roles', 'folders'] as const)
    .filter((kind) => report[kind].length > 0)
    .map((kind) => `removed leftovers of an earlier run (${kind}): ${report[kind].join(', ')}`);
  if (prefixes.length > 0) lines.push(`removed leftovers of an earlier run (queues and exchanges): ${prefixes.join(', ')}`);
  return [...lines, ...report.skipped.map((line) => `leftover sweep could not look at ${line}`)];
}

type Filter = (name: string) => boolean;
type Age = (at: number | undefined) => boolean;

function procEnv(pid: number): Map<string, string> {
  const entries = readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0').filter(Boolean);
  return new Map(entries.map((entry) => [entry.slice(0, entry.indexOf('=')), entry.slice(entry.indexOf('=') + 1)]));
}

/** When a process started (ms since the epoch), from its start ticks and the boot time. */
function startedAt(pid: number): number | undefined {
  const ticks = processStartTicks(pid);
  if (ticks === undefined) return undefined;
  const boot = Number(/^btime (\d+)$/m.exec(readFileSync('/proc/stat', 'utf8'))![1]);
  return boot * 1000 + ticks * 10; // USER_HZ is 100 on Linux
}

/**
 * A service whose test process is gone: marked `REAPER_TEST_OWNER=<pid>/<start ticks>` (the owner
 * is gone when no process has that pid and start time), or, started before the mark, a reaper
 * process of a test bed (prefix `test-`) that init adopted. Frozen (SIGSTOPped) ones included:
 * SIGCONT, then SIGKILL to its group.
 */
function killOrphanedServices(report: SweepReport, inScope: Filter, old: Age): void {
  for (const entry of readdirSync('/proc')) {
    const pid = Number(entry);
    if (!Number.isInteger(pid) || pid === process.pid) continue;
    let env: Map<string, string>;
    let ppid: number;
    try {
      env = procEnv(pid);
      const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
      ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
    } catch {
      continue; // gone, or not ours to read
    }
    const owner = env.get(OWNER_ENV);
    const prefix = env.get('REAPER_AMQP_PREFIX') ?? '';
    const orphaned = owner
      ? (() => {
          const [ownerPid, ownerTicks] = owner.split('/').map(Number);
          return processStartTicks(ownerPid!) !== ownerTicks;
        })()
      : prefix.startsWith('test-') && ppid === 1;
    if (!orphaned || !inScope(prefix || owner || '') || !old(startedAt(pid))) continue;
    for (const signal of ['SIGCONT', 'SIGKILL'] as const) {
      try {
        process.kill(-pid, signal); // it leads its group (spawnOwned)
      } catch {
        try {
          process.kill(pid, signal); // not a group leader (started before spawnOwned)
        } catch {
          // already gone
        }
      }
    }
    report.processes.push(`${pid} (${prefix || owner})`);
  }
}

/** Folders the tests make under the temp directory: `reaper-test-<what>-...` (a standby's holds its data directory). */
function removeTestFolders(report: SweepReport, inScope: Filter, old: Age): void {
  for (const entry of readdirSync(tmpdir())) {
    if (!entry.startsWith('reaper-test-') || !inScope(entry)) continue;
    const folder = path.join(tmpdir(), entry);
    let modified: number;
    try {
      modified = statSync(folder).mtimeMs;
    } catch {
      continue; // removed meanwhile
    }
    if (!old(stampOf(entry) ?? modified)) continue;
    const postmaster = postmasterPid(path.join(folder, 'data'));
    if (postmaster !== undefined) {
      stopPostmaster(postmaster);
      report.standbys.push(`${entry} (postmaster ${postmaster})`);
    }
    rmSync(folder, { recursive: true, force: true });
    report.folders.push(entry);
  }
}

/** The running postmaster of a data directory, if any (first line of postmaster.pid, and alive). */
export function postmasterPid(data: string): number | undefined {
  try {
    const pid = Number(readFileSync(path.join(data, 'postmaster.pid'), 'utf8').split('\n')[0]);
    process.kill(pid, 0);
    return pid;
  } catch {
    return undefined; // not started, or stopped
  }
}

/** Immediate shutdown (SIGQUIT), then SIGKILL if it is still there after 10 s; synchronous (used in exit handlers). */
export function stopPostmaster(pid: number): void {
  const alive = () => {
    try {
      process.kill(pid, 0);
      return true;
    } catch {
      return false;
    }
  };
  try {
    process.kill(pid, 'SIGQUIT');
  } catch {
    return; // already gone
  }
  const deadline = Date.now() + 10_000;
  const pause = new Int32Array(new SharedArrayBuffer(4));
  while (alive() && Date.now() < deadline) Atomics.wait(pause, 0, 0, 50);
  if (alive()) process.kill(pid, 'SIGKILL');
}

/**
 * Drops a replication slot, ending the walsender that still holds it (its standby is stopped or
 * gone). One statement: the standby's exit handler runs it through psql.
 */
export function dropSlotSql(name: string): string {
  const literal = `'${name.replace(/'/g, "''")}'`;
  return `DO $$
DECLARE deadline timestamptz := clock_timestamp() + interval '10 seconds';
BEGIN
  LOOP
    PERFORM pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = ${literal} AND active_pid IS NOT NULL;
    EXIT WHEN NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = ${literal} AND active) OR clock_timestamp() > deadline;
    PERFORM pg_sleep(0.1);
  END LOOP;
  PERFORM pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ${literal};
END $$`;
}

async function dropSlots(admin: pg.Client, report: SweepReport, inScope: Filter, old: Age): Promise<void> {
  const slots = await admin.query<{ slot_name: string }>(`SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'reaper\\_standby\\_%'`);
  for (const { slot_name: name } of slots.rows) {
    if (!inScope(name) || !old(stampOf(name))) continue;
    await admin.query(dropSlotSql(name));
    report.slots.push(name);
  }
}

/** Test databases; one made before the stamp by its directory's creation time (superuser only: otherwise left). */
async function dropDatabases(admin: pg.Client, report: SweepReport, inScope: Filter, old: Age): Promise<void> {
  const databases = await admin.query<{ datname: string; oid: number }>(`SELECT datname, oid FROM pg_database WHERE datname LIKE 'reaper\\_test\\_%'`);
  for (const { datname: name, oid } of databases.rows) {
    if (!inScope(name)) continue;
    let at = stampOf(name);
    if (at === undefined) {
      at = await admin
        .query<{ made: Date }>(`SELECT (pg_stat_file('base/' || $1::text || '/PG_VERSION')).modification AS made`, [oid])
        .then((result) => result.rows[0]!.made.getTime(), () => undefined); // not allowed to read the data directory
    }
    if (!old(at)) continue;
    await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(name)} WITH (FORCE)`);
    report.databases.push(name);
  }
}

/**
 * The roles of as-deployed test beds (`reaper_t_<role>_<suffix>`, testbed.ts), by their age. After
 * the databases: what they owned went with them. A role that still owns something elsewhere is
 * left (reported as skipped), never forced.
 */
async function dropTestRoles(admin: pg.Client, report: SweepReport, inScope: Filter, old: Age): Promise<void> {
  const roles = await admin.query<{ rolname: string }>(`SELECT rolname FROM pg_roles WHERE rolname LIKE 'reaper\\_t\\_%'`);
  for (const { rolname: name } of roles.rows) {
    if (!inScope(name) || !old(stampOf(name))) continue;
    try {
      await admin.query(`DROP ROLE IF EXISTS ${pg.escapeIdentifier(name)}`);
      report.roles.push(name);
    } catch (error) {
      report.skipped.push(`role ${name}: ${(error as Error).message}`);
    }
  }
}

/** Queues and exchanges of stamped test prefixes (`test-<label>-<suffix>[-<more>].<...>`), by their age. */
async function deleteBrokerLeftovers(amqpUrl: string, report: SweepReport, inScope: Filter, old: Age): Promise<void> {
  const listed = await listBrokerObjects(amqpUrl);
  if (!listed) throw new Error('neither the management API nor rabbitmqctl answers: broker objects are not listed');
  const leftover = (name: string) => {
    const prefix = name.split('.')[0]!;
    return prefix.startsWith('test-') && inScope(prefix) && old(stampOf(prefix));
  };
  const doomed: BrokerObjects = { queues: listed.queues.filter(leftover), exchanges: listed.exchanges.filter(leftover) };
  await deleteBrokerNames(amqpUrl, doomed);
  report.brokerObjects.push(...doomed.queues, ...doomed.exchanges);
}
