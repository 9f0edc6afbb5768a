import { randomUUID } from 'node:crypto';
import { Command, Option } from 'commander';
import { requirePolicy } from '../../shared/config/policies';
import type { Pool } from '../../shared/db/pool';
import {
  archiveCheckColumns,
  archiveCount,
  archiveFindRun,
  archiveRestorePreview,
  archiveRestoreStep,
  type ArchiveSelection,
  type RestoredRow,
} from '../../shared/db/queries/archive';
import { partitionRestore, partitionRetirementByRetiredName } from '../../shared/db/queries/partitions';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { failpoint } from '../../shared/observability/failpoint-hook';
import { context, NotFoundError, operatorName, UsageError, withPool } from './common';
import { printResult } from './output';
import { resolveRunId, runIdArgument } from './run-id';
import { makeProgressLine } from './progress';

/** Rows per restore statement: each is one short transaction (the rows' locks, the inserts, the marks, the log). */
const DEFAULT_BATCH = 500;
/** Without a terminal, a progress line on stderr at most this often. */
const PROGRESS_EVERY_MS = 10_000;
/** Conflicting keys listed in the result (all are in cleanup_restores). */
const LISTED_CONFLICTS = 100;

/** A refusal the operator must act on (the table changed, the rows were pruned): exit 1, message only (main.ts). */
class RestoreRefused extends Error {}

export interface RestoreResult {
  runId: string;
  policy: string;
  /** The restore's id in cleanup_restores (null for --dry-run, which logs nothing). */
  restoreId: string | null;
  dryRun: boolean;
  /** Archived rows of the run (or of --id), and how many were restored before this restore. */
  archived: number;
  alreadyRestored: number;
  /** Put back now (with --dry-run: would be). */
  restored: number;
  /** Left in the archive because a row with the same key exists again (never overwritten). */
  conflicts: number;
  conflictKeys: string[];
}

/** `reaper restore --run <runId> [--id <key>] [--dry-run]`: puts a run's deleted rows back from the archive. */
export function registerRestoreCommand(program: Command): void {
  program
    .command('restore')
    .description('re-insert the rows a run deleted (archive.enabled policies, within archive.retainDays); never overwrites a key that exists again')
    .option('--run <runId>', 'the run whose deletions to undo')
    .option('--partition <reaper_retired.name>', 'attach this retired partition back (partitions.retire policies, within quarantineDays)')
    .option('--id <key>', 'only this key')
    .option('--dry-run', 'say what would be restored and what conflicts; change nothing')
    .option('--batch-size <n>', 'rows per transaction', String(DEFAULT_BATCH))
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (options: { run?: string; partition?: string; id?: string; dryRun?: boolean; batchSize: string; json?: boolean }) => {
      if ((options.run === undefined) === (options.partition === undefined)) throw new UsageError('give exactly one of --run <runId> or --partition <reaper_retired.name>');
      if (options.partition !== undefined) return restorePartition(options.partition, !!options.json);
      const runArgument = runIdArgument('--run', options.run!); // given: exactly one of the two is, checked above
      const batchSize = Number(options.batchSize);
      if (!Number.isInteger(batchSize) || batchSize < 1 || batchSize > 10_000) throw new UsageError(`--batch-size: must be an integer from 1 to 10000 (got "${options.batchSize}")`);
      const json = !!options.json;
      const { env, policies } = context();
      const result = await withPool(env, async (pool) => {
        const runId = await resolveRunId(pool, runArgument);
        const run = await archiveFindRun(pool, runId);
        if (!run) throw new NotFoundError(`no run ${runId}`);
        const policy = requirePolicy(policies, run.policy);
        if (policy.kind !== 'row-delete') throw new RestoreRefused(`run ${runId} is of ${policy.kind} policy "${policy.name}": only row-delete runs are archived`);
        const target = await targetResolve(pool, policy);
        const selection: ArchiveSelection = { runId: runId, key: options.id ?? null };
        const counted = await archiveCount(pool, target, selection).catch(refusedKey);
        if (counted.archived === 0) {
          const retainDays = policy.archive?.retainDays;
          if (retainDays !== undefined && run.ageDays > retainDays) {
            throw new RestoreRefused(
              `run ${runId} is ${Math.floor(run.ageDays)} days old, past archive.retainDays (${retainDays}): its archived rows were pruned; restore is only possible within retention`,
            );
          }
          throw new NotFoundError(
            `nothing archived for run ${runId}${options.id !== undefined ? ` and key ${options.id}` : ''} (it deleted ${run.deleted} row(s); archive ${policy.archive?.enabled ? 'is on' : 'is off'} for "${policy.name}")`,
          );
        }
        if (policy.archive?.retainDays !== undefined && run.ageDays > policy.archive.retainDays && counted.archived < run.deleted && options.id === undefined) {
          process.stderr.write(`reaper: note: run ${runId} is past archive.retainDays (${policy.archive.retainDays}): ${run.deleted - counted.archived} of its ${run.deleted} deleted rows were pruned and cannot be restored\n`);
        }
        const { columns, mismatches, sameColumns } = await archiveCheckColumns(pool, target, selection);
        if (mismatches.length > 0) {
          const why = mismatches.map((m) =>
            m.problem === 'missing'
              ? `column "${m.column}" is archived but table "${policy.table}" no longer has it (dropped or renamed)`
              : `column "${m.column}" of table "${policy.table}" is NOT NULL without a default and the archived rows have no value for it`,
          );
          throw new RestoreRefused(`refusing to restore run ${runId}: ${why.join('; ')}`);
        }
        return restoreInBatches(pool, target, { ...selection, columns, sameColumns, batchSize, dryRun: !!options.dryRun, json, policy: policy.name, counted });
      });
      printResult(json, result, () => describe(result));
      // Not everything is back (keys that exist again): exit 1 so a script notices; they are listed.
      if (result.conflicts > 0) process.exitCode = 1;
    });
}

/**
 * `reaper restore --partition reaper_retired.<name>`: one transaction (shared/db/queries/partitions.ts
 * partitionRestore): the retirement locked, refused when its quarantine ended, its stored
 * parent_table is not its policy's table or an attached partition's range now meets its bound,
 * else moved back into its schema, attached with its bound (a CHECK of the bound first: no scan
 * under the ATTACH's locks), marked restored (it stays attached until `reaper partitions <policy>
 * --release`) and logged in cleanup_restores. Its rows are the table itself: nothing to copy.
 */
async function restorePartition(given: string, json: boolean): Promise<void> {
  const retiredName = retiredTableName(given);
  const { env, policies } = context();
  const outcome = await withPool(env, async (pool) => {
    const found = await partitionRetirementByRetiredName(pool, retiredName);
    if (!found) return { kind: 'not-found' } as const;
    const policy = policies.get(found.policy);
    if (!policy || policy.kind !== 'row-delete') throw new RestoreRefused(`${given} was retired by policy "${found.policy}", which is not a row-delete policy of the policies file: not restored`);
    const target = await targetResolve(pool, policy);
    const client = await pool.connect();
    try {
      await client.query('BEGIN');
      const result = await partitionRestore(client, { retiredName, table: target.table, expiresAt: target.expiresAt, restoreId: randomUUID(), operator: operatorName() });
      await client.query(result.kind === 'restored' ? 'COMMIT' : 'ROLLBACK');
      return result;
    } catch (error) {
      await client.query('ROLLBACK').catch(() => undefined);
      throw error;
    } finally {
      client.release();
    }
  });
  switch (outcome.kind) {
    case 'not-found':
      throw new NotFoundError(`no retired partition ${given} (reaper partitions <policy> lists what was retired)`);
    case 'not-quarantined':
      throw new RestoreRefused(`${given} is ${outcome.state}, not quarantined: nothing to restore`);
    case 'quarantine-ended':
      throw new RestoreRefused(`the quarantine of ${given} ended at ${outcome.quarantineUntil}: it is dropped by the next run (and is no longer restorable)`);
    case 'refused':
      throw new RestoreRefused(`refusing to restore ${given}: its stored retirement does not match the policy (${outcome.reason})`);
    case 'overlaps':
      throw new RestoreRefused(`refusing to restore ${given}: its range overlaps the attached partition(s) ${outcome.partitions.join(', ')} (detach or drop them first)`);
    case 'restored': {
      const { retirement } = outcome;
      const { partition } = outcome;
      const shown = { partition, from: given, policy: retirement.policy, rows: outcome.rows, bound: retirement.bound };
      printResult(json, shown, () =>
        [
          `restored ${given} as ${partition} (${shown.rows} row(s), ${shown.bound}) into ${retirement.parentTable}; logged in cleanup_restores`,
          `it stays attached (no run retires it again) until \`reaper partitions ${retirement.policy} --release ${partition}\`; its expired rows are still the row path's (hold them or correct the policy first)`,
        ].join('\n'),
      );
    }
  }
}

/**
 * The table name in `reaper_retired.<name>`: any name (hyphens, dots, capitals), as is or
 * double-quoted as SQL quotes it ("events-2026-01-01", "a""b"). Whether it is a retired table is
 * the database's answer (cleanup_partitions and the catalog), not a pattern's.
 */
export function retiredTableName(given: string): string {
  const match = /^(?:reaper_retired|"reaper_retired")\.(.+)$/s.exec(given);
  if (!match) throw new UsageError(`--partition: "${given}" is not reaper_retired.<table name>`);
  const rest = match[1]!;
  if (/^"(?:[^"]|"")+"$/s.test(rest)) return rest.slice(1, -1).replace(/""/g, '"');
  return rest;
}

/** A key the key's type refuses (say, not a uuid): the operator's mistake, exit 2 naming --id. */
function refusedKey(error: { code?: string; message: string }): never {
  if (String(error.code).startsWith('22')) throw new UsageError(`--id: ${error.message}`);
  throw error;
}

async function restoreInBatches(
  pool: Pool,
  target: ResolvedTarget,
  job: ArchiveSelection & {
    columns: string[];
    /** The table has exactly the archived columns: rows go back through their record's text (exact). */
    sameColumns: boolean;
    batchSize: number;
    dryRun: boolean;
    json: boolean;
    policy: string;
    counted: { archived: number; restored: number };
  },
): Promise<RestoreResult> {
  const restoreId = job.dryRun ? null : randomUUID();
  const operator = operatorName();
  const result: RestoreResult = {
    runId: job.runId,
    policy: job.policy,
    restoreId,
    dryRun: job.dryRun,
    archived: job.counted.archived,
    alreadyRestored: job.counted.restored,
    restored: 0,
    conflicts: 0,
    conflictKeys: [],
  };
  // Everything restored before (a second run, or one after a kill at the very end): nothing to do.
  if (job.counted.restored === job.counted.archived) return result;
  const progress = makeRestoreProgress(job.json, job.counted.archived - job.counted.restored, job.dryRun);
  let after = '0';
  for (;;) {
    const step = { runId: job.runId, key: job.key, after, limit: job.batchSize };
    let rows: RestoredRow[];
    try {
      rows = job.dryRun
        ? await archiveRestorePreview(pool, target, step)
        : await archiveRestoreStep(pool, target, { ...step, columns: job.columns, sameColumns: job.sameColumns, restoreId: restoreId!, operator });
    } catch (error) {
      progress.done();
      const failed = error as { code?: string; message: string; constraint?: string };
      // A unique violation on another column, or a value the column's type now refuses: nothing of
      // this batch was written (one statement); the batches before it stay restored.
      if (String(failed.code).startsWith('22') || String(failed.code).startsWith('23')) {
        throw new RestoreRefused(`restore stopped after ${result.restored} row(s): ${failed.message}${failed.constraint ? ` (constraint ${failed.constraint})` : ''}`);
      }
      throw error;
    }
    if (rows.length === 0) break;
    for (const row of rows) {
      if (row.restored) result.restored++;
      else {
        result.conflicts++;
        if (result.conflictKeys.length < LISTED_CONFLICTS) result.conflictKeys.push(row.key);
      }
    }
    // The highest id handled (numerically): the next step starts after it, never before.
    after = rows.reduce((highest, row) => (BigInt(row.archiveId) > BigInt(highest) ? row.archiveId : highest), after);
    progress.update(result.restored, result.conflicts);
    // Test-only: the batch is committed, the next not begun (a kill here must restore nothing twice).
    if (!job.dryRun) failpoint('restore-after-batch');
  }
  progress.done();
  return result;
}

/** Progress on stderr: redrawn on a terminal, a line every PROGRESS_EVERY_MS otherwise; nothing with --json. */
function makeRestoreProgress(json: boolean, total: number, dryRun: boolean): { update(restored: number, conflicts: number): void; done(): void } {
  if (json) return { update: () => undefined, done: () => undefined };
  const line = process.stderr.isTTY ? makeProgressLine(process.stderr) : null;
  const started = performance.now();
  let lastLine = started;
  const verb = dryRun ? 'would restore' : 'restored';
  return {
    update(restored, conflicts) {
      const text = `${verb} ${restored}/${total}, ${conflicts} key(s) exist again, ${Math.round((performance.now() - started) / 1000)}s`;
      if (line) line.draw(text);
      else if (performance.now() - lastLine >= PROGRESS_EVERY_MS) {
        process.stderr.write(`reaper: ${text}\n`);
        lastLine = performance.now();
      }
    },
    done: () => line?.done(),
  };
}

function describe(result: RestoreResult): string {
  const lines = [
    `${result.dryRun ? 'would restore' : 'restored'} ${result.restored} row(s) of run ${result.runId} (${result.policy})` +
      (result.alreadyRestored > 0 ? `; ${result.alreadyRestored} of its ${result.archived} archived row(s) were restored before` : ''),
  ];
  if (result.conflicts > 0) {
    lines.push(
      `${result.conflicts} row(s) NOT restored: their key exists again (left as it is, never overwritten): ${result.conflictKeys.join(', ')}${result.conflicts > result.conflictKeys.length ? ', ...' : ''}`,
    );
  }
  if (result.restoreId) lines.push(`logged in cleanup_restores as restore ${result.restoreId}`);
  return lines.join('\n');
}
