import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { promClient } from '../lazy-modules';
import type { DeadLetterReason } from '../contracts/batch';

/** The policies a process serves: the only values a `policy` label may take (plus UNKNOWN_POLICY). */
export interface MetricPolicy {
  name: string;
  kind: 'row-delete' | 'remote-delete';
}

/** The `policy` label of a message that names no configured policy: keeps the label set bounded. */
export const UNKNOWN_POLICY = '(unknown)';

const DEAD_LETTER_REASONS = Object.keys({
  'invalid-json': true,
  'invalid-message': true,
  'unsupported-version': true,
  'unknown-policy': true,
  'too-large': true,
  'delivery-limit': true,
  rejected: true,
} satisfies Record<DeadLetterReason, true>) as DeadLetterReason[];

/** Label values known up front; each counter starts at 0 for each of them (an absent series is not a zero). */
export const KNOWN_LABELS = {
  itemOutcomes: ['deleted', 'noop'],
  batchOutcomes: ['done', 'duplicate', 'retry', 'dead-lettered', 'unknown'],
  runTriggers: ['cron', 'catch-up', 'replay', 'manual'],
  remoteCallOutcomes: ['confirmed', 'rate-limited', 'uncertain', 'rejected', 'circuit-open'],
  operationResults: ['confirmed', 'rate-limited', 'uncertain', 'rejected', 'gave-up', 'circuit-open', 'grant-expired', 'stale-lease'],
  /** Finished ledger operations (cleanup_ledger.outcome). */
  ledgerOutcomes: ['confirmed', 'rejected', 'gave-up', 'superseded', 'held'],
  /** Classes of a remote call that was made (docs/design.md "Remote API calls"). */
  attemptClasses: ['confirmed', 'rate-limited', 'uncertain', 'rejected'],
  deadLetterReasons: DEAD_LETTER_REASONS,
} as const;

/** Seconds from a row's expiry to the commit that deleted it: seconds (a busy minute) to days (a stuck policy). */
const DELETION_LAG_BUCKETS = [1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400, 259200];
const RUN_DURATION_BUCKETS = [0.5, 1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200];

/** package.json's version, from the source tree or from dist/. */
function buildVersion(): string {
  for (const candidate of [path.resolve(__dirname, '..', '..', 'package.json'), path.resolve(__dirname, '..', '..', '..', 'package.json')]) {
    if (!existsSync(candidate)) continue;
    try {
      const version = (JSON.parse(readFileSync(candidate, 'utf8')) as { version?: unknown }).version;
      if (typeof version === 'string') return version;
    } catch {
      // Not readable as JSON: try the next candidate, else 'unknown'.
    }
  }
  return 'unknown';
}

/**
 * Prometheus metrics. Outcomes are separate label values, never summed into one "processed"
 * number: deleted, noop, retry, dead-lettered are different facts (docs/design.md invariant 5).
 * Given the configured policies, every counter with a known label set starts at 0.
 */
export function makeMetrics(policies: readonly MetricPolicy[] = []) {
  const { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } = promClient();
  const registry = new Registry();
  collectDefaultMetrics({ register: registry });
  const policyNames = new Set(policies.map((policy) => policy.name));
  const metrics = {
    registry,
    /** The `policy` label for a name a message claims: the name if configured, else UNKNOWN_POLICY. */
    policyLabel: (name: string): string => (policyNames.has(name) ? name : UNKNOWN_POLICY),
    itemsTotal: new Counter({
      name: 'reaper_items_total',
      help: 'Items handled by workers, by policy and outcome (deleted, noop)',
      labelNames: ['policy', 'outcome'] as const,
      registers: [registry],
    }),
    batchesTotal: new Counter({
      name: 'reaper_batches_total',
      help: 'Batch deliveries settled by workers, by outcome (done, duplicate, retry, dead-lettered)',
      labelNames: ['policy', 'outcome'] as const,
      registers: [registry],
    }),
    deadLetteredTotal: new Counter({
      name: 'reaper_dead_lettered_total',
      help: 'Messages sent to the dead-letter queue, by reason and policy (a configured name or "(unknown)")',
      labelNames: ['reason', 'policy'] as const,
      registers: [registry],
    }),
    batchSeconds: new Histogram({
      name: 'reaper_batch_duration_seconds',
      help: 'Time from delivery to settle, per batch',
      labelNames: ['policy'] as const,
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
      registers: [registry],
    }),
    messageHoldSeconds: new Histogram({
      name: 'reaper_message_hold_seconds',
      help: 'Time a worker kept a delivered message before settling it (ack, delay tier, dead letter or requeue): bounded, docs/design.md invariant 18',
      labelNames: ['policy'] as const,
      buckets: [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 8, 10, 15, 20, 30, 60],
      registers: [registry],
    }),
    runsTotal: new Counter({
      name: 'reaper_runs_total',
      help: 'Runs created by this scheduler, by policy and trigger',
      labelNames: ['policy', 'trigger'] as const,
      registers: [registry],
    }),
    runsDeferredTotal: new Counter({
      name: 'reaper_runs_deferred_total',
      help: 'remote-delete runs that published nothing because an earlier run of the policy still had batches in the broker, by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    batchesPublishedTotal: new Counter({
      name: 'reaper_batches_published_total',
      help: 'Batches confirmed by the broker, by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    candidatesTotal: new Counter({
      name: 'reaper_candidates_total',
      help: 'Expired candidates found by scans, by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    runsFailedTotal: new Counter({
      name: 'reaper_runs_failed_total',
      help: 'Runs this scheduler ended as failed (a permanent error; the reason is on the run), by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    runsAwaitingApprovalTotal: new Counter({
      name: 'reaper_runs_awaiting_approval_total',
      help: 'Runs stopped by the blast-radius brake (over limits.maxPerRun or maxFractionPerRun) before publishing, by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    runsIncompleteTotal: new Counter({
      name: 'reaper_runs_incomplete_total',
      help: 'Published runs ended as incomplete (batches without a receipt and no progress), by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    rowsSkippedTotal: new Counter({
      name: 'reaper_rows_skipped_total',
      help: 'Expired rows scans could not publish (key longer than a message may carry), by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    remoteCallsTotal: new Counter({
      name: 'reaper_remote_calls_total',
      help: 'Remote API calls, by policy and classified outcome',
      labelNames: ['policy', 'outcome'] as const,
      registers: [registry],
    }),
    operationsTotal: new Counter({
      name: 'reaper_operations_total',
      help: 'Ledger operation transitions, by policy and result',
      labelNames: ['policy', 'result'] as const,
      registers: [registry],
    }),
    amqpConnected: new Gauge({ name: 'reaper_amqp_connected', help: '1 while the broker connection is up', registers: [registry] }),
    buildInfo: new Gauge({ name: 'reaper_build_info', help: 'Always 1; the version label says which build runs', labelNames: ['version'] as const, registers: [registry] }),

    // Deletion lag and run health (workers observe the lag, the scheduler the runs).
    deletionLagSeconds: new Histogram({
      name: 'reaper_deletion_lag_seconds',
      help: "Commit time of a deletion minus the deleted row's expiry: the gap between eligibility and completion",
      labelNames: ['policy'] as const,
      buckets: DELETION_LAG_BUCKETS,
      registers: [registry],
    }),
    runDurationSeconds: new Histogram({
      name: 'reaper_run_duration_seconds',
      help: 'Per completed run: created to completed (every confirmed batch has a receipt)',
      labelNames: ['policy'] as const,
      buckets: RUN_DURATION_BUCKETS,
      registers: [registry],
    }),

    // Backlog gauges: read from PostgreSQL by every scheduler replica (aggregate with max by (policy)).
    oldestEligibleAgeSeconds: new Gauge({
      name: 'reaper_oldest_eligible_age_seconds',
      help: 'Now minus the expiry of the oldest row reaper may delete now: guard true, expired, no legal hold, not in review (0 when none)',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    outboxOldestAgeSeconds: new Gauge({
      name: 'reaper_outbox_oldest_age_seconds',
      help: 'Expiry events: now minus the deletion time of the oldest event not yet published by `reaper relay` (0 when none)',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    oldestRunnableAgeSeconds: new Gauge({
      name: 'reaper_oldest_runnable_age_seconds',
      help: 'remote-delete: now minus not_before of the oldest pending operation that is due (0 when none)',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    oldestLeasedAgeSeconds: new Gauge({
      name: 'reaper_oldest_leased_age_seconds',
      help: 'Age of the oldest in-flight lease, since it was claimed (0 when none; row-delete holds none)',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    eligibleRows: new Gauge({
      name: 'reaper_eligible_rows',
      help: 'Expired rows reaper may delete now (guard true, no legal hold, not in review), counted up to a cap of 10000',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    heldRows: new Gauge({
      name: 'reaper_held_rows',
      help: 'Expired rows (guard true) kept by an active legal hold, counted up to a cap of 10000: not a backlog',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    reviewRows: new Gauge({
      name: 'reaper_review_rows',
      help: 'remote-delete: expired rows whose operation ended rejected or gave-up (a person decides), counted up to a cap of 10000',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    ledgerOperations: new Gauge({
      name: 'reaper_ledger_operations',
      help: 'remote-delete ledger operations by state and outcome ("" while not finished)',
      labelNames: ['policy', 'state', 'outcome'] as const,
      registers: [registry],
    }),
    lastCompletedRunTimestampSeconds: new Gauge({
      name: 'reaper_last_completed_run_timestamp_seconds',
      help: 'When the latest completed run of the policy finished (absent until one has)',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    runs: new Gauge({
      name: 'reaper_runs',
      help: 'Runs by state, every state but completed (see reaper_last_completed_run_timestamp_seconds)',
      labelNames: ['policy', 'state'] as const,
      registers: [registry],
    }),
    scheduleIntervalSeconds: new Gauge({
      name: 'reaper_schedule_interval_seconds',
      help: "Seconds between two ticks of the policy's schedule (what backlog alerts scale with)",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    leaseSeconds: new Gauge({
      name: 'reaper_lease_seconds',
      help: "remote-delete: the policy's lease on a claimed operation (leaseMs)",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    backlogRefreshTimestampSeconds: new Gauge({
      name: 'reaper_backlog_refresh_timestamp_seconds',
      help: 'When the backlog gauges were last read from the database successfully',
      registers: [registry],
    }),
    backlogRefreshFailuresTotal: new Counter({
      name: 'reaper_backlog_refresh_failures_total',
      help: 'Backlog gauge refreshes that failed (the gauges keep their previous values)',
      registers: [registry],
    }),

    // Remote side. Counters are incremented by the remote-delete worker; the admission gauges are
    // read from cleanup_admission by the scheduler (global state), the breaker gauge per worker.
    remoteGrantsAdmittedTotal: new Counter({
      name: 'reaper_remote_grants_admitted_total',
      help: 'Admission grants (tokens) handed out to calls, by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    remoteOperationsClaimedTotal: new Counter({
      name: 'reaper_remote_operations_claimed_total',
      help: 'Ledger operations claimed (pending or expired lease to in_flight), by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    remoteOperationsCompletedTotal: new Counter({
      name: 'reaper_remote_operations_completed_total',
      help: 'Ledger operations finished, by policy and outcome (confirmed, rejected, gave-up, superseded)',
      labelNames: ['policy', 'outcome'] as const,
      registers: [registry],
    }),
    remoteRateLimitedTotal: new Counter({
      name: 'reaper_remote_rate_limited_total',
      help: 'HTTP 429 answers from the remote API, by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    remoteAttemptsTotal: new Counter({
      name: 'reaper_remote_attempts_total',
      help: 'Remote calls made, by policy and outcome class (confirmed, rate-limited, uncertain, rejected)',
      labelNames: ['policy', 'class'] as const,
      registers: [registry],
    }),
    circuitOpen: new Gauge({
      name: 'reaper_circuit_open',
      help: "1 while this worker's circuit breaker for the policy's remote is open (half-open counts as open)",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    admissionRatePerSecond: new Gauge({
      name: 'reaper_admission_rate_per_second',
      help: "remote-delete: the policy's configured call rate (admission.ratePerSecond), to draw the limit beside the rate",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    admissionPaused: new Gauge({
      name: 'reaper_admission_paused',
      help: '1 while remote calls of the policy are paused (reaper pause)',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    admissionBlockedUntilTimestampSeconds: new Gauge({
      name: 'reaper_admission_blocked_until_timestamp_seconds',
      help: "Until when a remote 429 blocks the policy's calls (0 when not blocked)",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    // Schedule windows (policy key window), set by the scheduler: backlog alerts stay silent while closed.
    policyWindowOpen: new Gauge({
      name: 'reaper_policy_window_open',
      help: "1 while the policy's schedule window is open (always 1 without a window), 0 outside it",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    policyWindowOpensAtSeconds: new Gauge({
      name: 'reaper_policy_window_opens_at_seconds',
      help: "Outside the policy's schedule window: when it opens next (Unix seconds); absent while open",
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
  };
  metrics.buildInfo.set({ version: buildVersion() }, 1);
  initialiseKnownSeries(metrics, policies);
  return metrics;
}

/** Every counter with a known label set starts at 0, so rate() and "absent means zero" never differ. */
function initialiseKnownSeries(metrics: Omit<Metrics, 'policyLabel'>, policies: readonly MetricPolicy[]): void {
  metrics.backlogRefreshFailuresTotal.inc(0);
  for (const reason of KNOWN_LABELS.deadLetterReasons) metrics.deadLetteredTotal.inc({ reason, policy: UNKNOWN_POLICY }, 0);
  for (const { name: policy, kind } of policies) {
    for (const outcome of KNOWN_LABELS.itemOutcomes) metrics.itemsTotal.inc({ policy, outcome }, 0);
    for (const outcome of KNOWN_LABELS.batchOutcomes) metrics.batchesTotal.inc({ policy, outcome }, 0);
    for (const reason of KNOWN_LABELS.deadLetterReasons) metrics.deadLetteredTotal.inc({ reason, policy }, 0);
    for (const trigger of KNOWN_LABELS.runTriggers) metrics.runsTotal.inc({ policy, trigger }, 0);
    metrics.batchesPublishedTotal.inc({ policy }, 0);
    metrics.candidatesTotal.inc({ policy }, 0);
    metrics.deletionLagSeconds.zero({ policy });
    metrics.runDurationSeconds.zero({ policy });
    metrics.messageHoldSeconds.zero({ policy });
    if (kind !== 'remote-delete') continue;
    for (const outcome of KNOWN_LABELS.remoteCallOutcomes) metrics.remoteCallsTotal.inc({ policy, outcome }, 0);
    for (const result of KNOWN_LABELS.operationResults) metrics.operationsTotal.inc({ policy, result }, 0);
    metrics.remoteGrantsAdmittedTotal.inc({ policy }, 0);
    metrics.remoteOperationsClaimedTotal.inc({ policy }, 0);
    for (const outcome of KNOWN_LABELS.ledgerOutcomes) metrics.remoteOperationsCompletedTotal.inc({ policy, outcome }, 0);
    metrics.remoteRateLimitedTotal.inc({ policy }, 0);
    for (const attemptClass of KNOWN_LABELS.attemptClasses) metrics.remoteAttemptsTotal.inc({ policy, class: attemptClass }, 0);
    metrics.circuitOpen.set({ policy }, 0);
  }
}

export type Metrics = ReturnType<typeof makeMetrics>;
