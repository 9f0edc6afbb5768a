import type { Logger } from 'pino';
import type { ConnectionSource } from '../../shared/amqp/publisher';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { BatchVersion } from '../../shared/contracts/batch';
import type { Pool } from '../../shared/db/pool';
import { heartbeatsLiveWorkers } from '../../shared/db/queries/heartbeats';
import { WORKER_FRESH_SECONDS } from '../../shared/observability/heartbeat';

/** A look at the consumers that takes longer than this counts as failed (version 1, the safe answer). */
const BROKER_TIMEOUT_MS = 5_000;

export interface BatchVersionDecision {
  version: BatchVersion;
  /** What decided it; a change of version or of cause is logged. */
  cause: 'configured' | 'older-worker' | 'unannounced-consumer' | 'unknown' | 'all-accept';
  /** Why, for the log: which consumer holds the version back, or that all accept it. */
  reason: string;
}

/**
 * Decides the batch version a run publishes, window by window, so a scheduler upgraded BEFORE its
 * workers stays safe: the version REAPER_BATCH_VERSION names is published only while every
 * consumer of the policy's work queue is known to accept it. Consumers are matched to workers by
 * identity, not by count alone:
 * - heartbeat rows (service_heartbeats): each worker announces the newest version it accepts
 *   (also visible in its consumer tags); one announcing less holds the version at what it accepts;
 * - each announcing worker must also prove on the broker that it consumes the queue NOW: its
 *   presence queue (`<prefix>.presence.<policy>.<instance id>`, services/worker/batch-versions.ts)
 *   has a consumer. A row alone stays fresh for 15 s after the worker was killed, and would stand
 *   in for another consumer in a count;
 * - the broker's consumer count of the work queue: more consumers than proven workers means a
 *   consumer that announced nothing (a worker of a release before announcements): held at 1.
 * Any doubt (database or broker not answering) is version 1, which every worker ever made accepts.
 *
 * What this cannot see: an older worker that connects after a window was published (a rollback,
 * an old pod restarting). It dead-letters those batches as `unsupported-version`; nothing is
 * deleted or lost, and `reaper dlq requeue --reason unsupported-version` sends them again once it
 * is gone (docs/operating.md "Operating": the upgrade runbook; test/faults/rolling-upgrade.test.ts).
 *
 * Every change of decision is logged (warn when held back, info when the named version is published).
 */
export function makeBatchVersionGate(options: {
  wanted: BatchVersion;
  pool: Pool;
  connection: ConnectionSource;
  names: BrokerNames;
  amqpPrefix: string;
  log: Logger;
}): { versionFor(policy: string): Promise<BatchVersion>; decide(policy: string): Promise<BatchVersionDecision> } {
  const { wanted, log } = options;
  const logged = new Map<string, string>();

  /** Consumers of `queue`; null when it does not exist (a passive declare of a missing queue closes its channel, hence one channel per look). */
  async function consumerCount(queue: string): Promise<number | null> {
    const model = await options.connection.waitReady(BROKER_TIMEOUT_MS);
    const channel = await model.createChannel();
    channel.on('error', () => undefined); // a missing queue closes the channel; the checkQueue rejects
    try {
      return (await channel.checkQueue(queue)).consumerCount;
    } catch (error) {
      if ((error as { code?: unknown }).code === 404) return null;
      throw error;
    } finally {
      await channel.close().catch(() => undefined); // closed by the broker already
    }
  }

  async function decide(policy: string): Promise<BatchVersionDecision> {
    if (wanted === 1) return { version: 1, cause: 'configured', reason: 'REAPER_BATCH_VERSION is 1' };
    try {
      const live = await heartbeatsLiveWorkers(options.pool, { policy, amqpPrefix: options.amqpPrefix, freshSeconds: WORKER_FRESH_SECONDS });
      const older = live.filter((worker) => worker.maxBatchVersion < wanted);
      if (older.length > 0) {
        const oldest = Math.max(1, Math.min(...older.map((worker) => worker.maxBatchVersion))) as BatchVersion;
        const who = older.map((worker) => `${worker.workerId} (accepts ${worker.maxBatchVersion})`).join(', ');
        return { version: oldest, cause: 'older-worker', reason: `${older.length} connected worker(s) accept at most version ${oldest}: ${who}` };
      }
      const consumers = await consumerCount(options.names.workQueue(policy));
      if (consumers === null) throw new Error(`queue ${options.names.workQueue(policy)} does not exist`);
      const proven: string[] = [];
      const unproven: string[] = [];
      for (const worker of live) {
        if (proven.length >= consumers) break; // every consumer is accounted for: no more looks needed
        const present = await consumerCount(options.names.presenceQueue(policy, worker.instanceId));
        (present !== null && present > 0 ? proven : unproven).push(worker.workerId);
      }
      if (consumers > proven.length) {
        const stale = unproven.length > 0 ? ` (${unproven.join(', ')} announce it but consume nothing now: stopped or killed)` : '';
        return {
          version: 1,
          cause: 'unannounced-consumer',
          reason: `${consumers} consumer(s) on the work queue but only ${proven.length} announce version ${wanted}${stale}: an older worker is connected`,
        };
      }
      return { version: wanted, cause: 'all-accept', reason: `every connected consumer (${consumers}) accepts version ${wanted}` };
    } catch (error) {
      return { version: 1, cause: 'unknown', reason: `cannot tell which versions the consumers accept (${(error as Error).message})` };
    }
  }

  /**
   * Asked once per window (up to 32 batches): one indexed read and one queue check, small next to
   * the window's publishes, and never a stale answer.
   */
  async function versionFor(policy: string): Promise<BatchVersion> {
    const decision = await decide(policy);
    // Logged when the version or its cause changes (and the first time), not at every window.
    const key = `${decision.version}:${decision.cause}`;
    if (logged.get(policy) !== key) {
      logged.set(policy, key);
      if (decision.version < wanted) {
        log.warn({ policy, wanted, publishing: decision.version, reason: decision.reason }, `holding batch version at ${decision.version} (REAPER_BATCH_VERSION=${wanted})`);
      } else {
        log.info({ policy, publishing: decision.version, reason: decision.reason }, `publishing batch version ${decision.version}`);
      }
    }
    return decision.version;
  }

  return { versionFor, decide };
}
