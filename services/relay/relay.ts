import type { Logger } from 'pino';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, topologyFor } from '../../shared/amqp/topology';
import type { Env } from '../../shared/config/env';
import type { PolicySet } from '../../shared/config/policies';
import {
  encodeExpiryEvent,
  EVENT_CAUSE_EXPIRY,
  EVENT_CAUSE_HEADER,
  EXPIRY_EVENT_VERSION,
  expiryEventMessageId,
  expiryEventRoutingKey,
} from '../../shared/contracts/expiry-event';
import { makePool, withTransaction, type Pool } from '../../shared/db/pool';
import { outboxDeletePublished, outboxTakeOldest } from '../../shared/db/queries/outbox';
import { failpoint } from '../../shared/observability/failpoint-hook';

/**
 * `reaper relay`: publishes the expiry-event outbox (cleanup_outbox) to `<prefix>.events`.
 *
 * One pass takes the oldest RELAY_BATCH_SIZE rows (locked, SKIP LOCKED: several relays share the
 * outbox instead of publishing the same rows), publishes each with publisher confirms and
 * `mandatory`, and deletes, in the same transaction, only the rows whose events the broker
 * confirmed AND routed. What must stay true: an outbox row is deleted only after its confirm, so a
 * crash, a lost database connection or a broker outage at any point leaves the row to be
 * published again (at-least-once; the message id is the deletion's stable key, so consumers dedupe).
 * A broker outage, or no queue bound for a policy's events, only lets the outbox grow (up to each
 * policy's events.maxOutbox, where its deletions pause: services/worker/outbox-limit.ts).
 */

export const RELAY_BATCH_SIZE = 200;
/** Wait between passes when the outbox is empty. */
export const RELAY_IDLE_MS = 500;
/** Wait after a pass that failed (broker or database trouble) before the next. */
export const RELAY_FAILURE_BACKOFF_MS = 2_000;
/**
 * A draining relay takes each pass after the last row of the one before (see outboxTakeOldest) and
 * starts again from the oldest row after a pass that reached the end of the outbox, failed, or
 * after this many passes: a row below the cursor (committed late, skipped while another relay held
 * it, or left by a failed publish) waits at most that long.
 */
export const RELAY_RESCAN_EVERY_PASSES = 25;

export interface RelayPass {
  taken: number;
  published: number;
  /** The id of the last row taken ('0' when none): where the next pass may start. */
  lastId: string;
  /** The first refusal of the pass (unroutable, nacked, no confirm), when some publish failed. */
  failure: string | null;
}

/** One pass over the oldest outbox rows (see the module comment). */
export async function relayOnce(deps: { pool: Pool; publisher: ConfirmingPublisher; exchange: string; batchSize: number; afterId?: string }): Promise<RelayPass> {
  return withTransaction(deps.pool, async (client) => {
    const entries = await outboxTakeOldest(client, deps.batchSize, deps.afterId);
    if (entries.length === 0) return { taken: 0, published: 0, lastId: '0', failure: null };
    failpoint('relay-before-publish');
    const outcomes = await Promise.allSettled(
      entries.map(({ event }) =>
        deps.publisher.publish(deps.exchange, expiryEventRoutingKey(event.policy), encodeExpiryEvent(event), {
          messageId: expiryEventMessageId(event),
          contentType: 'application/json',
          type: 'reaper.expiry',
          headers: { [EVENT_CAUSE_HEADER]: EVENT_CAUSE_EXPIRY, 'x-reaper-event-version': EXPIRY_EVENT_VERSION },
        }),
      ),
    );
    const confirmed = entries.filter((_, index) => outcomes[index]!.status === 'fulfilled');
    failpoint('relay-after-confirm');
    await outboxDeletePublished(client, confirmed.map((entry) => entry.outboxId));
    const refused = outcomes.find((outcome): outcome is PromiseRejectedResult => outcome.status === 'rejected');
    return { taken: entries.length, published: confirmed.length, lastId: entries.at(-1)!.outboxId, failure: refused ? String((refused.reason as Error).message ?? refused.reason) : null };
  });
}

export interface RelayHandle {
  httpPort: number | null;
  stop(): Promise<void>;
}

export async function startRelay(env: Env, policies: PolicySet, log: Logger): Promise<RelayHandle> {
  const pool = makePool(env.databaseUrl, 2, 'reaper-relay', env.sessionTimeouts);
  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-relay ${env.amqpPrefix} ${env.workerId}`,
    topology: topologyFor(env, [...policies.keys()]),
    log,
  });
  const publisher = new ConfirmingPublisher(connection);
  await connection.start();
  const exchange = brokerNames(env.amqpPrefix).eventsExchange;

  let stopping = false;
  let wake: (() => void) | null = null;
  // A wait that stop() cuts short.
  const pause = (ms: number) =>
    new Promise<void>((resolve) => {
      const done = (): void => {
        clearTimeout(timer);
        wake = null;
        resolve();
      };
      const timer = setTimeout(done, ms);
      wake = done;
    });

  const loop = (async () => {
    // Where the next pass starts (RELAY_RESCAN_EVERY_PASSES): '0' = the oldest row.
    let afterId = '0';
    let passesSinceRescan = 0;
    while (!stopping) {
      let pass: RelayPass;
      try {
        pass = await relayOnce({ pool, publisher, exchange, batchSize: RELAY_BATCH_SIZE, afterId });
      } catch (error) {
        afterId = '0';
        log.warn({ err: (error as Error).message }, 'relay pass failed; the outbox rows stay and are published again');
        await pause(RELAY_FAILURE_BACKOFF_MS);
        continue;
      }
      passesSinceRescan += 1;
      const goOn = pass.failure === null && pass.taken === RELAY_BATCH_SIZE && passesSinceRescan < RELAY_RESCAN_EVERY_PASSES;
      afterId = goOn ? pass.lastId : '0';
      if (!goOn) passesSinceRescan = 0;
      if (pass.taken > 0) log.info({ taken: pass.taken, published: pass.published }, 'expiry events published');
      if (pass.failure !== null) {
        log.warn({ failure: pass.failure, unpublished: pass.taken - pass.published }, 'some expiry events were not confirmed; they stay in the outbox');
        await pause(RELAY_FAILURE_BACKOFF_MS);
      } else if (pass.taken < RELAY_BATCH_SIZE) {
        await pause(RELAY_IDLE_MS);
      }
    }
  })();

  return {
    httpPort: null,
    async stop() {
      stopping = true;
      wake?.();
      await loop;
      await connection.close();
      await pool.end();
    },
  };
}
