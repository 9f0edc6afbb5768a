import type { Channel, ChannelModel, ConsumeMessage } from 'amqplib';
import type { Logger } from 'pino';
import type { Env } from '../../shared/config/env';
import { isS3Policy, type AnyRemoteDeletePolicy, type Policy, type PolicySet } from '../../shared/config/policies';
import { ReconnectingConnection, TopologyConflictError } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, topologyFor } from '../../shared/amqp/topology';
import { decodeBatch } from '../../shared/contracts/batch';
import { assertSchemaCurrent } from '../../shared/db/migrate';
import { makePool, warmPool, type Pool } from '../../shared/db/pool';
import { ledgerReturnExpiredLeases } from '../../shared/db/queries/ledger';
import { makeHttpRemoteClient, withCircuitBreaker } from '../../shared/remote/client';
import { makeRemoteDeleteHandler } from './handlers/remote-delete';
import { makeS3DeleteHandler } from './handlers/s3-delete';
import { makeObjectStorageClient } from '../../shared/remote/s3';
import { startLedgerSweeper } from './ledger-sweeper';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { startHealthServer } from '../../shared/observability/http';
import { makeMetrics, type Metrics } from '../../shared/observability/metrics';
import { classifyHandlerError } from './errors';
import { assertStatisticsReadable } from '../../shared/admission/rows';
import { makeRowDeleteGroupHandler, type BatchGroupHandler } from './handlers/row-delete';
import { makeCoalescer, type Coalescer } from './coalescer';
import { failpoint } from '../../shared/observability/failpoint-hook';
import type { BatchV1 } from '../../shared/contracts/batch';
import type { BatchHandler, HandlerContext } from './handlers/types';
import type { BatchResult } from './results';
import { requeueIfUnsettled, settle, type SettleDeps } from './settle';
import { loadBatchVersionConfig } from '../../shared/config/batch-version';
import { startHeartbeat, type HeartbeatHandle } from '../../shared/observability/heartbeat';
import { announcePresence, consumerTagFor, makeBatchVersionCounter } from './batch-versions';
import { outsideWindow } from './window-gate';

export interface WorkerHandle {
  metrics: Metrics;
  httpPort: number | undefined;
  stop(): Promise<void>;
}

/** The `policy` label of batches for a policy this worker does not have (never a name from the message). */
export const UNKNOWN_POLICY_LABEL = '(unknown)';

/** Seconds between passes of the lease reclaimer (remote-delete). */
const RECLAIM_INTERVAL_MS = 5_000;

/** Backoff between attempts to consume a queue again after the broker cancelled its consumer. */
const RECONSUME_BACKOFF_MS = { first: 200, max: 10_000 };

/** After a fatal broker error, how long in-flight batches get to settle before the process exits 1. */
const FATAL_DRAIN_MS = 10_000;

/**
 * Coalesced row-delete groups one worker runs at once per policy: while they run, deliveries in
 * hand gather into the next group. Two keep the database busy while a group's acks go out; the
 * second starts only with half a prefetch in hand (the coalescer's minItemsBeside). In the bench's
 * end-to-end run, where the workers keep the queue nearly empty, that took 8% less CPU per row
 * (all processes) and finished 1.07x as fast as starting it with any one delivery
 * (bench/results/2026-12-03-cost-quick-ab-minbeside16.md).
 */
const ROW_GROUPS_PER_POLICY = 2;

async function makeHandler(policy: Policy, target: ResolvedTarget, pool: Pool, log: Logger, metrics: Metrics): Promise<BatchHandler | BatchGroupHandler> {
  switch (policy.kind) {
    case 'row-delete':
      // A brake that cannot read the lag, or adaptive admission that cannot see the application, is a start-up error, not "lag 0" or "alone".
      await assertStatisticsReadable(pool, policy);
      return makeRowDeleteGroupHandler(policy, target);
    case 'remote-delete': {
      if (isS3Policy(policy)) {
        const storage = makeObjectStorageClient(policy.remote);
        await storage.warmUp();
        return makeS3DeleteHandler(policy, target, storage);
      }
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
  const pool = makePool(env.databaseUrl, env.dbPoolSize, 'reaper-worker', env.sessionTimeouts, 'keep');
  const names = brokerNames(env.amqpPrefix);
  const handlers = new Map<string, BatchHandler>();
  /** row-delete: one coalescer per policy in front of its group handler. */
  const coalescers = new Map<string, Coalescer<BatchV1, BatchResult>>();
  /** Each policy's table as resolved at start (key type: the ledger sweeper's canonical keys). */
  const targets = new Map<string, ResolvedTarget>();
  let stopping = false;
  try {
    await assertSchemaCurrent(pool);
    for (const policy of policies.values()) {
      try {
        const target = await targetResolve(pool, policy);
        targets.set(policy.name, target);
        const made = await makeHandler(policy, target, pool, log, metrics);
        if (policy.kind === 'row-delete') {
          const group = made as BatchGroupHandler;
          const groupLog = log.child({ policy: policy.name });
          const context = { pool, workerId: env.workerId, log: groupLog, metrics, deliveryCount: 1, failpoint, stopping: () => stopping };
          coalescers.set(policy.name, makeCoalescer({ maxGroups: ROW_GROUPS_PER_POLICY, maxItems: env.prefetch.rowDelete, minItemsBeside: Math.ceil(env.prefetch.rowDelete / 2), run: (batches, heldSince) => group(batches, { ...context, heldSince }) }));
          handlers.set(policy.name, (batch) => coalescers.get(policy.name)!.submit(batch));
        } else {
          handlers.set(policy.name, made as BatchHandler);
        }
      } catch (error) {
        throw new Error(`policy ${policy.name}: ${(error as Error).message}`);
      }
    }
  } catch (error) {
    await pool.end();
    throw error;
  }
  // Batches are deleted on backends that are already up (makePool, 'keep').
  log.info({ connections: await warmPool(pool) }, 'database connections opened');
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
    topology: topologyFor(env, [...policies.keys()]),
    log,
  });
  connection.on('ready', () => metrics.amqpConnected.set(1));
  connection.on('lost', () => metrics.amqpConnected.set(0));
  const publisher = new ConfirmingPublisher(connection);
  // Work waiting in the ledger (its turn, a webhook, a reclaimed lease, a lost delay copy) is sent again from there.
  const remotePolicies = [...policies.values()].filter((policy): policy is AnyRemoteDeletePolicy => policy.kind === 'remote-delete');
  const sweeper = remotePolicies.length > 0 ? startLedgerSweeper({ pool, publisher, names, policies: remotePolicies, targets, log, registry: metrics.registry }) : null;
  const settleDeps: SettleDeps = { publisher, names, metrics, deliveryLimit: env.deliveryLimit };
  // Accepts every batch version it knows (REAPER_TEST_MAX_BATCH_VERSION caps it, tests only) and announces it.
  const { highestAccepted } = loadBatchVersionConfig();
  const countVersion = makeBatchVersionCounter({ policies, registry: metrics.registry, log });
  let heartbeat: HeartbeatHandle | undefined;

  let channel: Channel | null = null;
  /** Consumer tag per policy on `channel`; a policy missing here is not being consumed right now. */
  const consumers = new Map<string, string>();
  /** Presence consumer tag per policy on `channel`: this process's proof to the batch-version gate. */
  const presence = new Map<string, string>();
  let databasePaused = false;
  let inFlight = 0;
  let idle: (() => void) | null = null;

  async function consumeAll(target: Channel): Promise<void> {
    consumers.clear();
    presence.clear();
    for (const policy of policies.keys()) await consumeQueue(target, policy);
  }

  /** A policy's queue is consumed with its kind's prefetch (env.prefetch). */
  const prefetchOf = (policy: string): number => (policies.get(policy)?.kind === 'row-delete' ? env.prefetch.rowDelete : env.prefetch.remoteDelete);
  /** Each qos and the consume it is for, one policy at a time (see consumeQueue). */
  let consumeTurn: Promise<unknown> = Promise.resolve();

  async function consumeQueue(target: Channel, policy: string): Promise<void> {
    // basic.qos with global=false sets the prefetch of each consumer started after it on the
    // channel (RabbitMQ consumer prefetch), so a qos and its consume must not interleave with
    // another policy's: a re-consume after a broker cancel can run beside consumeAll.
    const turn = consumeTurn.then(async () => {
      await target.prefetch(prefetchOf(policy));
      return target.consume(names.workQueue(policy), (message) => {
        if (message) deliver(target, message);
        else onCancelledByBroker(target, policy);
      }, { consumerTag: consumerTagFor(env.workerId, policy, highestAccepted) });
    });
    consumeTurn = turn.catch(() => undefined); // a failed turn (channel closed) does not hold up the next
    const { consumerTag } = await turn;
    consumers.set(policy, consumerTag);
    // After the work consumer: the proof never stands for a consumer that does not exist yet.
    presence.set(policy, await announcePresence(target, names.presenceQueue(policy, heartbeat!.instanceId)));
  }

  /** Cancels the presence proofs of `only` (default: every policy), before their work consumers go. */
  async function withdrawPresence(target: Channel | null, only?: string): Promise<void> {
    for (const [policy, tag] of [...presence]) {
      if (only !== undefined && policy !== only) continue;
      presence.delete(policy);
      if (target) await target.cancel(tag).catch(() => undefined); // closed channel: the broker dropped it already
    }
  }

  /**
   * The broker cancels a consumer when its queue is deleted (or, in a cluster, when a quorum
   * queue's leader moves) and sends no message after that: left alone, this queue would silently
   * never be consumed again. Choice: recover in place instead of exiting, because a restart would
   * also return every other queue's batches in flight. Re-declare the topology (the queue comes
   * back with its arguments, so the scheduler's publishes route again) and consume it again, with
   * backoff. A topology conflict on the way is fatal (the connection reports it; we exit 1). A
   * new channel, a reconnect or a database pause makes this loop stand down: they consume every
   * queue anew. Readiness is false until the queue is consumed again.
   */
  function onCancelledByBroker(target: Channel, policy: string): void {
    consumers.delete(policy);
    void withdrawPresence(target, policy);
    const queue = names.workQueue(policy);
    log.warn({ queue, policy }, 'consumer cancelled by the broker (queue deleted or moved); re-declaring and consuming again');
    void (async () => {
      for (let attempt = 0; ; attempt++) {
        const base = Math.min(RECONSUME_BACKOFF_MS.max, RECONSUME_BACKOFF_MS.first * 2 ** attempt);
        await new Promise((resolve) => setTimeout(resolve, base / 2 + Math.random() * (base / 2)));
        if (stopping || databasePaused || channel !== target || consumers.has(policy)) return;
        try {
          await connection.reassertTopology();
          await consumeQueue(target, policy);
          log.info({ queue, policy, attempt }, 'consuming again after the broker cancelled the consumer');
          return;
        } catch (error) {
          if (error instanceof TopologyConflictError) return; // fatal: the 'fatal' handler exits
          log.warn({ err: (error as Error).message, queue, attempt }, 'consuming again failed; retrying');
        }
      }
    })().catch((error: Error) => log.error({ err: error.message, queue }, 're-consume loop failed (a bug); a reconnect consumes again'));
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
            // Re-declare first: consuming a deleted queue is what closes a channel most often.
            connection
              .reassertTopology()
              .then(() => openConsumer(model))
              .catch((error: Error) => log.warn({ err: error.message }, 'reopening the consume channel failed; reconnect will'));
          }
        }, 1_000);
      }
    });
    channel = opened;
    if (!stopping && !databasePaused) await consumeAll(opened);
  }
  connection.onReady(openConsumer);

  /**
   * The consumer callback. onMessage must never reject: the promise is not awaited by amqplib, and
   * an unhandled rejection ends Node with every batch of the channel in flight. settle never
   * throws; this catch is the last line of defence for a throw anywhere else (a message that settle
   * did not act on is requeued), and the in-flight count is kept whatever happens.
   */
  function deliver(from: Channel, message: ConsumeMessage): void {
    inFlight += 1;
    onMessage(from, message)
      .catch((error: unknown) => {
        const requeued = requeueIfUnsettled(from, message);
        try {
          log.error({ err: (error as Error)?.message ?? String(error), messageId: message.properties.messageId, requeued }, 'delivery failed outside settle (a bug)');
        } catch {
          // The logger itself throws: the message is already taken care of.
        }
      })
      .finally(() => {
        inFlight -= 1;
        if (inFlight === 0) idle?.();
      });
  }

  async function onMessage(from: Channel, message: ConsumeMessage): Promise<void> {
    const started = process.hrtime.bigint();
    const deliveryCount = Number(message.properties.headers?.['x-delivery-count'] ?? 0) + 1;
    const decoded = decodeBatch(message.content, { highestVersion: highestAccepted });
    if (decoded.ok) countVersion({ policy: decoded.batch.policy, version: decoded.version, policyVersion: decoded.policyVersion });
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
    let closed: BatchResult | null;
    if (!decoded.ok) {
      result = { kind: 'dead-letter', reason: decoded.reason, detail: decoded.detail };
    } else if (!handlers.has(policy)) {
      result = { kind: 'dead-letter', reason: 'unknown-policy', detail: `policy "${policy}" is not configured on this worker` };
    } else if ((closed = outsideWindow(policies.get(policy), new Date()))) {
      // Outside the policy's schedule window: to a delay tier until it opens, nothing admitted.
      result = closed;
    } else {
      const context: HandlerContext = { pool, workerId: env.workerId, log: batchLog, metrics, deliveryCount, failpoint };
      try {
        result = await handlers.get(policy)!(decoded.batch, context);
      } catch (error) {
        result = classifyHandlerError(error);
      }
    }
    const outage = result.kind === 'unknown' && result.databaseUnavailable;
    // Stop consuming BEFORE the batch is given back: a reject first would let the broker hand it
    // (or the next one) straight back into the freed prefetch slot, and that delivery would fail
    // too. An outage must cost each in-flight batch exactly one delivery.
    if (outage) await stopConsumingForOutage();
    // Another batch already paused consumption: a batch that failed meanwhile (for any reason) is
    // given back only once its consumer is cancelled, for the same reason.
    else if (result.kind === 'unknown' && outagePause) await outagePause;
    await settle(settleDeps, { channel: from, message, policy: label, deliveryCount, log: batchLog }, result);
    if (outage) resumeWhenDatabaseAnswers().catch((error: Error) => log.error({ err: error.message }, 'database pause failed (a bug)'));
    try {
      const heldSeconds = Number(process.hrtime.bigint() - started) / 1e9;
      metrics.batchSeconds.observe({ policy: label }, heldSeconds);
      metrics.messageHoldSeconds.observe({ policy: label }, heldSeconds);
    } catch (error) {
      batchLog.error({ err: (error as Error).message }, 'recording the batch duration failed; the batch is settled');
    }
  }

  /** The database is unreachable: cancel every consumer (once, whichever batch noticed first). */
  let outagePause: Promise<void> | null = null;
  function stopConsumingForOutage(): Promise<void> {
    if (outagePause) return outagePause;
    databasePaused = true;
    log.warn('database unavailable: consumption paused');
    const paused = channel;
    const tags = [...consumers.values()];
    consumers.clear();
    outagePause = (async () => {
      await withdrawPresence(paused);
      if (paused) for (const tag of tags) await paused.cancel(tag).catch(() => undefined); // channel gone: nothing to cancel
    })();
    return outagePause;
  }

  /** Probes until `SELECT 1` works again, then consumes again; redelivered batches then find the database. */
  let probing = false;
  async function resumeWhenDatabaseAnswers(): Promise<void> {
    if (probing) return;
    probing = true;
    for (let attempt = 0; !stopping; attempt++) {
      try {
        await pool.query('SELECT 1');
        break;
      } catch {
        await new Promise((resolve) => setTimeout(resolve, Math.min(5_000, 250 * 2 ** attempt)));
      }
    }
    databasePaused = false;
    outagePause = null;
    probing = false;
    log.info('database answers again: consumption resumed');
    if (!stopping && channel) await consumeAll(channel).catch((error: Error) => log.warn({ err: error.message }, 'resume failed; reconnect will resume'));
  }

  // HTTP first: /livez answers while the broker is still unreachable (the process is alive and
  // retrying); /readyz says ready only while every policy's queue is being consumed.
  let server: Awaited<ReturnType<typeof startHealthServer>> | undefined;
  try {
    server =
      env.httpPort === undefined
        ? undefined
        : await startHealthServer({
            port: env.httpPort,
            registry: metrics.registry,
            log,
            ready: () => connection.connected && channel !== null && consumers.size === policies.size && !databasePaused && !stopping,
          });
    // Announced before the first consume: a scheduler never counts this consumer as unknown.
    heartbeat = await startHeartbeat(pool, { service: 'worker', workerId: env.workerId, amqpPrefix: env.amqpPrefix, policies: [...policies.keys()], maxBatchVersion: highestAccepted }, log);
    // Retries while the broker is unreachable; rejects on what retrying cannot fix (a queue
    // declared with other arguments: TopologyConflictError names the queue and the argument).
    await connection.start();
  } catch (error) {
    stopping = true;
    await heartbeat?.stop();
    if (reclaimer) clearInterval(reclaimer);
    server?.close();
    await connection.close();
    await pool.end();
    throw error;
  }
  log.info({ policies: [...policies.keys()], prefetch: env.prefetch }, 'worker consuming');

  const handle: WorkerHandle = {
    metrics,
    httpPort: server?.boundPort,
    async stop() {
      stopping = true;
      if (reclaimer) clearInterval(reclaimer);
      await sweeper?.stop();
      const current = channel as Channel | null;
      const tags = [...consumers.values()];
      consumers.clear();
      await withdrawPresence(current);
      if (current) for (const tag of tags) await current.cancel(tag).catch(() => undefined); // closed channel: nothing to cancel
      // Drain: batches in flight finish and settle; nothing new arrives after the cancel.
      if (inFlight > 0) await new Promise<void>((resolve) => (idle = resolve));
      // One round trip on the channel before closing, so the last acks are handled first: closing
      // right after an ack can return the acked message (it would come back as a duplicate no-op).
      const last = channel as Channel | null;
      if (last) await last.checkQueue(names.deadLetterQueue).catch(() => undefined); // channel already gone: nothing to flush
      server?.close();
      await heartbeat?.stop();
      await connection.close();
      await pool.end();
    },
  };

  // A topology conflict found after start (at a reconnect, or re-declaring a deleted queue) can
  // never be retried away: let what is in flight settle, then exit 1 so the orchestrator shows it.
  connection.once('fatal', (error: Error) => {
    log.fatal({ err: error.message }, 'broker topology conflict: the worker exits 1');
    process.exitCode = 1;
    const exit = (): never => process.exit(1);
    setTimeout(exit, FATAL_DRAIN_MS).unref();
    // Already draining (SIGTERM): that stop finishes and the CLI exits with exitCode 1; a second
    // stop would take over its wait for the in-flight batches.
    if (!stopping) handle.stop().then(exit, exit);
  });
  return handle;
}
