import { Command, Option } from 'commander';
import { loadEnv } from '../../shared/config/env';
import { runsGetSummary, runsListSummaries, type RunSummary } from '../../shared/db/queries/runs';
import { NotFoundError, UsageError, withPool } from './common';
import { outputWidth, printResult, table, wrap } from './output';
import { describeRun, runRow } from './runs';

/** `reaper runs` and `reaper run <runId>`: what runs did, with their counts and reasons. */
export function registerRunListCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('runs')
    .description('list recent runs')
    .option('--policy <policy>', 'only this policy')
    .option('--limit <n>', 'how many', '20')
    .option('--wide', 'the reason as the last column, one line per run (default: wrapped under its run)')
    .addOption(json())
    .action(async (options: { policy?: string; limit: string; json?: boolean; wide?: boolean }) => {
      const env = loadEnv();
      const limit = Number(options.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > 10_000) throw new UsageError(`--limit: must be an integer from 1 to 10000 (got "${options.limit}")`);
      await withPool(env, async (pool) => {
        const runs = await runsListSummaries(pool, { policy: options.policy, limit });
        printResult(!!options.json, runs, () => runsTable(runs, !!options.wide));
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
        printResult(!!options.json, run, () => [describeRun(run), ...describeBrake(run)].join('\n'));
      });
    });
}

const RUN_COLUMNS = ['run', 'policy', 'trigger', 'state', 'cutoff', 'candidates', 'counted', 'approved', 'skipped', 'batches', 'deleted', 'noop'];

/**
 * Runs as a table. A reason (why a run failed, is incomplete, awaits approval) is never cut: by
 * default it follows its run's line, wrapped to the output's width; with `wide`, it is the last
 * column, whole, so each run stays one line (for grep).
 */
function runsTable(runs: readonly RunSummary[], wide: boolean): string {
  const rows = runs.map((run) => ({ ...runRow(run), ...brakeCounts(run) }));
  if (wide) return table(rows, [...RUN_COLUMNS, 'reason']);
  const [header, ...lines] = table(rows, RUN_COLUMNS).split('\n');
  if (runs.length === 0) return header!;
  const indent = '    ';
  return [
    header!,
    ...lines.flatMap((line, index) => {
      const reason = runs[index]!.error;
      if (reason === null) return [line];
      return [line, ...wrap(`reason: ${reason}`, outputWidth() - indent.length, 2).split('\n').map((part) => `${indent}${part}`)];
    }),
  ].join('\n');
}

/** The brake's two counts: what it counted last (published + still to publish) and what was approved. */
export function brakeCounts(run: RunSummary): { counted: number | null; approved: string | null } {
  return {
    counted: run.countedCandidates,
    approved: run.approvedCandidates === null ? null : `${run.approvedCandidates} (${run.approvedPolicyVersion ?? '?'})`,
  };
}

function describeBrake(run: RunSummary): string[] {
  if (run.countedCandidates === null && run.approvedCandidates === null) return [];
  return [
    `counted    ${run.countedCandidates ?? '-'} (the brake's latest count: published + still to publish)`,
    ...(run.state === 'awaiting-approval'
      ? [`hold       #${run.holdCount}: approve exactly this one with reaper approve ${run.runId} --expect ${run.countedCandidates ?? 0}@${run.holdCount}`]
      : []),
    `approved   ${run.approvedCandidates === null ? '-' : `${run.approvedCandidates} under policy version ${run.approvedPolicyVersion ?? '?'}${run.decidedBy ? ` by ${run.decidedBy}` : ''}`}`,
  ];
}
