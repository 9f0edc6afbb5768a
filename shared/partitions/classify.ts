import type { Db } from '../db/pool';
import { isDataException, partitionRetirableProof, partitionRowsCheck, partitionsList, type PartitionInfo } from '../db/queries/partitions';
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
 * Every partition of the target, classified under `cutoff` (an ISO instant, the run's). Reads rows
 * only of partitions whose bound is at or before the cutoff, one partition at a time:
 *  - `count: true` (`reaper partitions`, `reaper plan`): one scan each, counting its rows and those
 *    that fail (partitionRowsCheck), so the report says how many;
 *  - `count: false` (the scheduler): the proof alone (partitionRetirableProof: the bound, and
 *    bounded queries for the guard, '-infinity' and the policy's holds), `rows` null. The rows are
 *    counted once, by the re-check in the transaction that retires the partition, and that count
 *    is what the brake's allowance is checked against.
 * Both decide the same predicate; the proof's hold look-up casts hold keys to the key's type (a
 * superset of the text comparison), and where the proof cannot decide (a bound within a
 * millisecond of the cutoff, a hold key that does not cast) the counting check decides.
 * A frozen cutoff read with a JS Date loses microseconds: a bound within a millisecond after the
 * cutoff compares equal here, so the row check (in SQL, with the exact cutoff) decides it.
 */
export async function partitionsClassify(db: Db, target: ResolvedTarget, cutoff: string, options: { count: boolean } = { count: true }): Promise<ClassifiedPartition[]> {
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
    const range = { lower: partition.lower, upper: partition.upper! };
    const proved = options.count ? null : await proofOrNull(db, target, range, cutoff);
    if (proved) {
      classified.push({ ...base, ...proved, rows: null });
      continue;
    }
    const check = await partitionRowsCheck(db, target, range, cutoff);
    classified.push(
      check.failing === 0
        ? { ...base, class: 'retirable', reason: `all ${check.rows} row(s) expired under the cutoff, within the guard, none held`, rows: check.rows }
        : { ...base, class: 'mixed', reason: `${check.failing} of ${check.rows} row(s) held, outside the guard or not expired: the row path deletes the rest`, rows: check.rows },
    );
  }
  return classified;
}

/** The proof's class and reason; null where it cannot decide (the counting check does). */
async function proofOrNull(db: Db, target: ResolvedTarget, range: { lower: string | null; upper: string }, cutoff: string): Promise<{ class: 'retirable' | 'mixed'; reason: string } | null> {
  let proof;
  try {
    proof = await partitionRetirableProof(db, target, range, cutoff);
  } catch (error) {
    if (isDataException(error)) return null;
    throw error;
  }
  if (!proof.expiredByBound) return null;
  const failing = [proof.held && 'a row is held', proof.outsideGuard && 'a row is outside the guard', proof.nonFinite && "a row expires at '-infinity'"].filter(Boolean);
  return failing.length === 0
    ? { class: 'retirable', reason: 'every row expired by the upper bound, within the guard, none held (proved without counting)' }
    : { class: 'mixed', reason: `${failing.join(', ')}: the row path deletes the rest` };
}
