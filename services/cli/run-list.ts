import { Command, Option } from 'commander';
import { loadEnv } from '../../shared/config/env';
import { runsGetSummary, runsListSummaries, type RunSummary } from '../../shared/db/queries/runs';
import type { Db } from '../../shared/db/pool';
import { NotFoundError, UsageError, withPool } from './common';
import { outputWidth, printResult, table, wrap } from './output';
import { resolveRunId, runIdArgument, shortRunIds } from './run-id';
import { describeRun, runRow } from './runs';

/** `reaper runs` and `reaper run <runId>`: what runs did, with their counts and reasons. */
export function registerRunListCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('runs')
    .description('list recent runs')
    .option('--policy <policy>', 'only this policy')
    .option('--limit <n>', 'how many', '20')
    .option('--wide', 'every column, whole run ids and cutoffs, the reason last: one line per run (default: 120 columns, the rest under its run)')
    .addOption(json())
    .action(async (options: { policy?: string; limit: string; json?: boolean; wide?: boolean }) => {
      const env = loadEnv();
      const limit = Number(options.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > 10_000) throw new UsageError(`--limit: must be an integer from 1 to 10000 (got "${options.limit}")`);
      await withPool(env, async (pool) => {
        const runs = await runsListSummaries(pool, { policy: options.policy, limit });
        const text = options.json ? '' : options.wide ? wideRunsTable(runs) : await runsTable(pool, runs, outputWidth());
        printResult(!!options.json, runs, () => text);
      });
    });

  program
    .command('run <runId>')
    .description('show one run with its counts')
    .addOption(json())
    .action(async (runId: string, options: { json?: boolean }) => {
      const id = runIdArgument('runId', runId);
      const env = loadEnv();
      await withPool(env, async (pool) => {
        const run = await runsGetSummary(pool, await resolveRunId(pool, id));
        if (!run) throw new NotFoundError(`no run ${runId}`);
        printResult(!!options.json, run, () => [describeRun(run), ...describeBrake(run)].join('\n'));
      });
    });
}

/** `--wide`: every column, as wide as it takes. */
const WIDE_COLUMNS = ['run', 'policy', 'trigger', 'state', 'cutoff', 'candidates', 'counted', 'approved', 'skipped', 'batches', 'deleted', 'noop', 'reason'];
/** The default: what an operator scans for every run, in 120 columns for policy names up to about 16 characters. */
const NARROW_COLUMNS = ['run', 'policy', 'trigger', 'state', 'cutoff', 'candidates', 'batches', 'deleted', 'noop'];
/** Under its run, wrapped: what only some runs have. */
const NOTE_INDENT = '    ';

/** One line per run with whole ids and cutoffs, the reason (never cut) as the last column, for grep. */
function wideRunsTable(runs: readonly RunSummary[]): string {
  return table(runs.map((run) => ({ ...runRow(run), ...brakeCounts(run) })), WIDE_COLUMNS);
}

/**
 * The default view: ids as short as is unique (8 hex digits, more where another run shares them),
 * cutoffs to the second; under a run's line, wrapped to `width` and never cut, what only some runs
 * have: the brake's counts, keys skipped, and the reason it failed, is incomplete or awaits approval.
 */
async function runsTable(db: Db, runs: readonly RunSummary[], width: number): Promise<string> {
  const short = await shortRunIds(db, runs.map((run) => run.runId));
  const rows = runs.map((run) => ({ ...runRow(run), run: short.get(run.runId) ?? run.runId, cutoff: cutoffToTheSecond(run.cutoff) }));
  const [header, ...lines] = table(rows, NARROW_COLUMNS).split('\n');
  if (runs.length === 0) return header!;
  return [
    header!,
    ...lines.flatMap((line, index) =>
      [line, ...runNotes(runs[index]!).flatMap((note) => wrap(note, width - NOTE_INDENT.length, 2).split('\n').map((part) => `${NOTE_INDENT}${part}`))],
    ),
  ].join('\n');
}

function runNotes(run: RunSummary): string[] {
  const { counted, approved } = brakeCounts(run);
  return [
    ...(counted !== null || approved !== null ? [`brake: counted ${counted ?? '-'}, approved ${approved ?? '-'}`] : []),
    ...(run.skipped > 0 ? [`skipped: ${run.skipped} (keys too long for a message; not deleted)`] : []),
    ...(run.error !== null ? [`reason: ${run.error}`] : []),
  ];
}

/** `2026-12-06T12:27:24.123456Z` as `2026-12-06 12:27:24Z` (cut, never rounded up past the cutoff). */
function cutoffToTheSecond(cutoff: string): string {
  return cutoff.replace(/^(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}:\d{2})(?:\.\d+)?Z$/, '$1 $2Z');
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
