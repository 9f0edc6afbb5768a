import type { Channel, ChannelModel, ConsumeMessage } from 'amqplib';
import type { Logger } from 'pino';
import type { Env } from '../../shared/config/env';
import type { Policy, PolicySet, RemoteDeletePolicy } from '../../shared/config/policies';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, makeTopology } from '../../shared/amqp/topology';
import { decodeBatch } from '../../shared/contracts/batch';
import { assertSchemaCurrent } from '../../shared/db/migrate';
import { makePool, type Pool } from '../../shared/db/pool';
import { ledgerReturnExpiredLeases } from '../../shared/db/queries/ledger';
import { makeHttpRemoteClient, withCircuitBreaker } from '../../shared/remote/client';
import { makeRemoteDeleteHandler } from './handlers/remote-delete';
import { startLedgerSweeper } from './ledger-sweeper';
import { targetResolve } from '../../shared/db/queries/expiring-rows';
import { startHealthServer } from '../../shared/observability/http';
import { makeMetrics, type Metrics } from '../../shared/observability/metrics';
import { classifyHandlerError } from './errors';
import { makeRowDeleteHandler } from './handlers/row-delete';
import type { BatchHandler, HandlerContext } from './handlers/types';
import type { BatchResult } from './results';
import { settle, type SettleDeps } from './settle';

export interface WorkerHandle {
  metrics: Metrics;
  httpPort: number | undefined;
  stop(): Promise<void>;
}

/** The `policy` label of batches for a policy this worker does not have (never a name from the message). */
export const UNKNOWN_POLICY_LABEL = '(unknown)';

/** Seconds between passes of the lease reclaimer (remote-delete). */
const RECLAIM_INTERVAL_MS = 5_000;

async function makeHandler(policy: Policy, pool: Pool, log: Logger, metrics: Metrics): Promise<BatchHandler> {
  const target = await targetResolve(pool, policy);
  switch (policy.kind) {
    case 'row-delete':
      return makeRowDeleteHandler(policy, target);
    case 'remote-delete': {
      const remote = withCircuitBreaker(makeHttpRemoteClient(policy.remote, log.child({ policy: policy.name })));
      // reaper_circuit_open: half-open still refuses all but one trial call, so it counts as open.
      remote.breaker.on('open', () => metrics.circuitOpen.set({ policy: policy.name }, 1));
      remote.breaker.on('close', () => metrics.circuitOpen.set({ policy: policy.name }, 0));
      return makeRemoteDeleteHandler(policy, target, remote);
    }
  }
}

/**
 * The worker: consumes every policy's work queue with manual acks and a bounded prefetch, runs the
 * policy handler, and settles. It owns the ack discipline and nothing else: handlers know no AMQP,
 * settle knows no SQL. When the database is unreachable it stops consuming (so an outage costs
 * each in-flight batch one delivery, not its whole delivery limit) and resumes once it answers.
 */
export async function startWorker(env: Env, policies: PolicySet, log: Logger): Promise<WorkerHandle> {
  const metrics = makeMetrics([...policies.values()]);
  const pool = makePool(env.databaseUrl, env.dbPoolSize, 'reaper-worker', env.sessionTimeouts);
  const names = brokerNames(env.amqpPrefix);
  const handlers = new Map<string, BatchHandler>();
  try {
    await assertSchemaCurrent(pool);
    for (const policy of policies.values()) {
      try {
        handlers.set(policy.name, await makeHandler(policy, pool, log, metrics));
      } catch (error) {
        throw new Error(`policy ${policy.name}: ${(error as Error).message}`);
      }
    }
  } catch (error) {
    await pool.end();
    throw error;
  }
  // Leases of crashed or frozen workers go back to pending, not carried: the ledger sweeper sends them again.
  const hasRemote = [...policies.values()].some((policy) => policy.kind === 'remote-delete');
  const reclaimer = hasRemote
    ? setInterval(() => {
        ledgerReturnExpiredLeases(pool)
          .then((returned) => returned > 0 && log.info({ returned }, 'expired leases returned to pending'))
          .catch((error: Error) => log.warn({ err: error.message }, 'lease reclaim failed; next pass retries'));
      }, RECLAIM_INTERVAL_MS)
    : null;

  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-worker ${env.amqpPrefix} ${env.workerId}`,
    topology: makeTopology({ prefix: env.amqpPrefix, policies: [...policies.keys()], deliveryLimit: env.deliveryLimit }),
    log,
  });
  connection.on('ready', () => metrics.amqpConnected.set(1));
  connection.on('lost', () => metrics.amqpConnected.set(0));
  const publisher = new ConfirmingPublisher(connection);
  // Work waiting in the ledger (its turn, a webhook, a reclaimed lease, a lost delay copy) is sent again from there.
  const remotePolicies = [...policies.values()].filter((policy): policy is RemoteDeletePolicy => policy.kind === 'remote-delete');
  const sweeper = remotePolicies.length > 0 ? startLedgerSweeper({ pool, publisher, names, policies: remotePolicies, log, registry: metrics.registry }) : null;
  const settleDeps: SettleDeps = { publisher, names, metrics, deliveryLimit: env.deliveryLimit };

  let channel: Channel | null = null;
  let consumerTags: string[] = [];
  let stopping = false;
  let databasePaused = false;
  let inFlight = 0;
  let idle: (() => void) | null = null;

  async function consumeAll(target: Channel): Promise<void> {
    consumerTags = [];
    for (const policy of policies.keys()) {
      const { consumerTag } = await target.consume(names.workQueue(policy), (message) => {
        if (message) void onMessage(target, message);
      });
      consumerTags.push(consumerTag);
    }
  }

  async function openConsumer(model: ChannelModel): Promise<void> {
    const opened = await model.createChannel();
    opened.on('error', (error: Error) => log.warn({ err: error.message }, 'consume channel error'));
    opened.on('close', () => {
      if (channel !== opened) return;
      channel = null;
      // A channel can die alone (a queue deleted under it, a broker-side error) while the
      // connection lives on; its ready hook would then never run again, so reopen here.
      if (!stopping && connection.connected) {
        setTimeout(() => {
          if (!stopping && channel === null && connection.connected) {
            openConsumer(model).catch((error: Error) => log.warn({ err: error.message }, 'reopening the consume channel failed; reconnect will'));
          }
        }, 1_000);
      }
    });
    await opened.prefetch(env.prefetch);
    channel = opened;
    if (!stopping && !databasePaused) await consumeAll(opened);
  }
  connection.onReady(openConsumer);

  function failpoint(name: NonNullable<Env['failpoint']>): void {
    if (env.failpoint === name) {
      log.warn({ failpoint: name }, 'failpoint reached: killing this process');
      process.kill(process.pid, 'SIGKILL');
    }
  }

  async function onMessage(from: Channel, message: ConsumeMessage): Promise<void> {
    inFlight += 1;
    const started = process.hrtime.bigint();
    const deliveryCount = Number(message.properties.headers?.['x-delivery-count'] ?? 0) + 1;
    const decoded = decodeBatch(message.content);
    const policy = decoded.ok ? decoded.batch.policy : message.fields.routingKey;
    // Metric labels come from configuration, never from a message: an unconfigured name is counted
    // under one fixed value (bounded label values; the log line keeps the name).
    const label = handlers.has(policy) ? policy : UNKNOWN_POLICY_LABEL;
    const batchLog = log.child({
      batchId: decoded.ok ? decoded.batch.batchId : message.properties.messageId,
      runId: decoded.ok ? decoded.batch.runId : message.properties.headers?.['x-run-id'],
      policy,
      deliveryCount,
    });
    let result: BatchResult;
    if (!decoded.ok) {
      result = { kind: 'dead-letter', reason: decoded.reason, detail: decoded.detail };
    } else if (!handlers.has(policy)) {
      result = { kind: 'dead-letter', reason: 'unknown-policy', detail: `policy "${policy}" is not configured on this worker` };
    } else {
      const context: HandlerContext = { pool, workerId: env.workerId, log: batchLog, metrics, deliveryCount, failpoint, failpointArmed: (name) => env.failpoint === name };
      try {
        result = await handlers.get(policy)!(decoded.batch, context);
      } catch (error) {
        result = classifyHandlerError(error);
      }
    }
    try {
      await settle(settleDeps, { channel: from, message, policy: label, deliveryCount, log: batchLog }, result);
      if (result.kind === 'unknown' && result.databaseUnavailable) void pauseUntilDatabaseAnswers();
    } finally {
      metrics.batchSeconds.observe({ policy: label }, Number(process.hrtime.bigint() - started) / 1e9);
      inFlight -= 1;
      if (inFlight === 0) idle?.();
    }
  }

  /** Stops consuming until `SELECT 1` works again; redelivered batches then find the database. */
  async function pauseUntilDatabaseAnswers(): Promise<void> {
    if (databasePaused) return;
    databasePaused = true;
    const paused = channel;
    log.warn('database unavailable: consumption paused');
    if (paused) for (const tag of consumerTags) await paused.cancel(tag).catch(() => undefined); // channel gone: nothing to cancel
    for (let attempt = 0; !stopping; attempt++) {
      try {
        await pool.query('SELECT 1');
        break;
      } catch {
        await new Promise((resolve) => setTimeout(resolve, Math.min(5_000, 250 * 2 ** attempt)));
      }
    }
    databasePaused = false;
    log.info('database answers again: consumption resumed');
    if (!stopping && channel) await consumeAll(channel).catch((error: Error) => log.warn({ err: error.message }, 'resume failed; reconnect will resume'));
  }

  await connection.start();
  const server =
    env.httpPort === undefined
      ? undefined
      : await startHealthServer({
          port: env.httpPort,
          registry: metrics.registry,
          log,
          ready: () => connection.connected && !databasePaused && !stopping,
        });
  log.info({ policies: [...policies.keys()], prefetch: env.prefetch }, 'worker consuming');

  return {
    metrics,
    httpPort: server?.boundPort,
    async stop() {
      stopping = true;
      if (reclaimer) clearInterval(reclaimer);
      await sweeper?.stop();
      const current = channel as Channel | null;
      if (current) for (const tag of consumerTags) await current.cancel(tag).catch(() => undefined); // closed channel: nothing to cancel
      // Drain: batches in flight finish and settle; nothing new arrives after the cancel.
      if (inFlight > 0) await new Promise<void>((resolve) => (idle = resolve));
      // One round trip on the channel before closing, so the last acks are handled first: closing
      // right after an ack can return the acked message (it would come back as a duplicate no-op).
      const last = channel as Channel | null;
      if (last) await last.checkQueue(names.deadLetterQueue).catch(() => undefined); // channel already gone: nothing to flush
      server?.close();
      await connection.close();
      await pool.end();
    },
  };
}
