import { randomUUID } from 'node:crypto';
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
  PARTITION_RETIRED_EVENT_VERSION,
  partitionRetiredRoutingKey,
} from '../../shared/contracts/expiry-event';
import { makePool, type Pool } from '../../shared/db/pool';
import { outboxClaimOldest, outboxDeletePublished, outboxReleaseClaims, outboxReleaseClaimsOf } from '../../shared/db/queries/outbox';
import { failpoint } from '../../shared/observability/failpoint-hook';
import { testTimings } from '../../shared/config/test-timings';

/**
 * `reaper relay`: publishes the expiry-event outbox (cleanup_outbox) to `<prefix>.events`.
 *
 * One pass claims the oldest RELAY_BATCH_SIZE unclaimed rows with a lease (one short statement,
 * outboxClaimOldest), publishes each with publisher confirms and `mandatory` with no transaction
 * open, then deletes the rows whose events the broker confirmed AND routed, where it still holds
 * the claim, and gives back the claims of the rest. What must stay true: an outbox row is deleted
 * only after its confirm, so a crash, a lost database connection or a broker outage at any point
 * leaves the row to be published again (at-least-once; consumers dedupe on the message id); and no
 * transaction or row lock is held while the relay waits on the broker (invariant 18). A broker
 * outage, or no queue bound for a policy's events, only lets the outbox grow (up to each policy's
 * events.maxOutbox, where its deletions pause: services/worker/outbox-limit.ts).
 */

export const RELAY_BATCH_SIZE = 200;
/** Wait between passes when the outbox is empty. */
export const RELAY_IDLE_MS = 500;
/** Wait after a pass that failed (broker or database trouble) before the next. */
export const RELAY_FAILURE_BACKOFF_MS = 2_000;
/**
 * How long a pass's claim keeps other relays off its rows: past the publisher's confirm timeout
 * (10 s), so a live relay deletes or gives back its rows before the claim runs out, and short, as
 * it is also how long a killed relay's rows wait for another relay (a relay restarted under the
 * same REAPER_WORKER_ID takes its earlier life's claims back at once: outboxReleaseClaimsOf).
 */
export const RELAY_CLAIM_MS = 15_000;

export interface RelayPass {
  taken: number;
  published: number;
  /** The first refusal of the pass (unroutable, nacked, no confirm), when some publish failed. */
  failure: string | null;
}

/** One pass over the oldest unclaimed outbox rows (see the module comment). */
export async function relayOnce(deps: { pool: Pool; publisher: ConfirmingPublisher; exchange: string; batchSize: number; owner: string; claimMs?: number }): Promise<RelayPass> {
  const entries = await outboxClaimOldest(deps.pool, { limit: deps.batchSize, owner: deps.owner, leaseMs: deps.claimMs ?? testTimings().relayClaimMs ?? RELAY_CLAIM_MS });
  if (entries.length === 0) return { taken: 0, published: 0, failure: null };
  failpoint('relay-before-publish');
  const outcomes = await Promise.allSettled(
    entries.map((entry) =>
      entry.kind === 'partition-retired'
        ? deps.publisher.publish(deps.exchange, partitionRetiredRoutingKey(entry.event.policy), Buffer.from(JSON.stringify(entry.event)), {
            messageId: entry.event.eventId,
            contentType: 'application/json',
            type: 'reaper.partition-retired',
            headers: { [EVENT_CAUSE_HEADER]: EVENT_CAUSE_EXPIRY, 'x-reaper-event-version': PARTITION_RETIRED_EVENT_VERSION },
          })
        : deps.publisher.publish(deps.exchange, expiryEventRoutingKey(entry.event.policy), encodeExpiryEvent(entry.event), {
            messageId: expiryEventMessageId(entry.event),
            contentType: 'application/json',
            type: 'reaper.expiry',
            headers: { [EVENT_CAUSE_HEADER]: EVENT_CAUSE_EXPIRY, 'x-reaper-event-version': EXPIRY_EVENT_VERSION },
          }),
    ),
  );
  const confirmed = entries.filter((_, index) => outcomes[index]!.status === 'fulfilled');
  failpoint('relay-after-confirm');
  await outboxDeletePublished(deps.pool, confirmed.map((entry) => entry.outboxId), deps.owner);
  const refused = outcomes.find((outcome): outcome is PromiseRejectedResult => outcome.status === 'rejected');
  // Given back at once for any relay (this one takes its own claims again at its next pass anyway).
  if (refused) await outboxReleaseClaims(deps.pool, entries.filter((_, index) => outcomes[index]!.status === 'rejected').map((entry) => entry.outboxId), deps.owner);
  return { taken: entries.length, published: confirmed.length, failure: refused ? String((refused.reason as Error).message ?? refused.reason) : null };
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

  // Each process its own claim owner: two relays started with the same REAPER_WORKER_ID must not
  // delete each other's rows.
  const owner = `${env.workerId}:${randomUUID()}`;
  // A relay restarted under the same id (a process restarted in place) does not wait out its
  // earlier life's claims: that process is gone. (Two live relays must not share an id.)
  const reclaimed = await outboxReleaseClaimsOf(pool, `${env.workerId}:`).catch((error: Error) => {
    log.warn({ err: error.message }, 'taking back earlier claims failed; they are taken again when their lease ends');
    return 0;
  });
  if (reclaimed > 0) log.info({ reclaimed }, 'outbox claims of an earlier relay with this id taken back');
  const loop = (async () => {
    while (!stopping) {
      let pass: RelayPass;
      try {
        pass = await relayOnce({ pool, publisher, exchange, batchSize: RELAY_BATCH_SIZE, owner });
      } catch (error) {
        log.warn({ err: (error as Error).message }, 'relay pass failed; the outbox rows stay and are published again');
        await pause(RELAY_FAILURE_BACKOFF_MS);
        continue;
      }
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
