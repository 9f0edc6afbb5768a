import { Command, Option } from 'commander';
import { requirePolicy } from '../../shared/config/policies';
import { auditFindByKey, auditFindByRun } from '../../shared/db/queries/audit';
import { context, UsageError, withPool } from './common';
import { printResult, table } from './output';
import { resolveRunId, runIdArgument } from './run-id';

const COLUMNS = ['policy', 'key', 'observedExpiry', 'deletedAt', 'runId', 'batchId', 'policyVersion', 'outcome'];

/** `reaper audit`: was this deleted, when, by which run and which version of the rule. */
export function registerAuditCommand(program: Command): void {
  program
    .command('audit [policy]')
    .description('the audit trail: `audit <policy> --id <id>` or `audit --run <runId>`')
    .option('--id <id>', 'the key of one row or asset')
    .option('--run <runId>', 'everything a run deleted')
    .option('--limit <n>', 'at most this many entries', '1000')
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (policyName: string | undefined, options: { id?: string; run?: string; limit: string; json?: boolean }) => {
      const limit = Number(options.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > 1_000_000) throw new UsageError(`--limit: must be an integer from 1 to 1000000 (got "${options.limit}")`);
      if (options.run !== undefined && (options.id !== undefined || policyName !== undefined)) throw new UsageError('give either <policy> --id <id>, or --run <runId>');
      if (options.run === undefined && (options.id === undefined || policyName === undefined)) throw new UsageError('give <policy> --id <id>, or --run <runId>');
      const runArgument = options.run === undefined ? null : runIdArgument('--run', options.run);
      const { env, policies } = context();
      if (policyName !== undefined) requirePolicy(policies, policyName);
      let runId: string | null = null;
      const result = await withPool(env, async (pool) => {
        if (runArgument === null) return { entries: await auditFindByKey(pool, policyName!, options.id!, limit), total: null };
        runId = await resolveRunId(pool, runArgument);
        return auditFindByRun(pool, runId, limit);
      });
      const found = result.entries.length > 0;
      printResult(!!options.json, options.run !== undefined ? result : { deleted: found, entries: result.entries }, () =>
        found
          ? `${table(result.entries, COLUMNS)}${result.total !== null && result.total > result.entries.length ? `\n(${result.entries.length} of ${result.total})` : ''}`
          : options.run !== undefined
            ? `run ${runId} deleted nothing that was audited`
            : `no audited deletion of ${policyName} ${options.id}`,
      );
      // "Not found" is an answer: exit 1 so a script can branch on it.
      if (!found) process.exitCode = 1;
    });
}
