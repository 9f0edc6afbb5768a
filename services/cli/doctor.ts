import { Command, Option } from 'commander';
import { connectBroker, explainDatabaseError } from './connections';
import { assertSchemaCurrent } from '../../shared/db/migrate';
import { DEFAULT_DB_ROLE_NAMES, neededPrivileges, privilegesMissing, type NeededPrivilege } from '../../shared/db/queries/roles';
import { quoteIdentifier } from '../../shared/db/pool';
import { loadEnv } from '../../shared/config/env';
import { loadPolicies, type PolicySet } from '../../shared/config/policies';
import { withPool } from './common';
import { brokerPermissionFindings, windowFindings, type Finding } from './doctor-checks';
import { printResult } from './output';

/**
 * `reaper doctor` (issue 40 item 9): after a deploy, one command that checks what the services of
 * this policies file need, as the roles the deployment uses, and prints each finding with its fix:
 * the database answers and its schema is current; every privilege `reaper roles --print` grants
 * for these policies is held by the role it names (table privileges, pg_read_all_stats where an
 * adaptive policy or a brake reads server statistics); the broker answers and each service's
 * broker user holds the permissions `reaper topology --definitions` grants for the prefix; the
 * policies file is valid (a broken one is a finding naming the field, and the other checks still
 * run); each schedule window has a tick inside it and room for a batch (doctor-checks.ts). It reads
 * catalogs only (has_table_privilege, pg_has_role): any role that can connect may run it. Exit 1 on
 * any finding.
 */

export function registerDoctorCommand(program: Command): void {
  program
    .command('doctor')
    .description('check, as the deployment\'s roles, that each service can do what its policies need (grants, statistics, schema, broker); prints each finding with its fix, exit 1 on any')
    .option('--scheduler <role>', 'the scheduler\'s (and relay\'s) role', DEFAULT_DB_ROLE_NAMES.scheduler)
    .option('--worker <role>', 'the workers\' role', DEFAULT_DB_ROLE_NAMES.worker)
    .option('--operator <role>', 'the operators\' role', DEFAULT_DB_ROLE_NAMES.operator)
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (options: { scheduler: string; worker: string; operator: string; json?: boolean }) => {
      const env = loadEnv();
      const findings: Finding[] = [];
      let policies: PolicySet | null = null;
      try {
        policies = loadPolicies(env.policiesPath);
        findings.push({ check: 'policies', ok: true, detail: `${env.policiesPath}: ${policies.size} valid polic${policies.size === 1 ? 'y' : 'ies'}`, fix: null });
      } catch (error) {
        findings.push({ check: 'policies', ok: false, detail: (error as Error).message, fix: `correct the field the message names in ${env.policiesPath} (every service refuses to start with it)` });
      }
      if (policies) findings.push(...windowFindings(policies, env, new Date()));
      await withPool(env, async (pool) => {
        try {
          await pool.query('SELECT 1');
          findings.push({ check: 'database', ok: true, detail: 'DATABASE_URL answers', fix: null });
        } catch (error) {
          findings.push({ check: 'database', ok: false, detail: (explainDatabaseError(env.databaseUrl, error) as Error).message, fix: 'set DATABASE_URL to the database the services use' });
          return;
        }
        try {
          await assertSchemaCurrent(pool);
          findings.push({ check: 'schema', ok: true, detail: 'migrations current', fix: null });
        } catch (error) {
          findings.push({ check: 'schema', ok: false, detail: (error as Error).message, fix: 'run `reaper migrate` as the migrator role (the migrate Job)' });
        }
        if (!policies) return; // the privileges follow from the policies: nothing to compare with
        const roles = { scheduler: options.scheduler, worker: options.worker, operator: options.operator };
        const needed = neededPrivileges(policies, roles);
        const missing = await privilegesMissing(pool, needed);
        const absentRoles = [...new Set(missing.filter((entry) => !entry.roleExists).map((entry) => entry.role))];
        for (const role of absentRoles) {
          findings.push({ check: `role ${role}`, ok: false, detail: `role "${role}" does not exist`, fix: 'apply `reaper roles --print` (as a superuser), or name the roles you use with --scheduler/--worker/--operator' });
        }
        for (const entry of missing.filter((item) => item.roleExists)) {
          const what = describeNeeded(entry);
          findings.push({
            check: `${entry.purpose} ${what.check}`,
            ok: false,
            detail: entry.tableExists ? `role "${entry.role}" (${entry.purpose}) lacks ${what.lacks}: ${entry.why}` : `table ${entry.table} does not exist (${entry.why})`,
            fix: entry.tableExists ? `${what.grant} (or re-apply \`reaper roles --print\`)` : 'create the policy\'s table, or fix the policy\'s `table`',
          });
        }
        const checked = needed.length - missing.length;
        if (absentRoles.length === 0) findings.push({ check: 'privileges', ok: missing.length === 0, detail: `${checked} of ${needed.length} privileges the policies need are granted`, fix: null });
      });
      try {
        const connection = await connectBroker(env);
        await connection.close();
        findings.push({ check: 'broker', ok: true, detail: 'AMQP_URL answers', fix: null });
        findings.push(...(await brokerPermissionFindings(env)));
      } catch (error) {
        findings.push({ check: 'broker', ok: false, detail: (error as Error).message, fix: 'set AMQP_URL (and the broker user\'s permissions: `reaper topology --definitions`)' });
      }
      const failed = findings.filter((finding) => !finding.ok);
      printResult(!!options.json, { ok: failed.length === 0, findings }, () =>
        [
          ...findings.map((finding) => `${finding.skipped ? 'skip' : finding.ok ? 'ok  ' : 'FAIL'}  ${finding.check}: ${finding.detail}${finding.fix ? `\n      fix: ${finding.fix}` : ''}`),
          failed.length === 0 ? 'all checks passed' : `${failed.length} finding(s)`,
        ].join('\n'),
      );
      if (failed.length > 0) process.exitCode = 1;
    });
}

/** A missing privilege as doctor names it: the check, what the role lacks, and the GRANT that fixes it. */
function describeNeeded(entry: NeededPrivilege & { owner: string | null }): { check: string; lacks: string; grant: string } {
  const role = quoteIdentifier(entry.role);
  if (entry.privilege === 'MEMBER') return { check: entry.table, lacks: `membership in ${entry.table}`, grant: `GRANT ${entry.table} TO ${role};` };
  if (entry.privilege === 'OWNER') {
    const owner = entry.owner ?? '<owner>';
    return { check: `member of ${entry.table}'s owner`, lacks: `membership in role "${owner}", the owner of ${entry.table}`, grant: `GRANT ${quoteIdentifier(owner)} TO ${role};` };
  }
  const privilege = entry.column ? `${entry.privilege} (${entry.column})` : entry.privilege;
  return { check: `${privilege} ${entry.table}`, lacks: `${privilege} on ${entry.table}`, grant: `GRANT ${privilege} ON ${entry.table} TO ${role};` };
}
