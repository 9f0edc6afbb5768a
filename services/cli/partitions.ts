import { Command, Option } from 'commander';
import { requirePolicy, type Policy } from '../../shared/config/policies';
import { withReadOnlyTransaction } from '../../shared/db/pool';
import { databaseNow } from '../../shared/db/queries/clock';
import { partitionRelease, partitionRetirementsList, RETIRED_SCHEMA, type PartitionRetirement } from '../../shared/db/queries/partitions';
import { targetResolve } from '../../shared/db/queries/target';
import { partitionsClassify, type ClassifiedPartition } from '../../shared/partitions/classify';
import { context, NotFoundError, operatorName, pastCutoff, UsageError, withPool } from './common';
import { printResult, table } from './output';

/** What `reaper partitions` answers (the JSON field names are the contract). */
export interface PartitionsReport {
  policy: string;
  cutoff: string;
  /** partitions.retire as configured: false shows what retiring would do, nothing retires. */
  retire: boolean;
  partitions: ClassifiedPartition[];
  /** Rows of the retirable partitions (they count toward the brake like rows do). */
  retirableRows: number;
  /** Retired partitions still in quarantine (restorable with `reaper restore --partition`), newest first. */
  quarantined: Array<{ partition: string; from: string; rows: number | null; bound: string; quarantineUntil: string | null; runId: string | null }>;
}

/** A row-delete policy's table must be partitioned for `partitions` to mean anything: a usage error otherwise. */
export function requirePartitionable(policy: Policy): void {
  if (policy.kind !== 'row-delete') throw new UsageError(`policy "${policy.name}" is ${policy.kind}: partitions are retired for row-delete policies only`);
}

export function partitionsReport(policy: Policy, cutoff: string, partitions: ClassifiedPartition[], quarantined: readonly PartitionRetirement[]): PartitionsReport {
  return {
    quarantined: quarantined.map((entry) => ({
      partition: `${RETIRED_SCHEMA}.${entry.retiredName}`,
      from: `${entry.sourceSchema}.${entry.sourceName}`,
      rows: entry.rowCount,
      bound: entry.bound,
      quarantineUntil: entry.quarantineUntil,
      runId: entry.runId,
    })),
    policy: policy.name,
    cutoff,
    retire: policy.kind === 'row-delete' && policy.partitions?.retire === true,
    partitions,
    retirableRows: partitions.filter((entry) => entry.class === 'retirable').reduce((sum, entry) => sum + (entry.rows ?? 0), 0),
  };
}

export function partitionsTable(partitions: readonly ClassifiedPartition[]): string {
  return table(
    partitions.map((entry) => ({ partition: entry.partition, class: entry.class, rows: entry.rows, from: entry.lower ?? (entry.bound === 'DEFAULT' ? 'DEFAULT' : 'MINVALUE'), to: entry.upper ?? (entry.bound === 'DEFAULT' ? '' : 'MAXVALUE'), reason: entry.reason })),
    ['partition', 'class', 'rows', 'from', 'to', 'reason'],
  );
}

/**
 * `reaper partitions <policy>`: each partition of the policy's table classified under a cutoff
 * (now, or --cutoff), in a READ ONLY transaction: what a run would retire, leave to the row path
 * and refuse, with the reason.
 */
export function registerPartitionsCommand(program: Command): void {
  program
    .command('partitions <policy>')
    .description("classify <policy>'s partitions under a cutoff: retirable, mixed (row path), unexpired, blocked; changes nothing")
    .option('--cutoff <iso>', 'as of this past instant (ISO 8601 with a time zone)')
    .option('--release <schema.name>', 'let runs retire again a partition `reaper restore --partition` attached back (it stays attached until then)')
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (policyName: string, options: { cutoff?: string; json?: boolean; release?: string }) => {
      const { env, policies } = context();
      const policy = requirePolicy(policies, policyName);
      requirePartitionable(policy);
      if (options.release !== undefined) return releasePartition(policy.name, options.release, !!options.json);
      const report = await withPool(env, async (pool) => {
        const cutoff = options.cutoff ? await pastCutoff(pool, options.cutoff) : await databaseNow(pool);
        const target = await targetResolve(pool, policy);
        if (!target.partitioned) throw new UsageError(`policy "${policy.name}": table "${policy.table}" is not a partitioned table`);
        return withReadOnlyTransaction(pool, async (client) =>
          partitionsReport(policy, cutoff, await partitionsClassify(client, target, cutoff), await partitionRetirementsList(client, { policy: policy.name, states: ['quarantined'] })),
        );
      });
      printResult(!!options.json, report, () =>
        [
          `policy      ${report.policy} (cutoff ${report.cutoff}; partitions.retire ${report.retire ? 'on' : 'off: nothing is retired'})`,
          `retirable   ${report.partitions.filter((entry) => entry.class === 'retirable').length} partition(s), ${report.retirableRows} row(s)`,
          partitionsTable(report.partitions),
          `quarantined ${report.quarantined.length} retired partition(s) (reaper restore --partition <name> attaches one back before its date)`,
          ...(report.quarantined.length > 0 ? [table(report.quarantined.map((entry) => ({ partition: entry.partition, from: entry.from, rows: entry.rows, until: entry.quarantineUntil })), ['partition', 'from', 'rows', 'until'])] : []),
        ].join('\n'),
      );
    });
}

/** `reaper partitions <policy> --release <schema.name>`: restored -> released (partitionRelease). */
async function releasePartition(policy: string, partition: string, json: boolean): Promise<void> {
  const { env } = context();
  const released = await withPool(env, (pool) => partitionRelease(pool, policy, partition, operatorName()));
  if (released === 0) throw new NotFoundError(`no restored partition ${partition} of policy "${policy}" (only a partition \`reaper restore --partition\` attached back is released)`);
  printResult(json, { policy, partition, released: true }, () => `released ${partition}: a run of "${policy}" may retire it again when all its rows are expired`);
}
