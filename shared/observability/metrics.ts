import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';

/**
 * Prometheus metrics. Outcomes are separate label values, never summed into one "processed"
 * number: deleted, noop, retry, dead-lettered are different facts (docs/design.md invariant 5).
 */
export function makeMetrics() {
  const registry = new Registry();
  collectDefaultMetrics({ register: registry });
  return {
    registry,
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
      help: 'Messages sent to the dead-letter queue, by reason',
      labelNames: ['reason'] as const,
      registers: [registry],
    }),
    batchSeconds: new Histogram({
      name: 'reaper_batch_duration_seconds',
      help: 'Time from delivery to settle, per batch',
      labelNames: ['policy'] as const,
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
      registers: [registry],
    }),
    runsTotal: new Counter({
      name: 'reaper_runs_total',
      help: 'Runs created by this scheduler, by policy and trigger',
      labelNames: ['policy', 'trigger'] as const,
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
  };
}

export type Metrics = ReturnType<typeof makeMetrics>;
