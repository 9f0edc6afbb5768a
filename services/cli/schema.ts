import { Command, Option } from 'commander';
import { loadEnv } from '../../shared/config/env';
import { schemaVersions, wantedSchemaVersion, type SchemaVersions } from '../../shared/db/migrate';
import { UsageError, withPool } from './common';
import { printResult } from './output';

/**
 * `reaper schema wait`: blocks until the database schema is at the version this build needs.
 *
 * Why: on Kubernetes the migrate Job and the Deployments are applied together, and a scheduler or
 * worker that starts first refuses to run on an old schema ("database schema is at version N"),
 * exits and is restarted with a growing back-off: CrashLoopBackOff for minutes after the Job is
 * done. As an init container (infra/k8s/base/scheduler.yaml, worker.yaml) this waits instead, saying
 * every few seconds what it waits for, and the service starts as soon as the migration committed.
 * Any error of a check (PostgreSQL not up yet, the role not created yet, the version table not yet
 * granted: `reaper migrate` grants it last) is a reason to wait, named in the line, not to exit:
 * only the timeout ends the wait unsuccessfully (exit 1), so a real fault still surfaces.
 */

/** "--timeout 600", "--every 0.5": a positive number of seconds, or a usage error naming the option. */
function seconds(option: string): (value: string) => number {
  return (value) => {
    if (!/^\d+(\.\d+)?$/.test(value.trim()) || !(Number(value) > 0)) throw new UsageError(`${option}: "${value}" is not a positive number of seconds`);
    return Number(value);
  };
}

/** What one check found: the versions, or why they could not be read. */
type Check = { versions: SchemaVersions } | { error: string };

/** "schema version N (database at M)", or why the database's version could not be read. */
function waitingFor(check: Check): string {
  if ('versions' in check) return `schema version ${check.versions.wanted} (database at ${check.versions.current})`;
  return `schema version ${wantedSchemaVersion()} (database not readable: ${check.error})`;
}

export function registerSchemaCommands(program: Command): void {
  const schema = program.command('schema').description('the database schema this reaper needs');
  schema
    .command('wait')
    .description('wait until the database schema is at the version this reaper needs (`reaper migrate` done); exit 1 at the timeout')
    .addOption(new Option('--timeout <seconds>', 'give up after this long').argParser(seconds('--timeout')).default(600))
    .addOption(new Option('--every <seconds>', 'time between checks, each printing what it waits for').argParser(seconds('--every')).default(5))
    .addOption(new Option('--json', 'print the versions reached as JSON'))
    .action(async (options: { timeout: number; every: number; json?: boolean }) => {
      const env = loadEnv();
      const deadline = Date.now() + options.timeout * 1000;
      const versions = await withPool(env, async (pool) => {
        for (;;) {
          const check: Check = await schemaVersions(pool).then(
            (versions) => ({ versions }),
            (error: Error) => ({ error: error.message }),
          );
          if ('versions' in check && check.versions.current >= check.versions.wanted) return check.versions;
          if (Date.now() + options.every * 1000 > deadline) {
            throw new Error(`gave up after ${options.timeout} s waiting for ${waitingFor(check)}: did the migrate Job run and succeed, and is DATABASE_URL right?`);
          }
          process.stderr.write(`waiting for ${waitingFor(check)}: ${'versions' in check ? 'is the migrate Job done?' : 'is PostgreSQL up at DATABASE_URL, and the migrate Job done?'}\n`);
          await new Promise((resolve) => setTimeout(resolve, options.every * 1000));
        }
      });
      printResult(!!options.json, versions, () => `schema at version ${versions.current} (this reaper needs ${versions.wanted}): ready`);
    });
}
