import { Command, Option } from 'commander';
import { loadEnv } from '../../shared/config/env';
import { runsGetSummary, runsListSummaries } from '../../shared/db/queries/runs';
import { NotFoundError, UsageError, withPool } from './common';
import { printResult, table } from './output';
import { describeRun, runRow } from './runs';

/** `reaper runs` and `reaper run <runId>`: what runs did, with their counts and reasons. */
export function registerRunListCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('runs')
    .description('list recent runs')
    .option('--policy <policy>', 'only this policy')
    .option('--limit <n>', 'how many', '20')
    .addOption(json())
    .action(async (options: { policy?: string; limit: string; json?: boolean }) => {
      const env = loadEnv();
      const limit = Number(options.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > 10_000) throw new UsageError(`--limit: must be an integer from 1 to 10000 (got "${options.limit}")`);
      await withPool(env, async (pool) => {
        const runs = await runsListSummaries(pool, { policy: options.policy, limit });
        printResult(!!options.json, runs, () => table(runs.map(runRow), ['run', 'policy', 'trigger', 'state', 'cutoff', 'candidates', 'skipped', 'batches', 'deleted', 'noop', 'reason']));
      });
    });

  program
    .command('run <runId>')
    .description('show one run with its counts')
    .addOption(json())
    .action(async (runId: string, options: { json?: boolean }) => {
      if (!/^[0-9a-f-]{36}$/i.test(runId)) throw new UsageError(`runId: "${runId}" is not a run id (uuid)`);
      const env = loadEnv();
      await withPool(env, async (pool) => {
        const run = await runsGetSummary(pool, runId);
        if (!run) throw new NotFoundError(`no run ${runId}`);
        printResult(!!options.json, run, () => describeRun(run));
      });
    });
}
