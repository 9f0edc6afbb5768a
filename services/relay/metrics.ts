import type { Registry } from 'prom-client';
import { promClient } from '../../shared/lazy-modules';
import { UNKNOWN_POLICY } from '../../shared/observability/metrics';

/**
 * The relay's own series, on the registry of its process (makeMetrics: the default process
 * metrics, reaper_build_info, reaper_amqp_connected): what `reaper relay` serves on /metrics. Only
 * the relay registers them, so a scheduler or worker never exports a relay's last pass as 0.
 */
export function makeRelayMetrics(registry: Registry, policies: readonly string[]) {
  const { Counter, Gauge } = promClient();
  const configured = new Set(policies);
  const metrics = {
    /** The `policy` label of an outbox row's policy: the name if configured, else UNKNOWN_POLICY (a bounded label set). */
    policyLabel: (name: string): string => (configured.has(name) ? name : UNKNOWN_POLICY),
    eventsPublishedTotal: new Counter({
      name: 'reaper_relay_events_published_total',
      help: 'Expiry events the relay published and the broker confirmed and routed (so they left the outbox), by policy',
      labelNames: ['policy'] as const,
      registers: [registry],
    }),
    eventsUnroutableTotal: new Counter({
      name: 'reaper_relay_events_unroutable_total',
      help: 'Expiry events the broker returned as unroutable (no queue bound for the routing key: they stay in the outbox and are tried again, each try counted), by routing key',
      labelNames: ['routing_key'] as const,
      registers: [registry],
    }),
    passesFailedTotal: new Counter({
      name: 'reaper_relay_passes_failed_total',
      help: 'Relay passes that failed (database or broker trouble, an event nacked or not confirmed): their events stay in the outbox and are published again',
      registers: [registry],
    }),
    lastPassTimestampSeconds: new Gauge({
      name: 'reaper_relay_last_pass_timestamp_seconds',
      help: 'When a relay pass last ended without a failure, an empty outbox or an unroutable routing key included (0 until one has)',
      registers: [registry],
    }),
  };
  // An absent series is not a zero: every configured policy's count starts at 0.
  for (const policy of policies) metrics.eventsPublishedTotal.inc({ policy }, 0);
  metrics.passesFailedTotal.inc(0);
  metrics.lastPassTimestampSeconds.set(0);
  return metrics;
}

export type RelayMetrics = ReturnType<typeof makeRelayMetrics>;
