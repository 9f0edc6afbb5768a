import { schedule as scheduleCron, type ScheduledTask } from 'node-cron';
import pg from 'pg';
import type { Logger } from 'pino';
import type { Env } from '../../shared/config/env';
import type { Policy, PolicySet } from '../../shared/config/policies';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, makeTopology } from '../../shared/amqp/topology';
import { assertSchemaCurrent } from '../../shared/db/migrate';
import { makePool } from '../../shared/db/pool';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import {
  runsClaimNext,
  runsCompleteFinished,
  runsDatabaseNow,
  runsInsertIfAbsent,
  runsLatestScheduledTick,
  runsReleaseLease,
  RUNS_CHANNEL,
} from '../../shared/db/queries/runs';
import { startHealthServer } from '../../shared/observability/http';
import { makeMetrics, type Metrics } from '../../shared/observability/metrics';
import { startBacklogGauges } from './backlog-gauges';
import { executeRun } from './run-executor';
import { CRON_TIMEZONE, latestMissedTick, truncateToSecond } from './ticks';
import { makeWebhookRoutes, WEBHOOK_MAX_BODY_BYTES } from './webhooks';

/** How long a run belongs to one scheduler without progress before another replica takes it over. */
const RUN_LEASE_MS = 30_000;
/** How often a scheduler looks for runs made elsewhere (CLI, webhooks, crashed replicas). */
const CLAIM_POLL_MS = 1_000;
/** How often published runs are checked for completion (every confirmed batch has a receipt). */
const COMPLETION_POLL_MS = 250;

export interface SchedulerHandle {
  metrics: Metrics;
  httpPort: number | undefined;
  stop(): Promise<void>;
}

/**
 * The scheduler: cron ticks, one catch-up run at start, and a single loop that claims runs (new,
 * manual, replayed or abandoned by a crashed replica) and executes them one at a time. Ticks only
 * PROPOSE a run: the unique (policy, scheduled_for) row decides which replica's proposal wins.
 */
/**
 * LISTEN for new runs on a dedicated connection; reconnects after an error. Notifications only
 * wake the claim loop early: correctness never depends on them.
 */
function listenForNewRuns(databaseUrl: string, log: Logger, wake: () => void): { close(): Promise<void> } {
  let client: pg.Client | null = null;
  let closed = false;
  let retry: NodeJS.Timeout | null = null;
  const connect = async (): Promise<void> => {
    retry = null;
    const next = new pg.Client({ connectionString: databaseUrl, application_name: 'reaper-scheduler-listen' });
    next.on('notification', () => wake());
    next.on('error', (error: Error) => {
      log.warn({ err: error.message }, 'run notifications lost; polling until reconnected');
      void next.end().catch(() => undefined); // already broken
      if (!closed && !retry) retry = setTimeout(() => void connect(), 2_000);
    });
    try {
      await next.connect();
      await next.query(`LISTEN ${RUNS_CHANNEL}`);
      client = next;
      if (closed) await next.end();
    } catch (error) {
      log.warn({ err: (error as Error).message }, 'cannot listen for run notifications; polling');
      void next.end().catch(() => undefined); // never connected
      if (!closed && !retry) retry = setTimeout(() => void connect(), 2_000);
    }
  };
  void connect();
  return {
    async close() {
      closed = true;
      if (retry) clearTimeout(retry);
      await client?.end().catch(() => undefined); // closing anyway
    },
  };
}

export async function startScheduler(env: Env, policies: PolicySet, log: Logger): Promise<SchedulerHandle> {
  const metrics = makeMetrics([...policies.values()]);
  const pool = makePool(env.databaseUrl, env.dbPoolSize, 'reaper-scheduler', env.sessionTimeouts);
  const names = brokerNames(env.amqpPrefix);
  const policyNames = [...policies.keys()];
  const targets = new Map<string, ResolvedTarget>();
  try {
    await assertSchemaCurrent(pool);
  } catch (error) {
    await pool.end();
    throw error;
  }
  for (const policy of policies.values()) {
    try {
      targets.set(policy.name, await targetResolve(pool, policy));
    } catch (error) {
      await pool.end();
      throw new Error(`policy ${policy.name}: ${(error as Error).message}`);
    }
  }
  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-scheduler ${env.amqpPrefix} ${env.workerId}`,
    topology: makeTopology({ prefix: env.amqpPrefix, policies: policyNames, deliveryLimit: env.deliveryLimit }),
    log,
  });
  connection.on('ready', () => metrics.amqpConnected.set(1));
  connection.on('lost', () => metrics.amqpConnected.set(0));
  const publisher = new ConfirmingPublisher(connection);
  await connection.start();

  let stopping = false;
  let draining: Promise<void> | null = null;
  let wakeAgain = false;
  const deps = { pool, publisher, names, owner: env.workerId, leaseMs: RUN_LEASE_MS, log, metrics, stopping: () => stopping };

  /** Claims and executes runs until none is left. A call while draining asks for one more pass. */
  function drainRuns(): Promise<void> {
    if (draining) {
      wakeAgain = true;
      return draining;
    }
    draining = claimAndExecute().finally(() => {
      draining = null;
    });
    return draining;
  }

  async function claimAndExecute(): Promise<void> {
    try {
      do {
        wakeAgain = false;
        for (;;) {
          if (stopping) return;
          const run = await runsClaimNext(pool, env.workerId, RUN_LEASE_MS, policyNames);
          if (!run) break;
          const outcome = await executeRun(deps, run, policies.get(run.policy)!, targets.get(run.policy)!);
          // Shutting down mid-run: hand the run over now rather than when the lease runs out.
          if (outcome === 'stopped') await runsReleaseLease(pool, run.runId, env.workerId);
        }
      } while (wakeAgain && !stopping);
    } catch (error) {
      log.warn({ err: (error as Error).message }, 'claiming runs failed; will retry');
    }
  }

  async function proposeRun(policy: Policy, trigger: 'cron' | 'catch-up', scheduledFor: Date): Promise<void> {
    try {
      const run = await runsInsertIfAbsent(pool, { policy: policy.name, trigger, scheduledFor, cutoff: null });
      if (run) {
        metrics.runsTotal.inc({ policy: policy.name, trigger });
        log.info({ runId: run.runId, policy: policy.name, trigger, scheduledFor: run.scheduledFor, cutoff: run.cutoff }, 'run created');
      }
    } catch (error) {
      // The database is unreachable: this tick is missed; the next start's catch-up covers it.
      log.error({ err: (error as Error).message, policy: policy.name }, 'could not record run for tick');
    }
    void drainRuns();
  }

  const tasks: ScheduledTask[] = [...policies.values()].map((policy) =>
    scheduleCron(policy.schedule, (context) => proposeRun(policy, 'cron', truncateToSecond(context.date)), {
      timezone: CRON_TIMEZONE,
      name: `reaper-${policy.name}`,
    }),
  );
  // One catch-up run per policy for ticks missed while no scheduler was running. Read the clock
  // after the cron tasks started: a tick in between is then made by cron, or by both (one wins).
  const now = await runsDatabaseNow(pool);
  for (const policy of policies.values()) {
    const latest = await runsLatestScheduledTick(pool, policy.name);
    if (!latest) continue;
    const missed = latestMissedTick(policy.schedule, latest, now);
    if (missed) await proposeRun(policy, 'catch-up', missed);
  }

  const backlog = startBacklogGauges({ db: pool, owner: env.workerId, policies, targets, metrics, log, intervalMs: env.backlogRefreshMs });
  const poller = setInterval(() => void drainRuns(), CLAIM_POLL_MS);
  const listener = listenForNewRuns(env.databaseUrl, log, () => void drainRuns());
  let completing = false;
  const completer = setInterval(() => {
    if (completing) return;
    completing = true;
    runsCompleteFinished(pool)
      .then((completed) => {
        for (const runId of completed) log.info({ runId }, 'run completed');
      })
      .catch((error: Error) => log.warn({ err: error.message }, 'completion check failed; next pass retries'))
      .finally(() => {
        completing = false;
      });
  }, COMPLETION_POLL_MS);
  void drainRuns();

  const server =
    env.httpPort === undefined
      ? undefined
      : await startHealthServer({
          port: env.httpPort,
          registry: metrics.registry,
          log,
          ready: () => connection.connected && !stopping,
          postRoutes: makeWebhookRoutes({ secret: env.webhookSecret, pool, policies, targets, log, onRunProposed: () => void drainRuns() }),
          maxBodyBytes: WEBHOOK_MAX_BODY_BYTES,
        });

  return {
    metrics,
    httpPort: server?.boundPort,
    async stop() {
      stopping = true;
      clearInterval(poller);
      clearInterval(completer);
      await listener.close();
      for (const task of tasks) await task.destroy();
      await backlog.stop();
      // The loop stops at its next checkpoint and hands an unfinished run over.
      await draining;
      server?.close();
      await connection.close();
      await pool.end();
    },
  };
}
