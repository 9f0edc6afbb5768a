/**
 * RabbitMQ permissions per reaper service: configure, write and read, each a regular expression
 * over resource names, all limited to the prefix's exchanges and queues, so a reaper credential
 * can neither declare nor delete nor read anything else on the vhost. infra/rabbitmq/definitions.json
 * holds these for the prefix `reaper` (test/unit/infra.test.ts compares), and
 * test/integration/least-privilege-broker.test.ts runs a scheduler and a worker under them.
 *
 *  - scheduler: asserts the topology at start-up (declare: configure; bind: write on the queue and
 *    read on the exchange) and publishes batches to the work exchange (write).
 *  - worker: the same topology assertion, consumes the work queues (read), publishes retries to
 *    the delay exchange and dead letters through the default exchange (write on amq.default).
 *  - operator: the CLI (`reaper dlq requeue|purge`, `reaper status`): the worker's rights.
 *  - autoscaler: KEDA reads the work queues' depth with a passive declare, which RabbitMQ allows
 *    with access to the vhost alone; all three patterns are empty, so it can neither consume nor
 *    purge (read) nor publish nor declare.
 */
export interface BrokerPermission {
  configure: string;
  write: string;
  read: string;
}

export const BROKER_ROLES = ['scheduler', 'worker', 'operator', 'autoscaler'] as const;
export type BrokerRole = (typeof BROKER_ROLES)[number];

export function brokerUserName(prefix: string, role: BrokerRole): string {
  return `${prefix}-${role}`;
}

export function brokerPermissions(prefix: string): Record<BrokerRole, BrokerPermission> {
  // The prefix is [a-zA-Z0-9_-]+ (env.ts), none of which is special in a regular expression.
  const own = `^${prefix}\\.`;
  const ownAndDefault = `^(${prefix}\\..*|amq\\.default)$`;
  // configure (declare, delete) covers only what each declares: the shared topology (work and
  // delay exchanges and queues, the dead-letter queue), which every service asserts at start;
  // the worker alone also declares its presence queues (<prefix>.presence.<policy>.<id>), so no
  // other login can delete them.
  const shared = `^${prefix}\\.(cleanup|delay|dead-letter|events)(\\..+)?$`;
  const sharedAndPresence = `^${prefix}\\.(cleanup|delay|dead-letter|events|presence)(\\..+)?$`;
  return {
    scheduler: { configure: shared, write: own, read: own },
    worker: { configure: sharedAndPresence, write: ownAndDefault, read: own },
    operator: { configure: shared, write: ownAndDefault, read: own },
    autoscaler: { configure: '', write: '', read: '' },
  };
}
