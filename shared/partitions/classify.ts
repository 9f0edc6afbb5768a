import type { Db } from '../db/pool';
import { partitionRowsCheck, partitionsList, type PartitionInfo } from '../db/queries/partitions';
import type { ResolvedTarget } from '../db/queries/target';
// Restored partitions stay blocked until released (issue 44 review): restoredBlock below.
import { partitionsRestored } from '../db/queries/partitions';

/**
 * Classification of a partitioned policy table's partitions under a run's frozen cutoff (issue 44;
 * docs/design.md invariant 23):
 *  - retirable: the upper bound is at or before the cutoff (every row's expiry is below it) AND a
 *    scan of the partition alone finds no row that fails the scan's predicate (guard, finite
 *    expiry, no active hold): the whole partition may go;
 *  - mixed: some rows may be expired, but not provably all (the bound passes the cutoff, or a row
 *    is held, outside the guard or never expires): the row path deletes what is eligible in it;
 *  - unexpired: the lower bound is after the cutoff: no row of it can be expired;
 *  - blocked: reaper does not retire it whatever its rows (the default partition, one referenced by
 *    a foreign key, an unfinished DETACH ... CONCURRENTLY, a sub-partitioned or foreign table); its
 *    expired rows are still the row path's.
 */
export type PartitionClass = 'retirable' | 'mixed' | 'unexpired' | 'blocked';

export interface ClassifiedPartition {
  partition: string;
  bound: string;
  lower: string | null;
  upper: string | null;
  class: PartitionClass;
  reason: string;
  /** Rows counted by the retirable check (null where the bound decided alone). */
  rows: number | null;
}

/**
 * A partition `reaper restore --partition` attached back (`restoredAt`) stays attached until an
 * operator releases it: blocked, with how to release it. Its rows are still the row path's.
 */
export function restoredBlock(partition: Pick<PartitionInfo, 'qualified'>, restoredAt: string | undefined, policy: string): { class: 'blocked'; reason: string } | null {
  if (restoredAt === undefined) return null;
  return { class: 'blocked', reason: `restored on ${restoredAt}; \`reaper partitions ${policy} --release ${partition.qualified}\` lets reaper retire it again` };
}

/**
 * What the bound (and the catalog) decide alone; null when the partition's rows must be read.
 * Pure: unit-tested without a database.
 */
export function classifyByCatalog(partition: PartitionInfo, cutoffMs: number): { class: Exclude<PartitionClass, 'retirable'>; reason: string } | null {
  if (partition.isDefault) return { class: 'blocked', reason: 'the default partition: its rows have no bound (the row path deletes its expired rows)' };
  if (partition.detachPending) return { class: 'blocked', reason: 'an unfinished DETACH PARTITION ... CONCURRENTLY (pg_inherits.inhdetachpending): FINALIZE it first (reaper finishes its own)' };
  if (partition.kind !== 'table') return { class: 'blocked', reason: `a ${partition.kind === 'partitioned' ? 'sub-partitioned' : 'foreign'} table: reaper retires plain partitions only` };
  if (partition.referencedBy.length > 0) return { class: 'blocked', reason: `referenced by foreign key ${partition.referencedBy.join(', ')}` };
  if (partition.lower !== null && Date.parse(partition.lower) > cutoffMs) return { class: 'unexpired', reason: 'lower bound after the cutoff: no row can be expired' };
  if (partition.upper === null || Date.parse(partition.upper) > cutoffMs) {
    return { class: 'mixed', reason: `upper bound ${partition.upper ?? 'MAXVALUE'} after the cutoff: the row path deletes its expired rows` };
  }
  return null;
}

/**
 * Every partition of the target, classified under `cutoff` (an ISO instant, the run's). Reads the
 * rows only of partitions whose bound is at or before the cutoff, one partition at a time.
 * A frozen cutoff read with a JS Date loses microseconds: a bound within a millisecond after the
 * cutoff compares equal here, so the row check (in SQL, with the exact cutoff) decides it.
 */
export async function partitionsClassify(db: Db, target: ResolvedTarget, cutoff: string): Promise<ClassifiedPartition[]> {
  const cutoffMs = Date.parse(cutoff);
  const classified: ClassifiedPartition[] = [];
  const restored = await partitionsRestored(db, target.table);
  for (const partition of await partitionsList(db, target)) {
    const base = { partition: partition.qualified, bound: partition.bound, lower: partition.lower, upper: partition.upper };
    const decided = restoredBlock(partition, restored.get(partition.qualified), target.policy) ?? classifyByCatalog(partition, cutoffMs);
    if (decided) {
      classified.push({ ...base, ...decided, rows: null });
      continue;
    }
    const check = await partitionRowsCheck(db, target, { lower: partition.lower, upper: partition.upper! }, cutoff);
    classified.push(
      check.failing === 0
        ? { ...base, class: 'retirable', reason: `all ${check.rows} row(s) expired under the cutoff, within the guard, none held`, rows: check.rows }
        : { ...base, class: 'mixed', reason: `${check.failing} of ${check.rows} row(s) held, outside the guard or not expired: the row path deletes the rest`, rows: check.rows },
    );
  }
  return classified;
}
