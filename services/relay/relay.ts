import { randomUUID } from 'node:crypto';
import type { Logger } from 'pino';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher, UnroutableError } from '../../shared/amqp/publisher';
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
import { outboxClaimOldest, outboxDeletePublished, outboxEntryEvents, outboxKeepRefused, outboxReleaseClaims, outboxReleaseClaimsOf, type OutboxEntry } from '../../shared/db/queries/outbox';
import { runsDatabaseNow } from '../../shared/db/queries/runs';
import { startDatabaseProbe } from '../../shared/observability/database-probe';
import { failpoint } from '../../shared/observability/failpoint-hook';
import { startHealthServer } from '../../shared/observability/http';
import { makeMetrics, type Metrics } from '../../shared/observability/metrics';
import { makeRelayMetrics, type RelayMetrics } from './metrics';
import { testTimings } from '../../shared/config/test-timings';

/**
 * `reaper relay`: publishes the expiry-event outbox (cleanup_outbox) to `<prefix>.events`.
 *
 * An outbox row holds the events of every row one batch of a deleting statement deleted (migration
 * 0031; one event for a row of the older layout or a single remote settle); the relay publishes one
 * message per event. One pass claims the oldest unclaimed rows up to RELAY_EVENTS_PER_PASS events
 * with a lease (one short statement, outboxClaimOldest), publishes every event with publisher
 * confirms and `mandatory` with no transaction open, then deletes the rows ALL of whose events the
 * broker confirmed AND routed, where it still holds the claim, and gives back the claims of the rest
 * (a row with some events refused keeps only those: outboxKeepRefused). What must stay true: an
 * event leaves the outbox only after its confirm, so a crash, a lost database connection or a
 * broker outage at any point leaves the row to be published again (at-least-once; consumers dedupe
 * on the message id, the same on every retry); and no transaction or row lock is held while the
 * relay waits on the broker (invariant 18). A broker outage, or no queue bound for a policy's
 * events, only lets the outbox grow (up to each policy's events.maxOutbox events, where its
 * deletions pause: services/worker/outbox-limit.ts).
 *
 * An unroutable event (no queue bound for its routing key, e.g. `<policy>.partition-retired` where
 * the consumer bound only `#.expired`) is not a failure of the relay: its routing key waits on its
 * own (UnroutableKeys: 2 s doubling to 30 s, its rows left out of the claims meanwhile) and every
 * other key's events go on at full speed; the rows stay in the outbox until a queue is bound.
 */

/**
 * Events per pass (a pass takes whole rows: one more row as long as the events before it are fewer
 * than this, so at most this - 1 + one row's events, a batch, 500 by default). A pass's cost beyond
 * its messages (the claim, the delete, the wait for the last confirm) was paid per 200 events when a
 * row held one; 2,000 pays it per 2-4 rows of batch size, while a pass's messages (about 2,000 x
 * 300 B) stay small and are confirmed well within the publisher's 10 s confirm timeout and the
 * claim's lease. Measured: bench figure 8 "relay throughput" (docs/performance.md).
 */
export const RELAY_EVENTS_PER_PASS = 2_000;
/** Wait between passes when the outbox is empty. */
export const RELAY_IDLE_MS = 500;
/** Wait after a pass that failed (broker or database trouble) before the next. */
export const RELAY_FAILURE_BACKOFF_MS = 2_000;
/** The longest wait before a routing key whose events were unroutable is tried again (it starts at RELAY_FAILURE_BACKOFF_MS and doubles). */
export const RELAY_UNROUTABLE_MAX_MS = 30_000;
/**
 * How long a pass's claim keeps other relays off its rows: past the publisher's confirm timeout
 * (10 s), so a live relay deletes or gives back its rows before the claim runs out, and short, as
 * it is also how long a killed relay's rows wait for another relay (a relay restarted under the
 * same REAPER_WORKER_ID takes its earlier life's claims back at once: outboxReleaseClaimsOf).
 */
export const RELAY_CLAIM_MS = 15_000;
/**
 * PostgreSQL connections per relay at most, whatever REAPER_DB_POOL_SIZE says: a pass runs its
 * statements one after another (claim, then delete or give back), beside the database probe that
 * /readyz reads. The prod overlay's connection budget (infra/k8s/overlays/prod/worker-autoscaling.yaml)
 * counts it per replica of components/events-relay.
 */
export const RELAY_DB_POOL_SIZE = 2;

export interface RelayPass {
  /** Events claimed (of `rows` rows). */
  taken: number;
  rows: number;
  /** Events confirmed, which so left the outbox: every event of a row deleted, and the confirmed part of a row refused in part. */
  published: number;
  /** The first refusal of the pass other than unroutable (nacked, no confirm, channel closed), when some publish failed so. */
  failure: string | null;
  /** Routing keys whose events the broker returned as unroutable in this pass (they wait: UnroutableKeys). */
  unroutable: string[];
  /** `published` by the policy of their outbox rows. */
  publishedByPolicy: Record<string, number>;
  /** Events the broker returned as unroutable in this pass, by routing key. */
  unroutableEvents: Record<string, number>;
}

type OutboxKind = OutboxEntry['kind'];

/**
 * The routing keys (a policy and an event kind) the broker last returned as unroutable, each with
 * the time it may be tried again: its rows stay out of the relay's claims until then, so one key
 * with no queue bound does not hold back the others (head-of-line blocking). The wait starts at
 * `firstMs` and doubles up to `maxMs` while the key stays unroutable; one routed event clears it.
 * Per relay process (another relay learns it on its own first try).
 */
export class UnroutableKeys {
  private readonly keys = new Map<string, { policy: string; kind: OutboxKind; retryAt: number; waitMs: number }>();

  constructor(
    private readonly maxMs: number = testTimings().relayUnroutableMaxMs ?? RELAY_UNROUTABLE_MAX_MS,
    private readonly firstMs: number = Math.min(RELAY_FAILURE_BACKOFF_MS, maxMs),
    private readonly now: () => number = Date.now,
  ) {}

  /** The (policy, kind) pairs still waiting: left out of the next claim. */
  waiting(): Array<{ policy: string; kind: OutboxKind }> {
    const now = this.now();
    return [...this.keys.values()].filter((key) => key.retryAt > now).map(({ policy, kind }) => ({ policy, kind }));
  }

  unroutable(policy: string, kind: OutboxKind): void {
    const id = `${kind}:${policy}`;
    const earlier = this.keys.get(id);
    const waitMs = earlier ? Math.min(this.maxMs, earlier.waitMs * 2) : this.firstMs;
    this.keys.set(id, { policy, kind, retryAt: this.now() + waitMs, waitMs });
  }

  routed(policy: string, kind: OutboxKind): void {
    this.keys.delete(`${kind}:${policy}`);
  }
}

/** Where an outbox row is published: the one choice the publish and the unroutable-key wait share. */
const routingKeyOf = (entry: OutboxEntry) => (entry.kind === 'partition-retired' ? partitionRetiredRoutingKey(entry.policy) : expiryEventRoutingKey(entry.policy));

/** Publishes every event of one outbox row (each its own message, its own confirm). */
function publishEntry(publisher: ConfirmingPublisher, exchange: string, entry: OutboxEntry): Array<Promise<void>> {
  if (entry.kind === 'partition-retired') {
    return [
      publisher.publish(exchange, routingKeyOf(entry), Buffer.from(JSON.stringify(entry.event)), {
        messageId: entry.event.eventId,
        contentType: 'application/json',
        type: 'reaper.partition-retired',
        headers: { [EVENT_CAUSE_HEADER]: EVENT_CAUSE_EXPIRY, 'x-reaper-event-version': PARTITION_RETIRED_EVENT_VERSION },
      }),
    ];
  }
  return entry.events.map((event) =>
    publisher.publish(exchange, routingKeyOf(entry), encodeExpiryEvent(event), {
      messageId: expiryEventMessageId(event),
      contentType: 'application/json',
      type: 'reaper.expiry',
      headers: { [EVENT_CAUSE_HEADER]: EVENT_CAUSE_EXPIRY, 'x-reaper-event-version': EXPIRY_EVENT_VERSION },
    }),
  );
}

/** One pass over the oldest unclaimed outbox rows (see the module comment); `unroutable` keeps the keys that wait (none without it). */
export async function relayOnce(deps: {
  pool: Pool;
  publisher: ConfirmingPublisher;
  exchange: string;
  eventLimit: number;
  owner: string;
  claimMs?: number;
  unroutable?: UnroutableKeys;
}): Promise<RelayPass> {
  const entries = await outboxClaimOldest(deps.pool, {
    eventLimit: deps.eventLimit,
    owner: deps.owner,
    leaseMs: deps.claimMs ?? testTimings().relayClaimMs ?? RELAY_CLAIM_MS,
    skip: deps.unroutable?.waiting() ?? [],
  });
  if (entries.length === 0) return { taken: 0, rows: 0, published: 0, failure: null, unroutable: [], publishedByPolicy: {}, unroutableEvents: {} };
  failpoint('relay-before-publish');
  // All events of all rows in flight at once; a row's outcome is which of its events were refused
  // (1-based, as in its arrays) and the first refusal's reason.
  const outcomes = await Promise.all(
    entries.map(async (entry) => {
      const settled = await Promise.allSettled(publishEntry(deps.publisher, deps.exchange, entry));
      const refusedAt = settled.flatMap((outcome, index) => (outcome.status === 'rejected' ? [index + 1] : []));
      const refusals = settled.flatMap((outcome) => (outcome.status === 'rejected' ? [outcome.reason as unknown] : []));
      const unroutableEvents = refusals.filter((reason) => reason instanceof UnroutableError).length;
      return { entry, refusedAt, reason: refusals[0], confirmedEvents: settled.length - refusedAt.length, unroutableEvents };
    }),
  );
  const confirmed = outcomes.filter(({ refusedAt }) => refusedAt.length === 0).map(({ entry }) => entry);
  failpoint('relay-after-confirm');
  await outboxDeletePublished(deps.pool, confirmed.map((entry) => entry.outboxId), deps.owner);
  const rejected = outcomes.filter(({ refusedAt }) => refusedAt.length > 0);
  // A row refused in part (only a row of several events can be) keeps only its refused events
  // (outboxKeepRefused); one refused whole is given back whole. Either way at once, for any relay
  // (this one takes its own claims again at its next pass anyway), under the same message ids.
  for (const { entry, refusedAt, confirmedEvents } of rejected) if (confirmedEvents > 0) await outboxKeepRefused(deps.pool, entry.outboxId, deps.owner, refusedAt);
  const wholly = rejected.filter(({ confirmedEvents }) => confirmedEvents === 0);
  if (wholly.length > 0) await outboxReleaseClaims(deps.pool, wholly.map(({ entry }) => entry.outboxId), deps.owner);
  for (const entry of confirmed) deps.unroutable?.routed(entry.policy, entry.kind);
  // Per policy the events published, per routing key those returned unroutable: one pass over the
  // outcomes; a key with any unroutable event waits (UnroutableKeys).
  const publishedByPolicy: Record<string, number> = {};
  const unroutableEvents: Record<string, number> = {};
  for (const { entry, confirmedEvents, unroutableEvents: returned } of outcomes) {
    if (confirmedEvents > 0) publishedByPolicy[entry.policy] = (publishedByPolicy[entry.policy] ?? 0) + confirmedEvents;
    if (returned === 0) continue;
    const key = routingKeyOf(entry);
    if (unroutableEvents[key] === undefined) deps.unroutable?.unroutable(entry.policy, entry.kind);
    unroutableEvents[key] = (unroutableEvents[key] ?? 0) + returned;
  }
  // Without a key list to wait in, an unroutable event is a failure of the pass (the whole relay waits).
  const failed = rejected.find(({ reason }) => !(reason instanceof UnroutableError) || deps.unroutable === undefined);
  return {
    taken: entries.reduce((sum, entry) => sum + outboxEntryEvents(entry), 0),
    rows: entries.length,
    published: outcomes.reduce((sum, outcome) => sum + outcome.confirmedEvents, 0),
    failure: failed ? String((failed.reason as Error).message ?? failed.reason) : null,
    unroutable: Object.keys(unroutableEvents),
    publishedByPolicy,
    unroutableEvents,
  };
}

export interface RelayHandle {
  metrics: Metrics;
  relayMetrics: RelayMetrics;
  /** As the scheduler's and the worker's: the port /livez, /readyz and /metrics answer on (none without HTTP_PORT). */
  httpPort: number | undefined;
  stop(): Promise<void>;
}

export async function startRelay(env: Env, policies: PolicySet, log: Logger): Promise<RelayHandle> {
  const metrics = makeMetrics();
  const relayMetrics = makeRelayMetrics(metrics.registry, [...policies.keys()]);
  const pool = makePool(env.databaseUrl, RELAY_DB_POOL_SIZE, 'reaper-relay', env.sessionTimeouts);
  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-relay ${env.amqpPrefix} ${env.workerId}`,
    topology: topologyFor(env, [...policies.keys()]),
    log,
  });
  connection.on('ready', () => metrics.amqpConnected.set(1));
  connection.on('lost', () => metrics.amqpConnected.set(0));
  const publisher = new ConfirmingPublisher(connection);
  let started = false;
  let stopping = false;

  // HTTP first, as the scheduler: /livez answers while the broker is still unreachable (the relay
  // is alive and retrying); /readyz says ready while the broker connection is up and the database
  // answered its latest probe (the relay's passes need both).
  const databaseProbe = startDatabaseProbe(() => runsDatabaseNow(pool), log);
  let server: Awaited<ReturnType<typeof startHealthServer>> | undefined;
  try {
    server =
      env.httpPort === undefined
        ? undefined
        : await startHealthServer({ port: env.httpPort, registry: metrics.registry, log, ready: () => started && !stopping && connection.connected && databaseProbe.answers() });
    if (server) log.info({ httpPort: server.boundPort }, 'http listening');
    await connection.start();
  } catch (error) {
    databaseProbe.stop();
    server?.close();
    await connection.close();
    await pool.end();
    throw error;
  }
  const exchange = brokerNames(env.amqpPrefix).eventsExchange;

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
  const unroutable = new UnroutableKeys();
  const countPass = (pass: RelayPass): void => {
    for (const [policy, events] of Object.entries(pass.publishedByPolicy)) relayMetrics.eventsPublishedTotal.inc({ policy: relayMetrics.policyLabel(policy) }, events);
    for (const [routingKey, events] of Object.entries(pass.unroutableEvents)) relayMetrics.eventsUnroutableTotal.inc({ routing_key: routingKey }, events);
    if (pass.failure === null) relayMetrics.lastPassTimestampSeconds.set(Date.now() / 1000);
    else relayMetrics.passesFailedTotal.inc();
  };
  const eventsPerPass = testTimings().relayEventsPerPass ?? RELAY_EVENTS_PER_PASS;
  started = true;
  const loop = (async () => {
    while (!stopping) {
      let pass: RelayPass;
      try {
        pass = await relayOnce({ pool, publisher, exchange, eventLimit: eventsPerPass, owner, unroutable });
      } catch (error) {
        relayMetrics.passesFailedTotal.inc();
        log.warn({ err: (error as Error).message }, 'relay pass failed; the outbox rows stay and are published again');
        await pause(RELAY_FAILURE_BACKOFF_MS);
        continue;
      }
      countPass(pass);
      if (pass.taken > 0) log.info({ taken: pass.taken, rows: pass.rows, published: pass.published }, 'expiry events published');
      if (pass.unroutable.length > 0) {
        log.warn({ routingKeys: pass.unroutable, exchange }, 'no queue bound for these routing keys: their events stay in the outbox and are tried again later; the other events go on');
      }
      if (pass.failure !== null) {
        log.warn({ failure: pass.failure, unpublished: pass.taken - pass.published }, 'some expiry events were not confirmed; they stay in the outbox');
        await pause(RELAY_FAILURE_BACKOFF_MS);
      } else if (pass.taken < eventsPerPass) {
        // Fewer events than the limit: no claimable row was left (the next row would have been taken).
        await pause(RELAY_IDLE_MS);
      }
    }
  })();

  return {
    metrics,
    relayMetrics,
    httpPort: server?.boundPort,
    async stop() {
      stopping = true;
      wake?.();
      await loop;
      databaseProbe.stop();
      server?.close();
      await connection.close();
      await pool.end();
    },
  };
}
