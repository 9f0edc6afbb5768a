import { execFileSync } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { cpus } from 'node:os';
import pg from 'pg';

/**
 * `--pin` (issue 18): PostgreSQL's postmaster and every backend on CPU 0, everything else (this
 * benchmark, the reaper processes it starts, RabbitMQ) on CPU 1, so the foreground figure shows
 * what a cleanup costs the database apart from reaper's own Node CPU on a 2-core machine. The one
 * exception is pgbench, the application's stand-in that measures the foreground latency: it runs on
 * CPU 0 with the database (onDatabaseCpu), else its latency would count reaper's Node processes
 * taking its CPU, the very thing pinning leaves out (a first pinned run with pgbench on CPU 1 showed
 * foreground p50 of 0.3–0.8 s: pgbench starved, not the database). Root only (it changes other
 * processes' affinity with taskset); every affinity changed is put back by the returned function,
 * backends forked meanwhile included.
 */
export interface Pinning {
  describe: string;
  restore: () => void;
}

/** Set while pinned: the CPU of the database (and of the foreground client). */
let databaseCpu: number | null = null;

/** `command args` as spawned on the database's CPU while pinned (taskset -c), unchanged otherwise. */
export function onDatabaseCpu(command: string, args: readonly string[]): [string, string[]] {
  return databaseCpu === null ? [command, [...args]] : ['taskset', ['-c', String(databaseCpu), command, ...args]];
}

const taskset = (args: string[]): string => execFileSync('taskset', args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

/** The affinity mask of a process (hex, as taskset prints it), or null when it is gone. */
function maskOf(pid: number): string | null {
  try {
    return /:\s*([0-9a-f]+)\s*$/i.exec(taskset(['-p', String(pid)]).trim())?.[1] ?? null;
  } catch {
    return null; // the process ended meanwhile: nothing to pin or restore
  }
}

function setMask(pid: number, mask: string): void {
  try {
    taskset(['-a', '-p', mask, String(pid)]);
  } catch {
    // the process ended meanwhile (a backend that disconnected): nothing to change
  }
}

function parentOf(pid: number): number | null {
  try {
    return Number(/^PPid:\s+(\d+)/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? NaN) || null;
  } catch {
    return null;
  }
}

function childrenOf(parent: number): number[] {
  return readdirSync('/proc')
    .filter((name) => /^\d+$/.test(name))
    .map(Number)
    .filter((pid) => parentOf(pid) === parent);
}

function processesNamed(command: string): number[] {
  return readdirSync('/proc')
    .filter((name) => /^\d+$/.test(name))
    .map(Number)
    .filter((pid) => {
      try {
        return readFileSync(`/proc/${pid}/comm`, 'utf8').trim() === command;
      } catch {
        return false;
      }
    });
}

/** Refuses, with the reason, unless root, taskset and two CPUs are there. */
export function assertCanPin(): void {
  if (typeof process.getuid !== 'function' || process.getuid() !== 0) throw new Error('--pin needs root: it changes the CPU affinity of the PostgreSQL server processes (taskset)');
  try {
    execFileSync('taskset', ['--version'], { stdio: 'ignore' });
  } catch {
    throw new Error('--pin needs taskset (util-linux) on PATH');
  }
  if (cpus().length < 2) throw new Error(`--pin needs at least 2 CPUs (this machine has ${cpus().length})`);
}

export async function pinDatabaseApart(adminUrl: string): Promise<Pinning> {
  assertCanPin();
  const client = new pg.Client({ connectionString: adminUrl, application_name: 'bench-pin' });
  await client.connect();
  const backend = (await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid;
  const postmaster = parentOf(backend); // while the backend still exists
  await client.end();
  if (postmaster === null) throw new Error('--pin: cannot find the PostgreSQL postmaster (is the server on this machine?)');
  const database = [postmaster, ...childrenOf(postmaster)];
  const others = [process.pid, ...processesNamed('beam.smp')];
  const saved = new Map<number, string>();
  for (const pid of [...database, ...others]) {
    const mask = maskOf(pid);
    if (mask !== null) saved.set(pid, mask);
  }
  const postmasterMask = saved.get(postmaster);
  if (postmasterMask === undefined) throw new Error('--pin: cannot read the postmaster affinity');
  for (const pid of database) setMask(pid, '1'); // CPU 0; backends forked later inherit it from the postmaster
  for (const pid of others) setMask(pid, '2'); // CPU 1; children this process spawns inherit it
  databaseCpu = 0;
  let restored = false;
  return {
    describe: `PostgreSQL (postmaster ${postmaster} and its ${database.length - 1} processes, later backends too) on CPU 0; this benchmark, its reaper processes${others.length > 1 ? ' and RabbitMQ' : ''} on CPU 1; pgbench (the foreground) on CPU 0 with the database`,
    restore: () => {
      if (restored) return;
      restored = true;
      databaseCpu = null;
      // Backends started during the run carry CPU 0 from the postmaster: they get its original mask.
      for (const pid of childrenOf(postmaster)) setMask(pid, saved.get(pid) ?? postmasterMask);
      for (const [pid, mask] of saved) setMask(pid, mask);
    },
  };
}
