import type { Channel, ChannelModel, ConsumeMessage } from 'amqplib';
import type { Logger } from 'pino';
import { TopologyConflictError, type ReconnectingConnection } from '../../shared/amqp/connection';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { Env } from '../../shared/config/env';
import type { PolicySet } from '../../shared/config/policies';
import type { BatchVersion } from '../../shared/contracts/batch';
import { announcePresence, consumerTagFor } from './batch-versions';

/** Backoff between attempts to consume a queue again after the broker cancelled its consumer. */
const RECONSUME_BACKOFF_MS = { first: 200, max: 10_000 };

export interface QueueConsumerDeps {
  env: Pick<Env, 'workerId' | 'prefetch'>;
  policies: PolicySet;
  names: BrokerNames;
  connection: ReconnectingConnection;
  log: Logger;
  stopping: () => boolean;
  /** The batch versions this worker accepts: part of each consumer tag (the batch-version gate reads it). */
  highestAccepted: BatchVersion;
  /** This process's heartbeat id, for its presence queues; asked only once consuming starts. */
  instanceId: () => string;
  /** Called for every message; never rejects (it settles or requeues the message itself). */
  deliver: (from: Channel, message: ConsumeMessage) => void;
}

/**
 * The worker's side of the broker: one channel consuming every policy's work queue with its
 * kind's prefetch, and a presence consumer per policy for the batch-version gate. It reopens a
 * channel that died alone, consumes a queue again after the broker cancelled its consumer, and
 * stops and resumes every consumer for a database outage (`pause`, `resume`) or for good (`stop`).
 */
export interface QueueConsumer {
  /** The connection's ready hook: opens the channel and consumes every queue (unless paused or stopping). */
  open(model: ChannelModel): Promise<void>;
  /** Connected, every policy's queue consumed, not paused: what /readyz reports. */
  readonly consumingAll: boolean;
  /** Cancels every consumer until `resume`: a channel reopened meanwhile consumes nothing. */
  pause(): Promise<void>;
  /** Consumes every queue again on the current channel, if any (else the next ready hook will). */
  resume(): Promise<void>;
  /** Cancels every consumer (presence first); in-flight deliveries still settle on the channel. */
  stop(): Promise<void>;
  /** One round trip on the channel, so acks sent before it are handled before the channel closes. */
  flush(): Promise<void>;
}

export function makeQueueConsumer(deps: QueueConsumerDeps): QueueConsumer {
  const { env, policies, names, connection, log } = deps;
  let channel: Channel | null = null;
  /** Consumer tag per policy on `channel`; a policy missing here is not being consumed right now. */
  const consumers = new Map<string, string>();
  /** Presence consumer tag per policy on `channel`: this process's proof to the batch-version gate. */
  const presence = new Map<string, string>();
  let paused = false;

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
        if (message) deps.deliver(target, message);
        else onCancelledByBroker(target, policy);
      }, { consumerTag: consumerTagFor(env.workerId, policy, deps.highestAccepted) });
    });
    consumeTurn = turn.catch(() => undefined); // a failed turn (channel closed) does not hold up the next
    const { consumerTag } = await turn;
    consumers.set(policy, consumerTag);
    // After the work consumer: the proof never stands for a consumer that does not exist yet.
    presence.set(policy, await announcePresence(target, names.presenceQueue(policy, deps.instanceId())));
  }

  /** Cancels the presence proofs of `only` (default: every policy), before their work consumers go. */
  async function withdrawPresence(target: Channel | null, only?: string): Promise<void> {
    for (const [policy, tag] of [...presence]) {
      if (only !== undefined && policy !== only) continue;
      presence.delete(policy);
      if (target) await target.cancel(tag).catch(() => undefined); // closed channel: the broker dropped it already
    }
  }

  /** Forgets every consumer at once (nothing is consumed from here on), then cancels them on the broker. */
  async function cancelEveryConsumer(): Promise<void> {
    const current = channel;
    const tags = [...consumers.values()];
    consumers.clear();
    await withdrawPresence(current);
    if (current) for (const tag of tags) await current.cancel(tag).catch(() => undefined); // closed channel: nothing to cancel
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
        if (deps.stopping() || paused || channel !== target || consumers.has(policy)) return;
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

  async function open(model: ChannelModel): Promise<void> {
    const opened = await model.createChannel();
    opened.on('error', (error: Error) => log.warn({ err: error.message }, 'consume channel error'));
    opened.on('close', () => {
      if (channel !== opened) return;
      channel = null;
      // A channel can die alone (a queue deleted under it, a broker-side error) while the
      // connection lives on; its ready hook would then never run again, so reopen here.
      if (!deps.stopping() && connection.connected) {
        setTimeout(() => {
          if (!deps.stopping() && channel === null && connection.connected) {
            // Re-declare first: consuming a deleted queue is what closes a channel most often.
            connection
              .reassertTopology()
              .then(() => open(model))
              .catch((error: Error) => log.warn({ err: error.message }, 'reopening the consume channel failed; reconnect will'));
          }
        }, 1_000);
      }
    });
    channel = opened;
    if (!deps.stopping() && !paused) await consumeAll(opened);
  }

  return {
    open,
    get consumingAll() {
      return connection.connected && channel !== null && consumers.size === policies.size && !paused;
    },
    pause() {
      paused = true;
      return cancelEveryConsumer();
    },
    async resume() {
      paused = false;
      if (!deps.stopping() && channel) await consumeAll(channel).catch((error: Error) => log.warn({ err: error.message }, 'resume failed; reconnect will resume'));
    },
    stop: cancelEveryConsumer,
    async flush() {
      if (channel) await channel.checkQueue(names.deadLetterQueue).catch(() => undefined); // channel already gone: nothing to flush
    },
  };
}
