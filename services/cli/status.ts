import { Command, Option } from 'commander';
import type { Env } from '../../shared/config/env';
import { eventsEnabled, type Policy, type PolicySet } from '../../shared/config/policies';
import { brokerNames, DELAY_TIERS_MS } from '../../shared/amqp/topology';
import { admissionList, replicationLagRead } from '../../shared/db/queries/admission';
import { admissionViews } from '../../shared/admission/overrides';
import { adaptiveAdmission } from '../../shared/admission/rows';
import { ledgerCountsByPolicy } from '../../shared/db/queries/ledger';
import { outboxCountUpTo, outboxOldestAges } from '../../shared/db/queries/outbox';
import type { Db } from '../../shared/db/pool';
import { ELIGIBLE_ROWS_CAP } from '../../shared/db/queries/backlog';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { runsListSummaries } from '../../shared/db/queries/runs';
import { readBacklog } from '../scheduler/backlog-gauges';
import { describe as describeAdmission } from './admission';
import { context, withPool } from './common';
import { connectBroker } from './connections';
import { formatDuration, outputWidth, printResult, table, wrap } from './output';
import { describeWindow, outsideWindowMessage, windowStateAt } from '../../shared/schedule/window';

/** `reaper status`: per policy what the database and the broker say now. */

async function collectStatus(env: Env, policies: PolicySet) {
  return withPool(env, async (pool) => {
    // The same reads as the scheduler's backlog gauges; a policy whose table cannot be resolved shows nulls.
    const targets = new Map<string, ResolvedTarget>();
    for (const policy of policies.values()) {
      const target = await targetResolve(pool, policy).catch(() => null); // reported as unknown (null) below
      if (target) targets.set(policy.name, target);
    }
    const backlog = new Map((await readBacklog(pool, [...policies.values()], targets)).map((entry) => [entry.policy, entry]));
    const ledger = new Map((await ledgerCountsByPolicy(pool)).map((row) => [row.policy, row]));
    const admission = new Map((await admissionList(pool)).map((row) => [row.policy, row]));
    const inForce = new Map((await admissionViews(pool, [...policies.values()])).map((view) => [view.policy, view]));
    const replication = await replicationLagRead(pool);
    const recent = await runsListSummaries(pool, { limit: 500 });
    const depths = await queueDepths(env, [...policies.keys()]);
    const events = await eventsStatus(pool, [...policies.values()]);
    const brokerError = depths.error;
    const now = new Date();
    return {
      policies: [...policies.values()].map((policy) => {
        const last = recent.find((run) => run.policy === policy.name);
        const counts = ledger.get(policy.name);
        const waiting = backlog.get(policy.name);
        return {
          policy: policy.name,
          kind: policy.kind,
          oldestEligibleAgeSeconds: waiting ? roundSeconds(waiting.target.oldestEligibleAgeSeconds) : null,
          oldestLeasedAgeSeconds: waiting ? roundSeconds(waiting.ledger?.oldestLeasedAgeSeconds ?? 0) : null,
          waitingRows: waiting?.target.eligibleRows ?? null,
          waitingRowsCapped: waiting ? waiting.target.eligibleRows >= ELIGIBLE_ROWS_CAP : null,
          lastCompletedRun: waiting?.lastCompleted?.runId ?? null,
          lastCompletedAt: waiting?.lastCompleted?.finishedAt ?? null,
          lastCompletedLagSeconds: waiting?.lastCompleted ? roundSeconds(waiting.lastCompleted.lagSeconds) : null,
          paused: admission.get(policy.name)?.paused ?? false,
          // Schedule window: null without one; closed means no run starts and workers delete nothing.
          window: scheduleWindowStatus(policy.window, now),
          // Live admission (file values, `reaper admission set` override with who and when, in force).
          admission: inForce.get(policy.name)!,
          // Adaptive row-delete admission (null when off): the shared rate (null until its first
          // admission) and the pressure its last step reacted to (1: quiet-time latency).
          adaptive:
            policy.kind === 'row-delete' && adaptiveAdmission(policy)
              ? { rowsPerSecond: admission.get(policy.name)?.adaptiveRate ?? null, pressure: admission.get(policy.name)?.adaptivePressure ?? null, steppedAt: admission.get(policy.name)?.adaptedAt ?? null }
              : null,
          // row-delete replica-lag brake: engaged while a standby's replay lag is over the maximum.
          brake:
            policy.kind === 'row-delete' && policy.brake
              ? { maxReplicationLagSeconds: policy.brake.maxReplicationLagSeconds, lagSeconds: roundSeconds(replication.lagSeconds), standbys: replication.standbys, engaged: replication.lagSeconds > policy.brake.maxReplicationLagSeconds }
              : null,
          lastRun: last?.createdAt ?? null,
          lastRunState: last?.state ?? null,
          // Why the last run failed or is incomplete (null when it did not).
          lastRunError: last?.error ?? null,
          // The brake's counts of the last run: what it counted last, and what an operator approved.
          lastRunCounted: last?.countedCandidates ?? null,
          lastRunApproved: last?.approvedCandidates ?? null,
          queued: depths.work.get(policy.name) ?? null,
          pending: counts?.pending ?? 0,
          inFlight: counts?.inFlight ?? 0,
          confirmed: counts?.confirmed ?? 0,
          rejected: counts?.rejected ?? 0,
          gaveUp: counts?.gaveUp ?? 0,
          // Expiry events (null when off): unpublished events (counted up to the limit) and whether
          // the policy's deletions are paused because the outbox reached events.maxOutbox.
          events: events.get(policy.name) ?? null,
        };
      }),
      deadLetters: depths.deadLetters,
      delayed: depths.delayed,
      brokerError,
    };
  });
}

/** A policy's schedule window now: open until when, or "outside window, opens at ...". */
function scheduleWindowStatus(window: Policy['window'], now: Date) {
  if (!window) return null;
  const state = windowStateAt(window, now);
  return state.open
    ? { window: describeWindow(window), open: true, closesAt: state.closesAt!.toISOString(), opensAt: null, summary: `open (${describeWindow(window)}), closes at ${state.closesAt!.toISOString()}` }
    : { window: describeWindow(window), open: false, closesAt: null, opensAt: state.opensAt.toISOString(), summary: outsideWindowMessage(window, state.opensAt) };
}

/** Per policy with expiry events: its outbox as the workers' limit check sees it (services/worker/outbox-limit.ts). */
export async function eventsStatus(pool: Db, policies: readonly Policy[]) {
  const withEvents = policies.filter(eventsEnabled);
  const ages = new Map((await outboxOldestAges(pool, withEvents.map((policy) => policy.name))).map((row) => [row.policy, row.oldestAgeSeconds]));
  const result = new Map<string, { outbox: number; maxOutbox: number; oldestAgeSeconds: number; paused: boolean }>();
  for (const policy of withEvents) {
    const maxOutbox = policy.events!.maxOutbox;
    const outbox = await outboxCountUpTo(pool, policy.name, maxOutbox);
    result.set(policy.name, { outbox, maxOutbox, oldestAgeSeconds: roundSeconds(ages.get(policy.name) ?? 0), paused: outbox >= maxOutbox });
  }
  return result;
}

/** The line naming a policy whose deletions the outbox limit paused, and what to check. */
export function outboxFullLine(policy: string, events: { outbox: number; maxOutbox: number }): string {
  return `${policy}: deletions paused: ${events.outbox}+ expiry events unpublished (events.maxOutbox ${events.maxOutbox}); is \`reaper relay\` running, and a queue bound to the events exchange?`;
}

/** Ages to the millisecond: enough for an operator, and stable in JSON. */
function roundSeconds(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

/**
 * Message counts of the work queues, the delay tiers (retries waiting out their delay) and the
 * dead-letter queue; null where the broker does not answer, with the reason in `error`.
 */
async function queueDepths(
  env: Env,
  policyNames: string[],
): Promise<{ work: Map<string, number>; deadLetters: number | null; delayed: number | null; error: string | null }> {
  const names = brokerNames(env.amqpPrefix);
  const work = new Map<string, number>();
  let deadLetters: number | null = null;
  let delayed: number | null = null;
  let error: string | null = null;
  try {
    const connection = await connectBroker(env, { timeout: 5000 });
    try {
      for (const policy of policyNames) {
        const channel = await connection.createChannel();
        channel.on('error', () => undefined); // a missing queue closes the channel; reported as null
        const found = await channel.checkQueue(names.workQueue(policy)).catch(() => null);
        if (found) work.set(policy, found.messageCount);
        await channel.close().catch(() => undefined);
      }
      const channel = await connection.createChannel();
      channel.on('error', () => undefined);
      deadLetters = (await channel.checkQueue(names.deadLetterQueue).catch(() => null))?.messageCount ?? null;
      // Each tier on its own channel: a missing tier queue closes the channel it was checked on.
      for (const tier of DELAY_TIERS_MS) {
        const tierChannel = await connection.createChannel();
        tierChannel.on('error', () => undefined);
        const found = await tierChannel.checkQueue(names.delayQueue(tier)).catch(() => null);
        if (found) delayed = (delayed ?? 0) + found.messageCount;
        await tierChannel.close().catch(() => undefined);
      }
    } finally {
      await connection.close().catch(() => undefined);
    }
  } catch (failure) {
    // Broker unreachable: the status still shows what the database knows, says why not more, and
    // exits 1 (a script or a probe must not read "unknown" as fine).
    error = (failure as Error).message;
  }
  return { work, deadLetters, delayed, error };
}

/** Registers `reaper status`. */
export function registerStatusCommand(program: Command): void {
  program
    .command('status')
    .description('per policy: backlog age and size, last runs, queue depths, ledger states, and what holds a policy back; exit 1 when the broker cannot be reached')
    .addOption(new Option('--wide', 'every column (admission, adaptive rate, brake, outbox, each ledger state, ...) on one line per policy'))
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (options: { json?: boolean; wide?: boolean }) => {
      const { env, policies } = context();
      const status = await collectStatus(env, policies);
      printResult(!!options.json, status, () => (options.wide ? wideStatus(status) : narrowStatus(status, outputWidth())));
      if (status.brokerError) process.exitCode = 1;
    });
}

type Status = Awaited<ReturnType<typeof collectStatus>>;
type PolicyStatus = Status['policies'][number];

const ageOf = (seconds: number | null): string | null => (seconds === null ? null : formatDuration(seconds));
const waitingOf = (row: PolicyStatus): string | null => (row.waitingRows === null ? null : `${row.waitingRows}${row.waitingRowsCapped ? '+' : ''}`);
const lastRunAgeSeconds = (row: PolicyStatus, now: number): number | null => (row.lastRun === null ? null : Math.max(0, (now - Date.parse(row.lastRun)) / 1000));

/**
 * The default view (fits 120 columns for policy names up to about 25 characters): one line per
 * policy with the numbers an operator scans, then a line per policy for what holds it back or
 * needs a decision (paused, window closed, brake engaged, outbox full, an override, the last run's
 * reason), wrapped, never cut. `--wide` and `--json` carry everything.
 */
function narrowStatus(status: Status, width: number): string {
  const now = Date.now();
  const rows = status.policies.map((row) => ({
    policy: row.policy,
    kind: row.kind,
    waiting: waitingOf(row),
    oldest: ageOf(row.oldestEligibleAgeSeconds),
    lag: ageOf(row.lastCompletedLagSeconds),
    'last run': row.lastRunState === null ? null : `${row.lastRunState} ${formatDuration(lastRunAgeSeconds(row, now) ?? 0)} ago`,
    queued: row.queued,
    pending: row.pending,
    leased: row.inFlight,
    review: row.rejected + row.gaveUp,
  }));
  const notes = status.policies.flatMap((row) => {
    const said = policyNotes(row);
    return said.length === 0 ? [] : [wrap(`${row.policy}: ${said.join('; ')}`, width, 2)];
  });
  return [
    table(rows, ['policy', 'kind', 'waiting', 'oldest', 'lag', 'last run', 'queued', 'pending', 'leased', 'review']),
    ...notes,
    ...brokerLines(status, width),
    wrap("(waiting: expired rows; oldest: the oldest one's age; lag: the last completed run's; review: rejected + gave up)", width, 1),
  ].join('\n');
}

/** What holds a policy back or asks for a decision; nothing when it runs as configured (a full outbox has its own line: brokerLines). */
function policyNotes(row: PolicyStatus): string[] {
  return [
    ...(row.paused ? ['PAUSED (reaper resume)'] : []),
    ...(row.window && !row.window.open ? [row.window.summary] : []),
    ...(row.brake?.engaged ? [`replica-lag brake ENGAGED (lag ${formatDuration(row.brake.lagSeconds)}, max ${formatDuration(row.brake.maxReplicationLagSeconds)})`] : []),
    ...(row.admission.override ? [`admission ${admissionText(row)}`] : []),
    ...(row.lastRunState === 'awaiting-approval' ? [`last run awaits approval: counted ${row.lastRunCounted ?? '-'} (reaper runs --policy ${row.policy})`] : []),
    ...(row.lastRunError !== null && row.lastRunState !== 'awaiting-approval' ? [`last run ${row.lastRunState}: ${row.lastRunError}`] : []),
  ];
}

function admissionText(row: PolicyStatus): string {
  return `${describeAdmission(row.admission.inForce, row.admission.rateUnit)}${row.admission.override ? ` (override by ${row.admission.override.setBy})` : ''}`;
}

/** The broker's part: messages in delay tiers and dead letters, or why the broker could not say. */
function brokerLines(status: Status, width: number): string[] {
  const outboxFull = status.policies.filter((row) => row.events?.paused).map((row) => wrap(outboxFullLine(row.policy, row.events!), width, 2));
  if (status.brokerError) return [...outboxFull, wrap(`queue counts unknown: ${status.brokerError}`, width, 2)];
  return [`delay tiers (retries waiting): ${status.delayed ?? 0} message(s); dead-letter queue: ${status.deadLetters ?? 0} message(s)`, ...outboxFull];
}

/** `--wide`: every column on one line per policy, as wide as it takes. */
function wideStatus(status: Status): string {
  return [
    table(
      status.policies.map((row) => ({
        ...row,
        oldestEligible: ageOf(row.oldestEligibleAgeSeconds),
        oldestLeased: ageOf(row.oldestLeasedAgeSeconds),
        waiting: waitingOf(row),
        lastCompleted: row.lastCompletedAt,
        lag: ageOf(row.lastCompletedLagSeconds),
        admission: admissionText(row),
        window: row.window?.summary ?? null,
        events:
          row.events === null
            ? null
            : `${row.events.paused ? 'PAUSED (outbox full) ' : ''}outbox ${row.events.outbox}${row.events.paused ? '+' : ''}/${row.events.maxOutbox}, oldest ${formatDuration(row.events.oldestAgeSeconds)}`,
        adaptive:
          row.adaptive === null
            ? null
            : row.adaptive.rowsPerSecond === null
              ? 'on (not started)'
              : `${Math.round(row.adaptive.rowsPerSecond)} rows/s${row.adaptive.pressure === null ? '' : ` (pressure ${row.adaptive.pressure.toFixed(2)})`}`,
        brake: row.brake === null ? null : `${row.brake.engaged ? 'ENGAGED' : 'off'} (lag ${formatDuration(row.brake.lagSeconds)}, max ${formatDuration(row.brake.maxReplicationLagSeconds)})`,
      })),
      ['policy', 'kind', 'window', 'paused', 'admission', 'adaptive', 'brake', 'events', 'oldestEligible', 'oldestLeased', 'waiting', 'lastCompleted', 'lag', 'lastRun', 'lastRunState', 'lastRunCounted', 'lastRunApproved', 'lastRunError', 'queued', 'pending', 'inFlight', 'confirmed', 'rejected', 'gaveUp'],
    ),
    ...brokerLines(status, Number.MAX_SAFE_INTEGER),
  ].join('\n');
}
