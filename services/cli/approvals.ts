import { Command, Option } from 'commander';
import { runsApprove, runsGetSummary, runsReject } from '../../shared/db/queries/runs';
import { context, operatorName, UsageError, withPool } from './common';
import { printResult } from './output';

/**
 * `reaper approve <runId>` / `reaper reject <runId>`: the operator's answer to the blast-radius
 * brake. Approve sends the run on with its original cutoff; reject ends it with nothing deleted.
 */
export function registerApprovalCommands(program: Command): void {
  for (const verb of ['approve', 'reject'] as const) {
    program
      .command(`${verb} <runId>`)
      .description(
        verb === 'approve'
          ? 'let a run held by the brake (awaiting-approval) go on, with its original cutoff'
          : 'end a run held by the brake (awaiting-approval); it deletes nothing',
      )
      .addOption(new Option('--json', 'print machine-readable JSON'))
      .action(async (runId: string, options: { json?: boolean }) => {
        if (!/^[0-9a-f-]{36}$/i.test(runId)) throw new UsageError(`runId: "${runId}" is not a run id (uuid)`);
        const { env } = context();
        await withPool(env, async (pool) => {
          const decided = verb === 'approve' ? await runsApprove(pool, runId, operatorName()) : await runsReject(pool, runId, operatorName());
          if (!decided) {
            const run = await runsGetSummary(pool, runId);
            process.stderr.write(`reaper: ${run ? `run ${runId} is ${run.state}, not awaiting approval` : `no run ${runId}`}\n`);
            process.exitCode = 1;
            return;
          }
          printResult(!!options.json, decided, () =>
            verb === 'approve'
              ? `run ${runId} approved: a scheduler executes it with cutoff ${decided.cutoff}`
              : `run ${runId} rejected: nothing of it was published or deleted`,
          );
        });
      });
  }
}
