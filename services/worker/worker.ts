import type { Channel, ConsumeMessage } from 'amqplib';
import type { Logger } from 'pino';
import type { Env } from '../../shared/config/env';
import type { AnyRemoteDeletePolicy, PolicySet } from '../../shared/config/policies';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, topologyFor, type BrokerNames } from '../../shared/amqp/topology';
import { loadBatchVersionConfig } from '../../shared/config/batch-version';
import type { BatchVersion } from '../../shared/contracts/batch';
import { makePool, warmPool, type Pool } from '../../shared/db/pool';
import { ledgerReturnExpiredLeases } from '../../shared/db/queries/ledger';
import type { ResolvedTarget } from '../../shared/db/queries/target';
import { startHeartbeat, type HeartbeatHandle } from '../../shared/observability/heartbeat';
import { startHealthServer } from '../../shared/observability/http';
import { makeMetrics, type Metrics } from '../../shared/observability/metrics';
import { makeBatchVersionCounter } from './batch-versions';
import { makeDatabaseOutage } from './database-outage';
import { makeDeliveries, type Deliveries } from './deliveries';
import type { BatchHandler } from './handlers/types';
import { startLedgerSweeper } from './ledger-sweeper';
import { makePolicyHandlers } from './policy-handlers';
import { makeQueueConsumer, type QueueConsumer } from './queue-consumer';

export { UNKNOWN_POLICY_LABEL } from './deliveries';

export interface WorkerHandle {
  metrics: Metrics;
  httpPort: number | undefined;
  stop(): Promise<void>;
}

/** Seconds between passes of the lease reclaimer (remote-delete). */
const RECLAIM_INTERVAL_MS = 5_000;

/** After a fatal broker error, how long in-flight batches get to settle before the process exits 1. */
const FATAL_DRAIN_MS = 10_000;

/**
 * The worker: consumes every policy's work queue with manual acks and a bounded prefetch, runs the
 * policy handler, and settles. It owns the ack discipline and nothing else: handlers know no AMQP,
 * settle knows no SQL. When the database is unreachable it stops consuming (so an outage costs
 * each in-flight batch one delivery, not its whole delivery limit) and resumes once it answers.
 *
 * Its parts: the policies' handlers, one per kind (policy-handlers.ts); for remote-delete the
 * lease reclaimer and the ledger sweeper (ledger-sweeper.ts); the broker connection and the queue
 * consumer (queue-consumer.ts); what happens to each message (deliveries.ts, settle.ts); the
 * database-outage pause (database-outage.ts); health, heartbeat and stop.
 */
export async function startWorker(env: Env, policies: PolicySet, log: Logger): Promise<WorkerHandle> {
  const metrics = makeMetrics([...policies.values()]);
  const pool = makePool(env.databaseUrl, env.dbPoolSize, 'reaper-worker', env.sessionTimeouts, 'keep');
  const names = brokerNames(env.amqpPrefix);
  let stopping = false;
  const isStopping = (): boolean => stopping;
  const { handlers, targets } = await makePolicyHandlers({ pool, env, log, metrics, stopping: isStopping }, policies);
  // Batches are deleted on backends that are already up (makePool, 'keep').
  log.info({ connections: await warmPool(pool) }, 'database connections opened');
  const reclaimer = startLeaseReclaimer(pool, policies, log);
  const connection = connectToBroker(env, policies, metrics, log);
  const publisher = new ConfirmingPublisher(connection);
  // Accepts every batch version it knows (REAPER_TEST_MAX_BATCH_VERSION caps it, tests only) and announces it.
  const { highestAccepted } = loadBatchVersionConfig();
  let heartbeat: HeartbeatHandle | undefined;
  // The heartbeat starts before connection.start, so before the first consume asks its id.
  const instanceId = (): string => heartbeat!.instanceId;
  const { consumer, deliveries } = wireConsumer({ env, policies, names, connection, publisher, pool, handlers, metrics, log, highestAccepted, stopping: isStopping, instanceId });
  connection.onReady(consumer.open);

  // HTTP first: /livez answers while the broker is still unreachable (the process is alive and
  // retrying); /readyz says ready only while every policy's queue is being consumed.
  let server: Awaited<ReturnType<typeof startHealthServer>> | undefined;
  try {
    server =
      env.httpPort === undefined
        ? undefined
        : await startHealthServer({ port: env.httpPort, registry: metrics.registry, log, ready: () => consumer.consumingAll && !stopping });
    // Announced before the first consume: a scheduler never counts this consumer as unknown.
    heartbeat = await startHeartbeat(pool, { service: 'worker', workerId: env.workerId, amqpPrefix: env.amqpPrefix, policies: [...policies.keys()], maxBatchVersion: highestAccepted }, log);
    // Retries while the broker is unreachable; rejects on what retrying cannot fix (a queue
    // declared with other arguments: TopologyConflictError names the queue and the argument).
    await connection.start();
  } catch (error) {
    stopping = true;
    await heartbeat?.stop();
    reclaimer?.stop();
    server?.close();
    await connection.close();
    await pool.end();
    throw error;
  }
  log.info({ policies: [...policies.keys()], prefetch: env.prefetch }, 'worker consuming');
  // Only once started: a worker whose start fails stops everything it started, and a sweeper
  // started before would go on passing over a closed pool (it publishes through the connection
  // that has just started anyway).
  const sweeper = startSweeperForRemotePolicies({ pool, publisher, names, policies, targets, metrics, log });

  const handle: WorkerHandle = {
    metrics,
    httpPort: server?.boundPort,
    async stop() {
      stopping = true;
      reclaimer?.stop();
      await sweeper?.stop();
      await consumer.stop();
      // Drain: batches in flight finish and settle; nothing new arrives after the cancel.
      await deliveries.drained();
      // One round trip on the channel before closing, so the last acks are handled first: closing
      // right after an ack can return the acked message (it would come back as a duplicate no-op).
      await consumer.flush();
      server?.close();
      await heartbeat?.stop();
      await connection.close();
      await pool.end();
    },
  };
  exitOnTopologyConflict(connection, handle, isStopping, log);
  return handle;
}

/** The connection every consumer and publish of this worker uses; its topology lists every policy's queues. */
function connectToBroker(env: Env, policies: PolicySet, metrics: Metrics, log: Logger): ReconnectingConnection {
  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-worker ${env.amqpPrefix} ${env.workerId}`,
    topology: topologyFor(env, [...policies.keys()]),
    log,
  });
  connection.on('ready', () => metrics.amqpConnected.set(1));
  connection.on('lost', () => metrics.amqpConnected.set(0));
  return connection;
}

/**
 * The queue consumer and what it does with each message: it hands every message to the
 * deliveries, whose database-outage pause stops and resumes the consumer (so `deliver` is bound
 * once both exist; it first runs at connection.start).
 */
function wireConsumer(deps: {
  env: Env;
  policies: PolicySet;
  names: BrokerNames;
  connection: ReconnectingConnection;
  publisher: ConfirmingPublisher;
  pool: Pool;
  handlers: ReadonlyMap<string, BatchHandler>;
  metrics: Metrics;
  log: Logger;
  highestAccepted: BatchVersion;
  stopping: () => boolean;
  instanceId: () => string;
}): { consumer: QueueConsumer; deliveries: Deliveries } {
  const { env, policies, names, connection, publisher, pool, handlers, metrics, log, highestAccepted, stopping } = deps;
  const countVersion = makeBatchVersionCounter({ policies, registry: metrics.registry, log });
  const deliver = (from: Channel, message: ConsumeMessage): void => deliveries.deliver(from, message);
  const consumer = makeQueueConsumer({ env, policies, names, connection, log, stopping, highestAccepted, instanceId: deps.instanceId, deliver });
  const outage = makeDatabaseOutage({ pool, consumer, log, stopping });
  const settleDeps = { publisher, names, metrics, deliveryLimit: env.deliveryLimit };
  const deliveries = makeDeliveries({ pool, env, policies, handlers, settleDeps, metrics, log, highestAccepted, countVersion, outage });
  return { consumer, deliveries };
}

/**
 * remote-delete: leases of crashed or frozen workers go back to pending, not carried: the ledger
 * sweeper sends them again. Null when the worker has no remote-delete policy.
 */
function startLeaseReclaimer(pool: Pool, policies: PolicySet, log: Logger): { stop(): void } | null {
  if (![...policies.values()].some((policy) => policy.kind === 'remote-delete')) return null;
  const timer = setInterval(() => {
    ledgerReturnExpiredLeases(pool)
      .then((returned) => returned > 0 && log.info({ returned }, 'expired leases returned to pending'))
      .catch((error: Error) => log.warn({ err: error.message }, 'lease reclaim failed; next pass retries'));
  }, RECLAIM_INTERVAL_MS);
  return { stop: () => clearInterval(timer) };
}

/**
 * remote-delete: work waiting in the ledger (its turn, a webhook, a reclaimed lease, a lost delay
 * copy) is sent again from there. Null when the worker has no remote-delete policy.
 */
function startSweeperForRemotePolicies(deps: {
  pool: Pool;
  publisher: ConfirmingPublisher;
  names: BrokerNames;
  policies: PolicySet;
  targets: Map<string, ResolvedTarget>;
  metrics: Metrics;
  log: Logger;
}): ReturnType<typeof startLedgerSweeper> | null {
  const remotePolicies = [...deps.policies.values()].filter((policy): policy is AnyRemoteDeletePolicy => policy.kind === 'remote-delete');
  if (remotePolicies.length === 0) return null;
  const { pool, publisher, names, targets, log } = deps;
  return startLedgerSweeper({ pool, publisher, names, policies: remotePolicies, targets, log, registry: deps.metrics.registry });
}

/**
 * A topology conflict found after start (at a reconnect, or re-declaring a deleted queue) can
 * never be retried away: let what is in flight settle, then exit 1 so the orchestrator shows it.
 */
function exitOnTopologyConflict(connection: ReconnectingConnection, handle: WorkerHandle, stopping: () => boolean, log: Logger): void {
  connection.once('fatal', (error: Error) => {
    log.fatal({ err: error.message }, 'broker topology conflict: the worker exits 1');
    process.exitCode = 1;
    const exit = (): never => process.exit(1);
    setTimeout(exit, FATAL_DRAIN_MS).unref();
    // Already draining (SIGTERM): that stop finishes and the CLI exits with exitCode 1; a second
    // stop would take over its wait for the in-flight batches.
    if (!stopping()) handle.stop().then(exit, exit);
  });
}
