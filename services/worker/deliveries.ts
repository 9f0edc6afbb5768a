import type { Channel, ConsumeMessage } from 'amqplib';
import type { Logger } from 'pino';
import type { Env } from '../../shared/config/env';
import type { PolicySet } from '../../shared/config/policies';
import { decodeBatch, type BatchVersion } from '../../shared/contracts/batch';
import type { Pool } from '../../shared/db/pool';
import { failpoint } from '../../shared/observability/failpoint-hook';
import type { Metrics } from '../../shared/observability/metrics';
import type { makeBatchVersionCounter } from './batch-versions';
import type { DatabaseOutage } from './database-outage';
import { classifyHandlerError } from './errors';
import type { BatchHandler, HandlerContext } from './handlers/types';
import type { BatchResult } from './results';
import { requeueIfUnsettled, settle, type SettleDeps } from './settle';
import { outsideWindow } from './window-gate';

/** The `policy` label of batches for a policy this worker does not have (never a name from the message). */
export const UNKNOWN_POLICY_LABEL = '(unknown)';

export interface DeliveriesDeps {
  pool: Pool;
  env: Pick<Env, 'workerId'>;
  policies: PolicySet;
  handlers: ReadonlyMap<string, BatchHandler>;
  settleDeps: SettleDeps;
  metrics: Metrics;
  log: Logger;
  highestAccepted: BatchVersion;
  countVersion: ReturnType<typeof makeBatchVersionCounter>;
  outage: DatabaseOutage;
}

/** What the worker does with each message it is given, and how many it holds right now. */
export interface Deliveries {
  /** The consumer callback: decode, handle, settle. Never throws, never rejects. */
  deliver(from: Channel, message: ConsumeMessage): void;
  /** Resolves once no delivery is in flight (at once when none is). */
  drained(): Promise<void>;
}

/**
 * A message's way through the worker: decoded (a bad one is dead-lettered), routed to its policy's
 * handler unless outside the policy's schedule window, and its result settled (settle.ts). A
 * result that says the database is unreachable pauses consumption (database-outage.ts) before the
 * batch is given back.
 */
export function makeDeliveries(deps: DeliveriesDeps): Deliveries {
  const { pool, env, policies, handlers, metrics, log, outage } = deps;
  let inFlight = 0;
  let idle: (() => void) | null = null;

  /**
   * onMessage must never reject: the promise is not awaited by amqplib, and an unhandled rejection
   * ends Node with every batch of the channel in flight. settle never throws; this catch is the
   * last line of defence for a throw anywhere else (a message that settle did not act on is
   * requeued), and the in-flight count is kept whatever happens.
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
    const decoded = decodeBatch(message.content, { highestVersion: deps.highestAccepted });
    if (decoded.ok) deps.countVersion({ policy: decoded.batch.policy, version: decoded.version, policyVersion: decoded.policyVersion });
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
    const databaseDown = result.kind === 'unknown' && result.databaseUnavailable;
    // Stop consuming BEFORE the batch is given back: a reject first would let the broker hand it
    // (or the next one) straight back into the freed prefetch slot, and that delivery would fail
    // too. An outage must cost each in-flight batch exactly one delivery.
    if (databaseDown) await outage.pause();
    // Another batch already paused consumption: a batch that failed meanwhile (for any reason) is
    // given back only once its consumer is cancelled, for the same reason: its consumer may still
    // be active (its basic.cancel not yet answered), and it would be handed the batch straight back.
    else if (result.kind === 'unknown' && outage.pausing) {
      batchLog.info({ reason: result.reason }, 'batch failed while consumption pauses; given back once the consumers are cancelled');
      await outage.pausing;
    }
    await settle(deps.settleDeps, { channel: from, message, policy: label, deliveryCount, log: batchLog }, result);
    if (databaseDown) outage.resumeWhenDatabaseAnswers().catch((error: Error) => log.error({ err: error.message }, 'database pause failed (a bug)'));
    try {
      const heldSeconds = Number(process.hrtime.bigint() - started) / 1e9;
      metrics.batchSeconds.observe({ policy: label }, heldSeconds);
      metrics.messageHoldSeconds.observe({ policy: label }, heldSeconds);
    } catch (error) {
      batchLog.error({ err: (error as Error).message }, 'recording the batch duration failed; the batch is settled');
    }
  }

  return {
    deliver,
    drained: () => (inFlight === 0 ? Promise.resolve() : new Promise<void>((resolve) => (idle = resolve))),
  };
}
