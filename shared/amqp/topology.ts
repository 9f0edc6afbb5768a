import type { Options } from 'amqplib';
import type { Channel } from 'amqplib';
import { BROKER_ROLES, brokerPermissions, brokerUserName } from './permissions';

/**
 * Every exchange, queue and binding reaper uses, as data (docs/design.md, "Broker topology"). Both
 * services assert it at start-up and after each reconnect; `reaper topology` prints it.
 */

export interface ExchangeSpec {
  name: string;
  type: 'direct' | 'headers' | 'topic';
  options: Options.AssertExchange;
}
export interface QueueSpec {
  name: string;
  options: Options.AssertQueue;
}
export interface BindingSpec {
  queue: string;
  exchange: string;
  routingKey: string;
  args?: Record<string, unknown>;
}
export interface Topology {
  exchanges: ExchangeSpec[];
  queues: QueueSpec[];
  bindings: BindingSpec[];
}

/** Delay tiers in milliseconds. A delay takes the longest tier that does not exceed it; the remainder is delayed again on arrival. */
export const DELAY_TIERS_MS = [100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 120_000, 600_000] as const;

export interface BrokerNames {
  workExchange: string;
  delayExchange: string;
  deadLetterQueue: string;
  /** Expiry events (`reaper relay`), routing key `<policy>.expired` (shared/contracts/expiry-event.ts). */
  eventsExchange: string;
  workQueue(policy: string): string;
  delayQueue(ms: number): string;
  /**
   * A worker process's proof that it consumes `policy` now, for the batch-version gate: an
   * auto-delete queue it consumes on the channel of its work consumer (services/worker/batch-versions.ts).
   * Not part of the declared topology: it exists only while that consumer does.
   */
  presenceQueue(policy: string, instanceId: string): string;
}

export function brokerNames(prefix: string): BrokerNames {
  return {
    workExchange: `${prefix}.cleanup`,
    delayExchange: `${prefix}.delay`,
    deadLetterQueue: `${prefix}.dead-letter`,
    eventsExchange: `${prefix}.events`,
    workQueue: (policy) => `${prefix}.cleanup.${policy}`,
    delayQueue: (ms) => `${prefix}.delay.${ms}`,
    presenceQueue: (policy, instanceId) => `${prefix}.presence.${policy}.${instanceId}`,
  };
}

/**
 * Header that selects a delay tier on the delay exchange. It must NOT start with "x-": a headers
 * exchange ignores x- arguments when matching, so such a binding would match every message and
 * copy each delayed batch into every tier.
 */
export const DELAY_HEADER = 'reaper-delay-ms';

export function makeTopology(options: { prefix: string; policies: readonly string[]; deliveryLimit: number; quorumGroupSize?: number | undefined }): Topology {
  const names = brokerNames(options.prefix);
  // Replicas per quorum queue (REAPER_QUORUM_GROUP_SIZE). Declared only when set: the broker
  // compares it at every declare, so adding it to queues that exist without it is a conflict.
  const replicas = options.quorumGroupSize === undefined ? {} : { 'x-quorum-initial-group-size': options.quorumGroupSize };
  const exchanges: ExchangeSpec[] = [
    { name: names.workExchange, type: 'direct', options: { durable: true } },
    // A headers exchange picks the tier from DELAY_HEADER while the routing key stays the policy
    // name, so the expired message dead-letters back to the work exchange under its own key.
    { name: names.delayExchange, type: 'headers', options: { durable: true } },
    // Expiry events: consumers bind their own queues (`<policy>.expired`, `#.expired`); reaper
    // declares none, and the relay publishes `mandatory`, so with no queue bound the events stay
    // in the outbox instead of being dropped.
    { name: names.eventsExchange, type: 'topic', options: { durable: true } },
  ];
  const queues: QueueSpec[] = [
    { name: names.deadLetterQueue, options: { durable: true, arguments: { 'x-queue-type': 'quorum', ...replicas } } },
    ...options.policies.map((policy) => ({
      name: names.workQueue(policy),
      options: {
        durable: true,
        arguments: {
          'x-queue-type': 'quorum',
          ...replicas,
          // A batch that fails on every delivery ends in the dead-letter queue instead of looping.
          'x-delivery-limit': options.deliveryLimit,
          'x-dead-letter-exchange': '',
          'x-dead-letter-routing-key': names.deadLetterQueue,
        },
      },
    })),
    ...DELAY_TIERS_MS.map((ms) => ({
      name: names.delayQueue(ms),
      options: {
        durable: true,
        arguments: {
          'x-message-ttl': ms,
          'x-dead-letter-exchange': names.workExchange,
          // On a cluster (group size set) the tiers are replicated too: a classic queue lives on
          // one node, and while that node is down every declare of the topology fails ("home node
          // is down"), so no service could reconnect anywhere. Quorum queues support per-queue TTL
          // from RabbitMQ 3.10; at-least-once dead-lettering (which needs reject-publish) keeps a
          // delayed batch from being dropped on its way back to the work exchange.
          ...(options.quorumGroupSize === undefined
            ? {}
            : { 'x-queue-type': 'quorum', ...replicas, 'x-dead-letter-strategy': 'at-least-once', 'x-overflow': 'reject-publish' }),
        },
      },
    })),
  ];
  const bindings: BindingSpec[] = [
    ...options.policies.map((policy) => ({ queue: names.workQueue(policy), exchange: names.workExchange, routingKey: policy })),
    ...DELAY_TIERS_MS.map((ms) => ({
      queue: names.delayQueue(ms),
      exchange: names.delayExchange,
      routingKey: '',
      args: { 'x-match': 'all', [DELAY_HEADER]: String(ms) },
    })),
  ];
  return { exchanges, queues, bindings };
}

/** The settings every declare of the topology takes from the environment (a subset of shared/config/env.ts's Env). */
export interface TopologySettings {
  amqpPrefix: string;
  deliveryLimit: number;
  quorumGroupSize: number | undefined;
}

/**
 * The topology a process of this deployment declares: the ONE place the services and every CLI
 * command that declares it (`scheduler`, `worker`, `topology`, `trigger/replay/execute --execute`)
 * take its options from. The broker compares every argument at each declare, so a command that
 * left one out (a cluster's REAPER_QUORUM_GROUP_SIZE) was refused with PRECONDITION_FAILED.
 */
export function topologyFor(settings: TopologySettings, policies: readonly string[]): Topology {
  return makeTopology({ prefix: settings.amqpPrefix, policies, deliveryLimit: settings.deliveryLimit, quorumGroupSize: settings.quorumGroupSize });
}

/**
 * KEDA's rabbitmq triggers for the workers' ScaledObject, one per work queue of the given
 * policies. `value` is ready batches per worker; the AMQP URL comes from the TriggerAuthentication,
 * never from the manifest.
 */
export function kedaTriggers(settings: Pick<TopologySettings, 'amqpPrefix'>, policies: readonly string[], options: { queueLengthPerWorker: number; authenticationRef: string }) {
  const names = brokerNames(settings.amqpPrefix);
  return policies.map((policy) => ({
    type: 'rabbitmq',
    metadata: { protocol: 'amqp', queueName: names.workQueue(policy), mode: 'QueueLength', value: String(options.queueLengthPerWorker) },
    authenticationRef: { name: options.authenticationRef },
  }));
}

/** The numbers and names infra/k8s/overlays/prod/worker-autoscaling.yaml explains and defines. */
export const KEDA_TRIGGER_SETTINGS = { queueLengthPerWorker: 20, authenticationRef: 'reaper-rabbitmq', scaledObject: 'reaper-worker' } as const;

/**
 * What `reaper topology --keda-triggers` prints: a strategic-merge patch that sets the workers'
 * ScaledObject triggers to one per policy. Kustomize cannot derive a list from a file's contents,
 * so the triggers are generated: infra/k8s/overlays/prod/keda-triggers.yaml is this for the
 * policies.yaml beside it (test/unit/k8s-manifests.test.ts fails when it is out of date), and an
 * operator's overlay generates its own from its own policies file.
 */
export function kedaTriggersPatch(settings: Pick<TopologySettings, 'amqpPrefix'>, policies: readonly string[]) {
  return {
    apiVersion: 'keda.sh/v1alpha1',
    kind: 'ScaledObject',
    metadata: { name: KEDA_TRIGGER_SETTINGS.scaledObject },
    spec: { triggers: kedaTriggers(settings, policies, KEDA_TRIGGER_SETTINGS) },
  };
}

export async function assertTopology(channel: Channel, topology: Topology): Promise<void> {
  for (const exchange of topology.exchanges) await channel.assertExchange(exchange.name, exchange.type, exchange.options);
  for (const queue of topology.queues) await channel.assertQueue(queue.name, queue.options);
  for (const binding of topology.bindings) await channel.bindQueue(binding.queue, binding.exchange, binding.routingKey, binding.args);
}

/**
 * The longest tier not longer than `delayMs` (the smallest tier for shorter delays). A message
 * comes back at or before its due time and is delayed again for the remainder, so work is late
 * by at most about the smallest tier instead of by the gap between two tiers.
 */
export function pickDelayTier(delayMs: number): number {
  let chosen: number = DELAY_TIERS_MS[0];
  for (const tier of DELAY_TIERS_MS) if (tier <= delayMs) chosen = tier;
  return chosen;
}

/**
 * The topology as a RabbitMQ definitions file (what `rabbitmqctl export_definitions` writes, with
 * amqplib's defaults filled in), for operators who pre-declare it: `reaper topology --definitions`.
 * With each service user's permissions for the prefix (shared/amqp/permissions.ts), so a prefix
 * other than `reaper` needs no regular expression written by hand; not the users themselves, whose
 * passwords come from the deployment's own users file, imported first (docs/deploying.md).
 */
export function topologyAsDefinitions(topology: Topology, prefix: string, vhost = '/') {
  const permissions = brokerPermissions(prefix);
  return {
    rabbit_version: '3.10.0',
    rabbitmq_version: '3.10.0',
    vhosts: [{ name: vhost }],
    permissions: BROKER_ROLES.map((role) => ({ user: brokerUserName(prefix, role), vhost, ...permissions[role] })),
    queues: topology.queues.map((q) => ({ name: q.name, vhost, durable: q.options.durable ?? true, auto_delete: q.options.autoDelete ?? false, arguments: q.options.arguments ?? {} })),
    exchanges: topology.exchanges.map((e) => ({
      name: e.name,
      vhost,
      type: e.type,
      durable: e.options.durable ?? true,
      auto_delete: e.options.autoDelete ?? false,
      internal: e.options.internal ?? false,
      arguments: e.options.arguments ?? {},
    })),
    bindings: topology.bindings.map((b) => ({ source: b.exchange, vhost, destination: b.queue, destination_type: 'queue', routing_key: b.routingKey, arguments: b.args ?? {} })),
  };
}
