import { Command, Option } from 'commander';
import { runsApprove, runsGetSummary, runsReject } from '../../shared/db/queries/runs';
import { context, operatorName, UsageError, withPool } from './common';
import { printResult } from './output';
import { resolveRunId, runIdArgument } from './run-id';

/**
 * `reaper approve <runId>` / `reaper reject <runId>`: the operator's answer to the blast-radius
 * brake. Approve sends the run on with its original cutoff, bounded by the count it was held with
 * (docs/design.md invariant 16); reject ends it with nothing more published.
 */
export function registerApprovalCommands(program: Command): void {
  for (const verb of ['approve', 'reject'] as const) {
    const command = program.command(`${verb} <runId>`);
    // Only approve takes a count: a rejection of whatever was counted is always safe.
    if (verb === 'approve') {
      command.option('--expect <count[@hold]>', 'approve only if the run still awaits approval for this count, and with @hold for that very hold (as `reaper run` shows it: 130@2)');
    }
    command
      .description(
        verb === 'approve'
          ? 'let a run held by the brake (awaiting-approval) go on, with its original cutoff'
          : 'end a run held by the brake (awaiting-approval); it deletes nothing',
      )
      .addOption(new Option('--json', 'print machine-readable JSON'))
      .action(async (given: string, options: { json?: boolean; expect?: string }) => {
        const id = runIdArgument('runId', given);
        const expectation = options.expect === undefined ? null : /^(\d+)(?:@(\d+))?$/.exec(options.expect);
        if (options.expect !== undefined && !expectation) throw new UsageError(`--expect: must be a count, or count@hold as \`reaper run\` shows it (got "${options.expect}")`);
        const expected = expectation ? Number(expectation[1]) : null;
        const expectedHold = expectation?.[2] !== undefined ? Number(expectation[2]) : null;
        const { env } = context();
        await withPool(env, async (pool) => {
          const runId = await resolveRunId(pool, id);
          const decided = verb === 'approve' ? await runsApprove(pool, runId, operatorName(), expected, expectedHold) : await runsReject(pool, runId, operatorName());
          if (!decided) {
            const run = await runsGetSummary(pool, runId);
            const why = !run
              ? `no run ${runId}`
              : run.state === 'awaiting-approval'
                ? `run ${runId} awaits approval for ${run.countedCandidates}@${run.holdCount} (candidates@hold), not ${options.expect}: look again (reaper run ${runId})`
                : `run ${runId} is ${run.state}, not awaiting approval`;
            process.stderr.write(`reaper: ${why}\n`);
            process.exitCode = 1;
            return;
          }
          printResult(!!options.json, decided, () =>
            verb === 'approve'
              ? `run ${runId} approved for ${decided.approvedCandidates} candidates (plus limits.approvalTolerance) under policy version ${decided.approvedPolicyVersion}: a scheduler executes it with cutoff ${decided.cutoff}; past that count it waits for another decision`
              : `run ${runId} rejected: nothing more of it is published (it published ${decided.candidates} candidates before)`,
          );
        });
      });
  }
}
