import { Command } from 'commander';
import { readFileSync } from 'node:fs';
import { DEMO_POLICIES_PATH } from '../../shared/config/env';
import { ConfigError } from '../../shared/config/errors';
import { parsePolicies, type PolicySet } from '../../shared/config/policies';
import { DEFAULT_DB_ROLE_NAMES, rolesSql } from '../../shared/db/queries/roles';

/**
 * `reaper roles --print`: the SQL that creates reaper's least-privilege PostgreSQL roles and grants
 * each exactly what it needs for the policies file (REAPER_POLICIES, or --policies). Printing rather
 * than applying: a DBA reviews it, and applies it with psql as a superuser or the tables' owner.
 */
export function addRolesCommand(program: Command): void {
  program
    .command('roles')
    .description('print the SQL for the least-privilege PostgreSQL roles (migrator, scheduler, worker, operator) of a policies file')
    .requiredOption('--print', 'print the SQL to stdout (review it, then apply it with psql as a superuser)')
    .option('--policies <file>', 'policies file (default: REAPER_POLICIES, else the demo policies)')
    .option('--migrator <role>', 'role that owns reaper\'s tables', DEFAULT_DB_ROLE_NAMES.migrator)
    .option('--scheduler <role>', 'role of the scheduler', DEFAULT_DB_ROLE_NAMES.scheduler)
    .option('--worker <role>', 'role of the workers', DEFAULT_DB_ROLE_NAMES.worker)
    .option('--operator <role>', 'role of the operators running the CLI (trigger, approve, hold, ...)', DEFAULT_DB_ROLE_NAMES.operator)
    .action((options: { print: boolean; policies?: string; migrator: string; scheduler: string; worker: string; operator: string }) => {
      // Only the policies are needed: no database or broker URL has to be set to print the SQL.
      const policies = policiesForRoles(options.policies ?? process.env.REAPER_POLICIES ?? DEMO_POLICIES_PATH);
      process.stdout.write(rolesSql(policies, { migrator: options.migrator, scheduler: options.scheduler, worker: options.worker, operator: options.operator }));
    });
}

/**
 * The policies as far as grants go (tables and kinds). `${NAME}` and `${file:...}` are answered
 * with placeholders when they cannot be resolved here: a workstation printing the SQL for the
 * cluster's policies has neither the cluster's environment nor its mounted secrets.
 */
export function policiesForRoles(filePath: string): PolicySet {
  let text: string;
  try {
    text = readFileSync(filePath, 'utf8');
  } catch (error) {
    throw new ConfigError(`--policies ${filePath}: cannot read the file (${(error as Error).message})`);
  }
  const environment = new Proxy(process.env, { get: (target, key) => (typeof key === 'string' ? (target[key] ?? 'http://placeholder.invalid') : undefined) });
  return parsePolicies(text, filePath, environment, () => 'placeholder');
}
