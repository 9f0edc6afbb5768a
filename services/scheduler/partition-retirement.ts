import type { Logger } from 'pino';
import { eventsEnabled, type RowDeletePolicy } from '../../shared/config/policies';
import { transactionOn, type Client as PoolClient, type Pool } from '../../shared/db/pool';
import {
  partitionAttachBack,
  partitionDetachConcurrently,
  partitionDetachFinalize,
  partitionDetachInTransaction,
  partitionDropOneDue,
  partitionKeep,
  partitionLockDetached,
  partitionLockForPlainDetach,
  partitionQuarantine,
  partitionRecheckPartition,
  partitionRetiredRowsOfRun,
  partitionRowsCheck,
  partitionRetirementBegin,
  partitionRetirementsOpen,
  partitionStoredTextRefused,
  partitionsList,
  partitionsPolicyLockTry,
  partitionsPolicyLockWait,
  partitionsPolicyOnlyReadersHold,
  partitionsPolicyUnlock,
  partitionWhereabouts,
  type PartitionRetirement,
} from '../../shared/db/queries/partitions';
import type { ResolvedTarget } from '../../shared/db/queries/target';
import { failpoint } from '../../shared/observability/failpoint-hook';
import { partitionsClassify } from '../../shared/partitions/classify';

/**
 * Retiring whole partitions (issue 44; docs/design.md "Retiring a partition", invariant 23), one
 * step at a time, each recorded in cleanup_partitions and conditional on the state it expects:
 *
 *   begin      INSERT ... state 'detaching' (the intent, committed first: a crash is found later)
 *   detach     DETACH PARTITION ... CONCURRENTLY (no default partition), else a plain DETACH in the
 *              transaction of the next step, under lock_timeout, retried a bounded number of times
 *   quarantine one transaction: lock the detached table, re-check every row with the scan's own
 *              predicate (a hold placed or a guard changed since the classification wins: the
 *              partition is attached again and left to the row path), move it into reaper_retired,
 *              detaching -> quarantined, the audit row
 *   drop       a later run, once quarantine_until passed: quarantined -> dropped and DROP TABLE in
 *              one transaction (never in the run that detached it: drops come first)
 *
 * Crash recovery (the next run): an open 'detaching' retirement whose partition is still attached
 * never started its detach (kept); one whose detach is pending is FINALIZEd; one detached is
 * re-checked and quarantined (or attached again). Two schedulers: a session advisory lock per
 * policy lets one of them do this at a time (the other's run leaves it to the next run), and every
 * state change is conditional anyway, so neither drops a partition twice nor loses one.
 */

/**
 * Plain DETACH: how long it may wait for its locks, and how many times it tries. A DETACH queued
 * behind a reader blocks the table's later queries while it waits: at most 150 ms each time
 * (issue 44: longest foreground lock wait at most 200 ms), 8 tries, a growing pause between them
 * (50, 100, ... 350 ms, no transaction open): about 1.2 s of waiting and 1.4 s of pauses in all.
 */
const PLAIN_DETACH_LOCK_TIMEOUT_MS = 150;
const PLAIN_DETACH_ATTEMPTS = 8;
const PLAIN_DETACH_BACKOFF_MS = 50;
/**
 * How long a retirement waits for the backlog gauge's reads of the table in flight (shared holders
 * of the policy's lock; no new one starts while it waits) before leaving its partitions to the next run.
 */
const GAUGE_READ_WAIT_MS = 10_000;
/** 55P03 lock_not_available: lock_timeout expired. */
const LOCK_NOT_AVAILABLE = '55P03';

export interface RetireDeps {
  pool: Pool;
  log: Logger;
  /** False once the run's claim is known lost: no further step starts. */
  stillClaimed: () => boolean;
  /** Awaited after a retirement's intent is recorded, before its detach: tests place a hold there. */
  beforeDetach?: (partition: string) => Promise<void>;
}

export interface RetireRun {
  runId: string;
  cutoff: string;
}

/** What this run retired in all (earlier claims of it included): rows count toward its allowance. */
export interface RetireResult {
  retiredRows: number;
}

export async function retirePartitions(
  deps: RetireDeps,
  run: RetireRun,
  policy: RowDeletePolicy & { partitions: { retire: true; quarantineDays: number } },
  target: ResolvedTarget,
  options: { room: number; policyVersion: string },
): Promise<RetireResult> {
  const client = await deps.pool.connect();
  let locked = false;
  try {
    locked = await partitionsPolicyLockTry(client, policy.name);
    if (!locked && (await partitionsPolicyOnlyReadersHold(client, policy.name))) {
      // Backlog gauge reads of the table hold it (shared): wait for them (the DETACH would), no new one starts meanwhile.
      locked = await transactionOn(client, async () => {
        await partitionsPolicyLockWait(client, policy.name, GAUGE_READ_WAIT_MS);
        return true;
      }).catch((error: { code?: string }) => {
        if (error.code !== LOCK_NOT_AVAILABLE) throw error;
        return false;
      });
    }
    if (!locked) {
      deps.log.info('another scheduler is retiring partitions of this policy: this run leaves them to it');
      return { retiredRows: await partitionRetiredRowsOfRun(client, run.runId) };
    }
    // The run's allowance left (the brake): checked against each partition's rows as the re-check
    // counts them, in the transaction that retires it (never against an earlier count).
    const step: StepContext = { deps, client, run, policy, target, policyVersion: options.policyVersion, room: options.room - (await partitionRetiredRowsOfRun(client, run.runId)) };
    for (const open of await partitionRetirementsOpen(client, policy.name)) {
      if (!deps.stillClaimed()) break;
      await resume(step, open);
    }
    const undroppable: string[] = [];
    for (;;) {
      if (!deps.stillClaimed()) break;
      const dropped = await inTransaction(client, () => partitionDropOneDue(client, policy.name, undroppable), 'partition-drop-before-commit');
      if (!dropped) break;
      const partition = `reaper_retired.${dropped.retirement.retiredName}`;
      if (dropped.kind === 'dropped') {
        deps.log.info({ partition, rows: dropped.retirement.rowCount }, 'retired partition dropped: its quarantine is over');
      } else {
        // Stays quarantined (the next run tries again); this run goes on with the others and the row path.
        undroppable.push(dropped.retirement.retirementId);
        deps.log.warn({ partition, reason: dropped.reason }, 'retired partition not dropped: the database refused; it stays quarantined');
      }
    }
    const partitions = await partitionsList(client, target);
    const concurrent = !partitions.some((partition) => partition.isDefault);
    // The proof alone (no row counted): the re-check counts them once, under the partition's lock.
    for (const candidate of await partitionsClassify(client, target, run.cutoff, { count: false })) {
      if (candidate.class !== 'retirable' || !deps.stillClaimed()) continue;
      if (step.room <= 0) {
        deps.log.warn({ partition: candidate.partition, room: step.room }, "partition not retired: the run's allowance is used up (the row path and the brake take its rows)");
        continue;
      }
      // Absent when the table changed between the two reads (a restore attached it meanwhile): the next run decides.
      const info = partitions.find((partition) => partition.qualified === candidate.partition);
      if (!info) continue;
      if (concurrent && Number.isFinite(step.room)) {
        // A DETACH ... CONCURRENTLY cannot be rolled back: a partition over the allowance left would
        // leave the parent's view (and wait for every transaction on the table) only to be attached
        // back after its re-check. So under a finite allowance its rows are counted first; the
        // re-check, under the partition's lock, still decides.
        const { rows } = await partitionRowsCheck(client, target, { lower: info.lower, upper: info.upper! }, run.cutoff);
        if (rows > step.room) {
          deps.log.warn({ partition: candidate.partition, rows, room: step.room }, "partition not retired: its rows pass the run's allowance left (the row path and the brake take them)");
          continue;
        }
      }
      const begun = await partitionRetirementBegin(client, {
        policy: policy.name,
        runId: run.runId,
        parentTable: target.table,
        schema: info.schema,
        name: info.name,
        bound: info.bound,
        lower: info.lower,
        upper: info.upper!,
        concurrent,
      });
      if (!begun) {
        deps.log.warn({ partition: candidate.partition }, 'partition not retired: a retirement of it is open, or reaper_retired has a table of its name');
        continue;
      }
      failpoint('partition-after-begin');
      await deps.beforeDetach?.(candidate.partition);
      if (concurrent) await leftPendingOnLockTimeout(step, begun, () => detachConcurrently(step, begun));
      else await detachPlainAndQuarantine(step, begun);
    }
    return { retiredRows: await partitionRetiredRowsOfRun(client, run.runId) };
  } finally {
    if (locked) await partitionsPolicyUnlock(client, policy.name).catch(() => undefined);
    client.release();
  }
}

interface StepContext {
  deps: RetireDeps;
  client: PoolClient;
  run: RetireRun;
  policy: RowDeletePolicy & { partitions: { retire: true; quarantineDays: number } };
  target: ResolvedTarget;
  policyVersion: string;
  /** Rows this run may still retire (the brake's allowance left); each quarantine takes its re-check's count off it. */
  room: number;
}

/** An open retirement found at the start of a run (a crash, or a run that stopped): finish it from where the catalog says it is. */
async function resume(step: StepContext, open: PartitionRetirement): Promise<void> {
  // The stored text is pasted into DDL: it must be what this scheduler wrote for the policy's table.
  const refused = partitionStoredTextRefused(open, step.target.table);
  if (refused !== null) {
    await partitionKeep(step.client, open, `stored retirement refused: ${refused}; nothing done`);
    step.deps.log.error({ partition: `${open.sourceSchema}.${open.sourceName}`, reason: refused }, 'interrupted partition retirement not finished: its stored text does not match the policy');
    return;
  }
  const where = await partitionWhereabouts(step.client, open);
  step.deps.log.warn({ partition: `${open.sourceSchema}.${open.sourceName}`, where, runId: open.runId }, 'finishing an interrupted partition retirement');
  if (where === 'attached') {
    await partitionKeep(step.client, open, 'interrupted before its detach: the partition stayed attached');
  } else if (where === 'detach-pending') {
    await leftPendingOnLockTimeout(step, open, async () => {
      await partitionDetachFinalize(step.client, open);
      return quarantineDetached(step, open);
    });
  } else if (where === 'detached') {
    await quarantineDetached(step, open);
  } else {
    // 'retired' with state detaching cannot happen (moved and recorded in one transaction); 'missing': dropped by someone else;
    // 'attached-elsewhere', 'parent-missing': someone else moved it or dropped its parent: not reaper's to finish.
    await partitionKeep(step.client, open, `not where reaper left it (${where}): nothing done`);
  }
}

/**
 * DETACH ... CONCURRENTLY or FINALIZE that hit a lock timeout (55P03: an old transaction holds the
 * table): the retirement stays `detaching` (attached or detach pending) for the next run to finish,
 * and this run goes on with the other partitions and the row path. Null then, like a kept one.
 */
async function leftPendingOnLockTimeout(step: StepContext, retirement: PartitionRetirement, work: () => Promise<number | null>): Promise<number | null> {
  try {
    return await work();
  } catch (error) {
    if ((error as { code?: string }).code !== LOCK_NOT_AVAILABLE) throw error;
    step.deps.log.warn({ partition: `${retirement.sourceSchema}.${retirement.sourceName}` }, 'partition detach did not get its lock (lock timeout): left detaching for the next run');
    return null;
  }
}

async function detachConcurrently(step: StepContext, retirement: PartitionRetirement): Promise<number | null> {
  await partitionDetachConcurrently(step.client, retirement);
  failpoint('partition-after-detach');
  return quarantineDetached(step, retirement);
}

/**
 * The re-check and the move, in one transaction, on a table already detached: a row that no
 * longer passes (held, guard, expiry) attaches the table again and keeps it. Returns the rows
 * quarantined, or null when kept.
 */
async function quarantineDetached(step: StepContext, retirement: PartitionRetirement): Promise<number | null> {
  const { client } = step;
  return inTransaction(client, async () => {
    await partitionLockDetached(client, retirement);
    const check = await partitionRecheckPartition(client, step.target, retirement, step.run.cutoff);
    const refused = recheckRefusal(step, check);
    if (refused !== null) {
      await partitionAttachBack(client, retirement);
      await partitionKeep(client, retirement, `${refused}: attached again`);
      step.deps.log.warn({ partition: `${retirement.sourceSchema}.${retirement.sourceName}`, reason: refused }, 'partition not retired at the re-check; attached again');
      return null;
    }
    return quarantine(step, retirement, check);
  });
}

/**
 * Plain DETACH (a default partition exists, so not CONCURRENTLY) with the re-check and the move in
 * the same transaction, the re-check before the DETACH: a failed re-check never detaches. The lock is waited for at most
 * PLAIN_DETACH_LOCK_TIMEOUT_MS per attempt, PLAIN_DETACH_ATTEMPTS times; then the partition is kept.
 */
async function detachPlainAndQuarantine(step: StepContext, retirement: PartitionRetirement): Promise<number | null> {
  const { client } = step;
  for (let attempt = 1; ; attempt++) {
    try {
      const outcome = await inTransaction(client, async () => {
        // SHARE on the partition first, the re-check and checksum under it (writes into it wait,
        // reads of the table go on), and only then the parent's ACCESS EXCLUSIVE, for the DDL and COMMIT.
        await partitionLockForPlainDetach(client, retirement, PLAIN_DETACH_LOCK_TIMEOUT_MS);
        const check = await partitionRecheckPartition(client, step.target, retirement, step.run.cutoff);
        const refused = recheckRefusal(step, check);
        if (refused !== null) throw new RecheckFailed(`${refused}: not detached`);
        await partitionDetachInTransaction(client, retirement);
        return quarantine(step, retirement, check);
      });
      return outcome;
    } catch (error) {
      if (error instanceof RecheckFailed) {
        await partitionKeep(client, retirement, error.message);
        step.deps.log.warn({ partition: `${retirement.sourceSchema}.${retirement.sourceName}` }, error.message);
        return null;
      }
      if ((error as { code?: string }).code !== LOCK_NOT_AVAILABLE) throw error;
      if (attempt >= PLAIN_DETACH_ATTEMPTS || !step.deps.stillClaimed()) {
        const reason = `DETACH did not get its lock within ${PLAIN_DETACH_LOCK_TIMEOUT_MS} ms, ${attempt} time(s): left to the row path`;
        await partitionKeep(client, retirement, reason);
        step.deps.log.warn({ partition: `${retirement.sourceSchema}.${retirement.sourceName}` }, reason);
        return null;
      }
      await new Promise((resolve) => setTimeout(resolve, PLAIN_DETACH_BACKOFF_MS * attempt));
    }
  }
}

class RecheckFailed extends Error {}

/**
 * Why the re-check refuses the retirement, or null: a row that may not be deleted (held, outside
 * the guard, not expired), or more rows than the run's allowance left (the brake counts the rows
 * the re-check counted, the ones that would be retired, not the classification's).
 */
function recheckRefusal(step: StepContext, check: { rows: number; failing: number; held: number }): string | null {
  if (check.failing > 0 || check.held > 0) {
    // A row both held and outside the guard counts in both: at most every row.
    const failing = Math.min(check.rows, check.failing + check.held);
    return `${failing} of ${check.rows} row(s) no longer pass (${check.held} held, ${check.failing} outside the guard or not expired) at the re-check`;
  }
  if (check.rows > step.room) return `its ${check.rows} row(s) pass the run's allowance left (${step.room}): the row path and the brake take them`;
  return null;
}

async function quarantine(step: StepContext, retirement: PartitionRetirement, check: { rows: number; checksum: string }): Promise<number | null> {
  const done = await partitionQuarantine(step.client, retirement, {
    rows: check.rows,
    checksum: check.checksum,
    quarantineDays: step.policy.partitions.quarantineDays,
    audit: step.policy.audit?.enabled ? { policyVersion: step.policyVersion } : null,
    events: eventsEnabled(step.policy) ? { policyVersion: step.policyVersion } : null,
  });
  if (!done) throw new Error(`retirement ${retirement.retirementId} is no longer 'detaching' (another scheduler finished it): rolled back`);
  step.room -= check.rows;
  step.deps.log.info({ partition: `${retirement.sourceSchema}.${retirement.sourceName}`, rows: check.rows, bound: retirement.bound, checksum: check.checksum }, 'partition retired into reaper_retired');
  return check.rows;
}

/** One transaction on the retirement's own connection (it holds the policy's advisory lock). `point`: the crash test's failpoint before COMMIT, when the work did something. */
async function inTransaction<T>(client: PoolClient, work: () => Promise<T>, point: 'partition-before-commit' | 'partition-drop-before-commit' = 'partition-before-commit'): Promise<T> {
  let result: T | null = null;
  return transactionOn(client, async () => (result = await work()), { beforeCommit: () => result !== null && failpoint(point) });
}
