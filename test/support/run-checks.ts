import assert from 'node:assert/strict';
import type pg from 'pg';
import type { TestBroker } from './broker';
import { outboxEventCount } from '../../shared/db/queries/outbox';
import { eventually } from './eventually';
import { readyAtRest, runReceipts, stopAllCleanly, type BedAndBroker } from './fixtures';
import type { ReaperProcess } from './processes';
import { countReservations } from './seed';

/**
 * The end-of-run verdict shared by the fault tests that disturb a row-delete run (broker closing
 * connections, broker restarted, publishes refused): the run deleted every expired hold exactly
 * once, counted it once, touched nothing else, left no message behind (checked once no consumer
 * holds any), and every service drains, exits 0 and logged no error.
 */
export async function assertRunDeletedExactlyOnce(
  world: BedAndBroker,
  check: {
    runId: string;
    seeded: { expiredHeld: string[]; futureHeld: string[]; expiredConfirmed: string[] };
    scheduler: ReaperProcess;
    workers: readonly ReaperProcess[];
    /** Default: the scheduler and the workers. */
    services?: readonly ReaperProcess[];
    /** The run's policy, whose work queue must end empty (default seat-holds). */
    policy?: string;
    diagnosis?: Record<string, unknown>;
    /** Error-level log lines this fault is expected to cause (matched against "<label>: <msg> <json>"). */
    allowErrors?: RegExp;
  },
): Promise<void> {
  const pool = world.bed.pool;
  const { seeded } = check;
  const broker = world.broker;
  const workQueue = world.names.workQueue(check.policy ?? 'seat-holds');
  const services = check.services ?? [check.scheduler, ...check.workers];
  const receipts = await runReceipts(pool, check.runId);
  const remaining = await countReservations(pool, seeded.expiredHeld);
  const diagnosis = JSON.stringify({
    ...check.diagnosis,
    run: (await pool.query('SELECT state, candidates, batches_confirmed FROM cleanup_runs WHERE run_id = $1', [check.runId])).rows[0],
    receipts,
    remainingExpired: remaining,
    windowRetries: check.scheduler.lines.filter((line) => line.msg === 'run publish failed; retrying').length,
    duplicateSettles: check.workers.flatMap((w) => w.lines.filter((line) => line.msg === 'batch settled' && line.outcome === 'duplicate')).length,
  });
  assert.equal(remaining, 0, `every expired hold is deleted by the completed run; ${diagnosis}`);
  assert.equal(receipts.deleted, seeded.expiredHeld.length, `the receipts add up to the seeded expired count; ${diagnosis}`);
  assert.equal(await countReservations(pool, seeded.futureHeld), seeded.futureHeld.length, 'no hold that had not expired is gone');
  assert.equal(await countReservations(pool, seeded.expiredConfirmed), seeded.expiredConfirmed.length, 'no confirmed reservation is gone');
  await eventually('the work queue to be empty', async () => (await broker.messageCount(workQueue)) === 0);
  assert.equal((await broker.drain(world.names.deadLetterQueue)).length, 0, 'nothing dead-lettered');
  await stopAllCleanly(services, { allowErrors: check.allowErrors });
  // Nothing comes back once the workers are gone: every batch was acked, not merely in a worker's hands.
  assert.equal(await readyAtRest(broker, workQueue), 0, 'no batch returned to the work queue after the services stopped');
}

/**
 * The checker of the fault tests and of the chaos run (issue 10): after the system settled, four
 * counts that must all be zero, plus the recovery time after each fault.
 *
 * - lost: an expired, unrenewed, unheld row (status still 'held', expiry at or before the settling
 *   run's cutoff, no active legal hold) still in the table; an expired, unheld asset still
 *   'active'; an operation of the remote ledger still not done.
 * - wrongful: a protected row gone (renewed, confirmed, held in cleanup_holds or unexpired when
 *   the test made it so: `protectedRows`), a row deleted while an active legal hold on it existed
 *   (read from the audit trail, when the policy writes one), a protected asset's remote object
 *   deleted by the stand-in API.
 * - doubled: a remote key executed more than once by the stand-in API; a row counted deleted twice
 *   (the receipts' `deleted` sum above the rows that are really gone); a key audited twice.
 * - stuck: a message still in a work queue or the dead-letter queue once no consumer holds it; a
 *   run not finished (pending, scanning, published) after settling; an operation in flight with an
 *   expired lease.
 *
 * With `events` (expiry events on for the policies checked), a fifth count, `events`: a deletion
 * whose event (message id `<policy>:<key>:<observed expiry>`) was never delivered (missing; its
 * outbox row may still be there), and a delivered event id that is no deletion's (spurious). A
 * row-delete deletion is its audit row (the policy must have `audit` on); a remote-delete one is
 * its asset marked `deleted`. Duplicates (the same id delivered again) are allowed and counted.
 */
export interface CheckerCounts {
  lost: number;
  wrongful: number;
  doubled: number;
  stuck: number;
}

export interface CheckerReport extends CheckerCounts {
  /** What each count is made of, for the failure message. */
  details: Record<string, unknown>;
  recoveries: Recovery[];
  /** Expiry events, when the input had them. */
  events?: EventsCheck;
}

export interface EventsCheck {
  /** Deletions (each one event id) checked. */
  deletions: number;
  delivered: number;
  distinct: number;
  /** Deliveries of an id already delivered (allowed: at-least-once). */
  duplicates: number;
  /** Deletions whose event never arrived (a violation). */
  missing: number;
  /** Delivered ids that are no deletion's (a violation). */
  spurious: number;
  /** Outbox rows still unpublished when checked. */
  outboxLeft: number;
}

export interface Recovery {
  fault: string;
  /** Time from the end of the fault to the next committed batch or confirmed operation; null when nothing was due. */
  ms: number | null;
}

export interface CheckerInput {
  pool: pg.Pool;
  broker: TestBroker;
  /** Work queues to find empty, and the dead-letter queue. */
  workQueues: readonly string[];
  deadLetterQueue: string;
  /** row-delete: every row id the test created in seat_reservations, and those that must survive (id -> why). */
  rows?: { policy: string; created: number; protected: ReadonlyMap<string, string>; cutoff: string };
  /** remote-delete: assets that must never be deleted (id -> why), the cutoff of the settling run, the stand-in's record. */
  assets?: { policy: string; protected: ReadonlyMap<string, string>; cutoff: string; executionsByKey: ReadonlyMap<string, number>; executedIds: ReadonlySet<string> };
  recoveries?: Recovery[];
  /** Runs still unfinished that are allowed (e.g. a run the test left waiting for approval on purpose). */
  ignoreRuns?: readonly string[];
  /** Only runs created before this instant (ISO) count as stuck: a schedule may start one while the services stop. */
  runsCreatedBefore?: string;
  /** Expiry events on for `rows` (with audit) and `assets` (with markConfirmed status 'deleted'): every message id a consumer of `<prefix>.events` received. */
  events?: { delivered: readonly string[] };
}

export async function runChecker(input: CheckerInput): Promise<CheckerReport> {
  const { pool } = input;
  const details: Record<string, unknown> = {};
  let lost = 0;
  let wrongful = 0;
  let doubled = 0;
  let stuck = 0;
  const one = async <T extends pg.QueryResultRow>(sql: string, params: unknown[] = []): Promise<T> => (await pool.query<T>(sql, params)).rows[0]!;

  if (input.rows) {
    const rows = input.rows;
    const lostRows = await one<{ n: number; sample: string[] | null }>(
      `SELECT count(*)::int AS n, (array_agg(reservation_id::text ORDER BY expires_at))[1:5] AS sample FROM seat_reservations r
       WHERE r.status = 'held' AND r.expires_at <= $1::timestamptz
         AND NOT EXISTS (SELECT 1 FROM cleanup_holds h WHERE h.policy = $2 AND h.key = r.reservation_id::text
                         AND (h.held_until IS NULL OR h.held_until > statement_timestamp()))`,
      [rows.cutoff, rows.policy],
    );
    const protectedIds = [...rows.protected.keys()];
    const present = new Set(
      (await pool.query<{ id: string }>('SELECT reservation_id::text AS id FROM seat_reservations WHERE reservation_id = ANY($1::uuid[])', [protectedIds])).rows.map((r) => r.id),
    );
    const goneProtected = protectedIds.filter((id) => !present.has(id));
    // A deletion while an active hold existed (placed before the deleting statement): from the audit trail.
    const heldDeletes = await one<{ n: number }>(
      `SELECT count(*)::int AS n FROM cleanup_audit a JOIN cleanup_holds h ON h.policy = a.policy AND h.key = a.key
       WHERE a.policy = $1 AND a.operation_key IS NULL AND h.created_at < a.deleted_at AND (h.held_until IS NULL OR h.held_until > a.deleted_at)
         AND NOT (a.key = ANY($2::text[]))`,
      [rows.policy, goneProtected],
    );
    const tableNow = await one<{ n: number }>('SELECT count(*)::int AS n FROM seat_reservations');
    const receipts = await one<{ deleted: number }>('SELECT coalesce(sum(deleted), 0)::int AS deleted FROM cleanup_batches WHERE policy = $1', [rows.policy]);
    const gone = rows.created - tableNow.n;
    const auditTwice = await one<{ n: number }>(
      `SELECT coalesce(sum(c - 1), 0)::int AS n FROM (SELECT count(*) AS c FROM cleanup_audit WHERE policy = $1 AND operation_key IS NULL GROUP BY key HAVING count(*) > 1) twice`,
      [rows.policy],
    );
    // A window published again under new batch ids would put the same rows in two batches: the
    // receipts of a run then hold more items than the run published candidates.
    const publishedTwice = await one<{ n: number }>(
      `SELECT coalesce(sum(greatest(0, b.items - r.candidates)), 0)::int AS n FROM cleanup_runs r
       JOIN (SELECT run_id, sum(items) AS items FROM cleanup_batches GROUP BY run_id) b ON b.run_id = r.run_id
       WHERE r.policy = $1 AND r.state = 'completed'`,
      [rows.policy],
    );
    lost += lostRows.n;
    wrongful += goneProtected.length + heldDeletes.n;
    doubled += publishedTwice.n;
    // Receipts counting more rows than are gone count some twice; fewer means a deletion went uncounted.
    doubled += Math.abs(receipts.deleted - gone) + auditTwice.n;
    details.rows = {
      lost: lostRows.n,
      lostSample: lostRows.sample,
      protected: protectedIds.length,
      protectedGone: goneProtected.slice(0, 10).map((id) => `${id} (${rows.protected.get(id)})`),
      deletedUnderHold: heldDeletes.n,
      created: rows.created,
      gone,
      receiptsDeleted: receipts.deleted,
      auditedTwice: auditTwice.n,
      publishedInTwoBatches: publishedTwice.n,
    };
  }

  if (input.assets) {
    const assets = input.assets;
    const lostAssets = await one<{ n: number; sample: string[] | null }>(
      `SELECT count(*)::int AS n, (array_agg(asset_id ORDER BY asset_id))[1:5] AS sample FROM media_assets m
       WHERE m.status = 'active' AND m.retention_expires_at <= $1::timestamptz
         AND NOT EXISTS (SELECT 1 FROM cleanup_holds h WHERE h.policy = $2 AND h.key = m.asset_id
                         AND (h.held_until IS NULL OR h.held_until > statement_timestamp()))`,
      [assets.cutoff, assets.policy],
    );
    const openOps = await one<{ pending: number; expired: number }>(
      `SELECT count(*) FILTER (WHERE state = 'pending')::int AS pending,
              count(*) FILTER (WHERE state = 'in_flight' AND lease_expires_at < clock_timestamp())::int AS expired
       FROM cleanup_ledger WHERE policy = $1`,
      [assets.policy],
    );
    const wrongfulAssets = [...assets.protected.keys()].filter((id) => assets.executedIds.has(id));
    const executedTwice = [...assets.executionsByKey.entries()].filter(([, n]) => n > 1);
    lost += lostAssets.n + openOps.pending;
    wrongful += wrongfulAssets.length;
    doubled += executedTwice.reduce((sum, [, n]) => sum + n - 1, 0);
    stuck += openOps.expired;
    details.assets = {
      lost: lostAssets.n,
      lostSample: lostAssets.sample,
      pendingOperations: openOps.pending,
      inFlightPastLease: openOps.expired,
      protected: assets.protected.size,
      protectedCalled: wrongfulAssets.slice(0, 10).map((id) => `${id} (${assets.protected.get(id)})`),
      keysExecutedTwice: executedTwice.slice(0, 10),
    };
  }

  const unfinished = (
    await pool.query<{ run_id: string; policy: string; state: string }>(
      `SELECT run_id::text, policy, state FROM cleanup_runs WHERE state IN ('pending', 'scanning', 'published') AND NOT (run_id::text = ANY($1::text[]))
         AND ($2::timestamptz IS NULL OR created_at < $2::timestamptz)`,
      [input.ignoreRuns ?? [], input.runsCreatedBefore ?? null],
    )
  ).rows;
  stuck += unfinished.length;
  const queued: Record<string, number> = {};
  for (const queue of [...input.workQueues, input.deadLetterQueue]) {
    const count = await readyAtRest(input.broker, queue);
    if (count > 0) queued[queue] = count;
    stuck += count;
  }
  details.stuck = { unfinishedRuns: unfinished, queued, ...(unfinished.length > 0 ? { unfinishedDetail: await describeUnfinished(pool, unfinished.slice(0, 3)) } : {}) };
  const events = input.events ? await checkEvents(pool, input, input.events.delivered) : undefined;
  if (events) details.events = events.sample;
  return { lost, wrongful, doubled, stuck, details, recoveries: input.recoveries ?? [], ...(events ? { events: events.check } : {}) };
}

/** The `events` count (see CheckerCounts): each deletion's event id against the ids delivered. */
async function checkEvents(pool: pg.Pool, input: CheckerInput, deliveredIds: readonly string[]): Promise<{ check: EventsCheck; sample: Record<string, string[]> }> {
  const expected = (
    await pool.query<{ id: string }>(
      `SELECT policy || ':' || key || ':' || reaper_iso(observed_expiry) AS id FROM cleanup_audit WHERE policy = $1 AND operation_key IS NULL
       UNION ALL
       SELECT $2 || ':' || asset_id || ':' || reaper_iso(retention_expires_at) FROM media_assets WHERE $2::text IS NOT NULL AND status = 'deleted'`,
      [input.rows?.policy ?? null, input.assets?.policy ?? null],
    )
  ).rows.map((row) => row.id);
  const deletions = new Set(expected);
  // An event id is the decision and its deletion (`...:<outbox id>`): the decision is what a
  // deletion in the audit or the table is matched by; a decision delivered under two deletion ids
  // would be two events for one deletion, counted as spurious.
  const decisionOf = (id: string) => id.replace(/:\d+$/, '');
  const deliveredDeletions = new Map<string, Set<string>>();
  for (const id of deliveredIds) deliveredDeletions.set(decisionOf(id), (deliveredDeletions.get(decisionOf(id)) ?? new Set()).add(id));
  const delivered = new Set(deliveredDeletions.keys());
  const missing = [...deletions].filter((id) => !delivered.has(id));
  const spurious = [...delivered].filter((id) => !deletions.has(id) || deliveredDeletions.get(id)!.size > 1);
  const outboxLeft = await outboxEventCount(pool);
  return {
    check: {
      deletions: deletions.size,
      delivered: deliveredIds.length,
      distinct: new Set(deliveredIds).size,
      duplicates: deliveredIds.length - new Set(deliveredIds).size,
      missing: missing.length,
      spurious: spurious.length,
      outboxLeft,
    },
    sample: { missing: missing.slice(0, 5), spurious: spurious.slice(0, 5) },
  };
}

/** The events count that must be zero (missing + spurious); 0 when events were not checked. */
export function eventViolations(report: CheckerReport): number {
  return report.events ? report.events.missing + report.events.spurious : 0;
}

/** The checker table as printed by the fault tests and the chaos run. */
export function formatChecker(report: CheckerReport): string {
  const recovered = report.recoveries.filter((r) => r.ms !== null).map((r) => r.ms!);
  const events = report.events;
  const lines = [
    `| lost | wrongful | doubled | stuck |${events ? ' events |' : ''} faults | longest recovery |`,
    `|-----:|---------:|--------:|------:|${events ? '-------:|' : ''}-------:|-----------------:|`,
    `| ${report.lost} | ${report.wrongful} | ${report.doubled} | ${report.stuck} |${events ? ` ${eventViolations(report)} |` : ''} ${report.recoveries.length} | ${recovered.length ? `${(Math.max(...recovered) / 1000).toFixed(1)} s` : '-'} |`,
  ];
  if (events) {
    lines.push(
      `events: ${events.deletions} deletions, ${events.delivered} delivered (${events.distinct} distinct ids, ${events.duplicates} duplicates), ` +
        `${events.missing} missing, ${events.spurious} spurious, ${events.outboxLeft} left in the outbox`,
    );
  }
  return lines.join('\n');
}

/** Fails with the table and what each count is made of unless all four are zero. */
export function assertCheckerZero(report: CheckerReport): void {
  assert.deepEqual(
    { lost: report.lost, wrongful: report.wrongful, doubled: report.doubled, stuck: report.stuck, events: eventViolations(report) },
    { lost: 0, wrongful: 0, doubled: 0, stuck: 0, events: 0 },
    `checker:\n${formatChecker(report)}\n${JSON.stringify(report.details)}`,
  );
}

/**
 * Recovery after a fault: the time from `since` (the fault's end, epoch ms) to the first batch
 * receipt or confirmed operation committed after it. Polls until `timeoutMs`; null if nothing
 * committed by then, or at once when no work is left to do (every run ended, every ledger
 * operation done: the work finished before `since`, so there is nothing to recover, and waiting
 * out the whole timeout only made the fault tests 30 s longer).
 */
export async function measureRecovery(pool: pg.Pool, fault: string, since: number, timeoutMs = 60_000): Promise<Recovery> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const found = await pool
      .query<{ at: number | null; work_left: boolean }>(
        `SELECT (extract(epoch FROM least(
            (SELECT min(completed_at) FROM cleanup_batches WHERE completed_at > to_timestamp($1 / 1000.0)),
            (SELECT min(completed_at) FROM cleanup_ledger WHERE completed_at > to_timestamp($1 / 1000.0)))) * 1000)::float8 AS at,
           EXISTS (SELECT 1 FROM cleanup_runs WHERE state IN ('pending', 'scanning', 'published', 'awaiting-approval'))
             OR EXISTS (SELECT 1 FROM cleanup_ledger WHERE state <> 'done') AS work_left`,
        [since],
      )
      .then((result) => result.rows[0]!)
      .catch(() => null); // the database itself may still be coming back
    if (found?.at != null) return { fault, ms: Math.max(0, Math.round(found.at - since)) };
    if (found && !found.work_left) return { fault, ms: null };
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  return { fault, ms: null };
}

/**
 * What a stuck run left behind, for the report (a chaos database is dropped afterwards): its row,
 * its receipts, and each kept remote batch of it with its ledger operations by state and outcome.
 * A diagnostic only: a query that fails is reported as its message, never as a check.
 */
async function describeUnfinished(pool: pg.Pool, runs: ReadonlyArray<{ run_id: string }>): Promise<unknown[]> {
  const described: unknown[] = [];
  for (const run of runs) {
    try {
      const row = (
        await pool.query<{ run: unknown; receipts: number }>(
          `SELECT to_jsonb(r) AS run, (SELECT count(*)::int FROM cleanup_batches b WHERE b.run_id = r.run_id) AS receipts FROM cleanup_runs r WHERE r.run_id::text = $1`,
          [run.run_id],
        )
      ).rows[0];
      const kept = (
        await pool.query<{ batch_id: string; ledger: unknown }>(
          `SELECT k.batch_id,
                  (SELECT jsonb_object_agg(s.state_outcome, s.n) FROM (
                     SELECT l.state || '/' || coalesce(l.outcome, '-') AS state_outcome, count(*)::int AS n
                     FROM cleanup_ledger l WHERE l.batch_id = k.batch_id GROUP BY 1) s) AS ledger
           FROM cleanup_remote_batches k WHERE convert_from(k.content, 'UTF8')::jsonb ->> 'runId' = $1 ORDER BY k.batch_id LIMIT 20`,
          [run.run_id],
        )
      ).rows;
      described.push({ runId: run.run_id, run: row?.run ?? null, receipts: row?.receipts ?? null, keptBatches: kept });
    } catch (error) {
      described.push({ runId: run.run_id, error: (error as Error).message });
    }
  }
  return described;
}
