import { Command } from 'commander';
import { DEMO_POLICIES_PATH } from '../../shared/config/env';
import { requirePolicy } from '../../shared/config/policies';
import { liveViewSql } from '../../shared/db/queries/live-views';
import { policiesForRoles } from './roles';

/** Splits `--grant-to a,b` into role names (empty parts dropped). */
export function roleList(value: string): string[] {
  return value.split(',').map((role) => role.trim()).filter((role) => role.length > 0);
}

/**
 * `reaper sql live-view <policy>`: the SQL of the policy table's live view (rows reaper would
 * delete now left out), printed for review like `roles --print`; `reaper migrate --views` creates
 * the same views. Only the policies file is read: no database needs to be reachable.
 */
export function registerSqlCommands(program: Command): void {
  const sql = program.command('sql').description('print SQL derived from the policies, for review');
  sql
    .command('live-view')
    .description("print the view over a policy's table that leaves out every row reaper would delete now")
    .argument('<policy>', 'policy name')
    .option('--policies <file>', 'policies file (default: REAPER_POLICIES, else the demo policies)')
    .option('--name <view>', 'name of the view (default: <table>_live, in the table\'s schema)')
    .option('--grant-to <roles>', 'comma-separated roles that get SELECT on the view', roleList, [] as string[])
    .action((name: string, options: { policies?: string; name?: string; grantTo: string[] }) => {
      const policies = policiesForRoles(options.policies ?? process.env.REAPER_POLICIES ?? DEMO_POLICIES_PATH);
      const policy = requirePolicy(policies, name);
      process.stdout.write(liveViewSql(policies, policy.table, { viewName: options.name, grantTo: options.grantTo }));
    });
}
