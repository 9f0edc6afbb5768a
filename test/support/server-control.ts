import { execFile } from 'node:child_process';
import { readdirSync } from 'node:fs';
import { eventually } from './eventually';
import { rabbitmqctl } from './rabbitmqctl';

/**
 * The local servers' admin tools, for the fault tests that disturb a server itself (PostgreSQL
 * restarted, the broker's memory alarm). Every disturbance has its restore, which the tests call in
 * `finally` and which waits until the server answers again. These disturb every test running on
 * the machine at the moment: the tests that use them are few, short and serial.
 */
function run(command: string, args: readonly string[], timeoutMs = 60_000): Promise<string> {
  return new Promise((resolve, reject) =>
    execFile(command, [...args], { timeout: timeoutMs }, (error, stdout, stderr) =>
      error ? reject(new Error(`${command} ${args.join(' ')} failed: ${error.message} ${stderr}`)) : resolve(stdout),
    ),
  );
}

/** The local cluster's major version (the only directory under /etc/postgresql). */
export function postgresVersion(): string {
  const versions = readdirSync('/etc/postgresql');
  if (versions.length !== 1) throw new Error(`expected one PostgreSQL cluster version in /etc/postgresql, found ${versions.join(', ')}`);
  return versions[0]!;
}

/** `pg_ctlcluster <v> main restart -m immediate`: every backend dies at once, no checkpoint (crash recovery at start). */
export async function restartPostgresImmediately(): Promise<void> {
  await run('pg_ctlcluster', ['--skip-systemctl-redirect', postgresVersion(), 'main', 'restart', '-m', 'immediate']);
}

/** Waits until PostgreSQL accepts connections, starting the cluster if it is down. */
export async function ensurePostgresUp(timeoutMs = 60_000): Promise<void> {
  const ready = () => run('pg_isready', ['-h', '127.0.0.1', '-p', '5432', '-q'], 5_000).then(() => true, () => false);
  if (await ready()) return;
  await run('pg_ctlcluster', ['--skip-systemctl-redirect', postgresVersion(), 'main', 'start']).catch(() => undefined); // "already running" while it recovers
  await eventually('PostgreSQL to accept connections', ready, { timeoutMs, intervalMs: 200 });
}

/** The broker's memory high watermark (relative). 0.0001 raises the memory alarm: every publisher is blocked. */
export async function setMemoryWatermark(fraction: number): Promise<void> {
  await rabbitmqctl(['set_vm_memory_high_watermark', String(fraction), '-q']);
}

/** The watermark back to the machine's setting (0.4), and the alarm gone. */
export async function restoreMemoryWatermark(): Promise<void> {
  await setMemoryWatermark(0.4);
  await eventually(
    'the memory alarm to clear',
    async () => !/memory/.test(await rabbitmqctl(['eval', 'rabbit_alarm:get_alarms().', '-q'])),
    { timeoutMs: 30_000, intervalMs: 200 },
  );
  await rabbitmqctl(['await_startup', '-q', '--timeout', '60'], 90_000);
}
