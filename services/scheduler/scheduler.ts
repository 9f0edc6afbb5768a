import { schedule as scheduleCron, type ScheduledTask } from 'node-cron';
import pg from 'pg';
import type { Logger } from 'pino';
import type { Env } from '../../shared/config/env';
import { retiresPartitions, type Policy, type PolicySet } from '../../shared/config/policies';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, topologyFor } from '../../shared/amqp/topology';
import { ADAPTIVE, lookLongestMs } from '../../shared/admission/adaptive';
import { adaptiveAdmission } from '../../shared/admission/rows';
import { assertSchemaCurrent } from '../../shared/db/migrate';
import { admissionAdaptivePaceRead, admissionOverridesRead } from '../../shared/db/queries/admission';
import { rowAdmissionWith } from '../../shared/admission/overrides';
import { makePool, warmPool } from '../../shared/db/pool';
import { partitionRetirePrivilegesMissing } from '../../shared/db/queries/partitions';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import {
  runClaimOf,
  runsClaimNext,
  runsDatabaseNow,
  runsInsertIfAbsent,
  runsLatestScheduledTick,
  runsReleaseLease,
  runsSettlePublished,
  RUNS_CHANNEL,
} from '../../shared/db/queries/runs';
import { reply, startHealthServer, type RouteHandler } from '../../shared/observability/http';
import { makeMetrics, type Metrics } from '../../shared/observability/metrics';
import { startDatabaseProbe } from '../../shared/observability/database-probe';
import { startAuditRetention } from './audit-retention';
import { loadBatchVersionConfig } from '../../shared/config/batch-version';
import { startHeartbeat } from '../../shared/observability/heartbeat';
import { startBacklogGauges } from './backlog-gauges';
import { makeBatchVersionGate } from './batch-version-gate';
import { executeRun, type PaceSource, type RunExecutorDeps } from './run-executor';
import { CRON_TIMEZONE, latestMissedTick, truncateToSecond } from './ticks';
import { loadSchedulerTuning } from './tuning';
import { makeWebhookRoutes, WEBHOOK_MAX_BODY_BYTES } from './webhooks';
import { startWindowWatch } from './windows';

/**
 * The scheduler paces a run by its workers' adaptive rate while they stepped it within this long
 * (they step it every 250 ms or so while other clients share the database; alone they do not).
 */
const PACE_RATE_FRESH_SECONDS = 5;
/**
 * A run's first window waits for its workers' first take at most their start look's length and
 * this much (the message's way to a worker, its first statement's turn; a busy CI host's pauses):
 * with no take by then the full windows go (no worker running: nobody to be gentle for).
 */
const PACE_FIRST_TAKE_MARGIN_MS = 1_000;

/**
 * How a run of `policy` is paced (run-executor.ts paceWindow): for row-delete policies, the
 * workers' adaptive rate while it is in force, its first window the floor's until their first take;
 * or a fixed one (the file's, or an operator's override) from the start. A policy with no rate in
 * its file is not paced: an override adding one later does not pace its runs (their windows go out
 * whole, as before overrides existed).
 */
export function paceFor(pool: pg.Pool, policy: Policy): PaceSource | null {
  if (policy.kind !== 'row-delete') return null;
  const fileRate = policy.admission?.rowsPerSecond;
  if (adaptiveAdmission(policy)) {
    return {
      read: () => admissionAdaptivePaceRead(pool, policy.name, PACE_RATE_FRESH_SECONDS),
      firstTake: {
        rowsPerSecond: Math.min(ADAPTIVE.floorRowsPerSecond, fileRate ?? Number.POSITIVE_INFINITY),
        withinMs: lookLongestMs(policy.admission?.law) + PACE_FIRST_TAKE_MARGIN_MS,
      },
    };
  }
  if (fileRate === undefined) return null;
  return {
    // A failed read of the overrides paces by the file's rate: no rate would publish a full window at once.
    read: async () => ({ rate: rowAdmissionWith(policy, (await admissionOverridesRead(pool, [policy.name]).catch(() => []))[0] ?? null).rowsPerSecond ?? fileRate }),
    firstTake: null,
  };
}

/** How often a scheduler looks for runs made elsewhere (CLI, webhooks, crashed replicas). */
const CLAIM_POLL_MS = 1_000;
/** How often published runs are checked for completion (every confirmed batch has a receipt). */
const COMPLETION_POLL_MS = 250;
/** Published runs one completion pass looks at, at most (round robin): the pass stays bounded. */
const COMPLETION_BATCH = 32;
/**
 * Passes one completion tick runs back to back while a pass reports more settled batches to walk
 * (moreToWalk), each still bounded: a run is marked published only after its scan, so its cursor
 * starts then, and a run of 5,000 batches whose receipts were all in took three passes 250 ms apart
 * (bench `--only cost`: 0.6-0.7 s of a 7.3 s run from the last batch begun to completed). A bound
 * on the passes in a row leaves the interval to the other timers.
 */
const COMPLETION_PASSES_IN_A_ROW = 50;

export interface SchedulerHandle {
  metrics: Metrics;
  httpPort: number | undefined;
  stop(): Promise<void>;
}

/**
 * The scheduler: cron ticks, one catch-up run at start, and one claim loop PER POLICY that claims
 * that policy's runs (new, manual, replayed or abandoned by a crashed replica) and executes them
 * one at a time: a policy whose runs fail or wait on retries never delays another policy's runs.
 * Ticks only PROPOSE a run: the unique (policy, scheduled_for) row decides which replica's
 * proposal wins.
 */
/**
 * LISTEN for new runs on a dedicated connection; reconnects after an error. Notifications only
 * wake the claim loop early: correctness never depends on them.
 */
function listenForNewRuns(databaseUrl: string, log: Logger, wake: (policy: string | undefined) => void): { close(): Promise<void> } {
  let client: pg.Client | null = null;
  let closed = false;
  let retry: NodeJS.Timeout | null = null;
  const connect = async (): Promise<void> => {
    retry = null;
    const next = new pg.Client({ connectionString: databaseUrl, application_name: 'reaper-scheduler-listen' });
    next.on('notification', (message) => wake(message.payload));
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
  const tuning = loadSchedulerTuning();
  const batchVersions = loadBatchVersionConfig();
  const metrics = makeMetrics([...policies.values()]);
  const pool = makePool(env.databaseUrl, env.dbPoolSize, 'reaper-scheduler', env.sessionTimeouts, 'keep');
  const names = brokerNames(env.amqpPrefix);
  const policyNames = [...policies.keys()];
  const targets = new Map<string, ResolvedTarget>();
  let stopping = false;
  let started = false;
  let webhookRoutes: Record<string, RouteHandler> | null = null;

  // HTTP first: /livez answers from the start (an orchestrator must not kill a scheduler that is
  // still waiting for the broker); /readyz stays 503 until everything below is up.
  const connectionRef: { current: ReconnectingConnection | null } = { current: null };
  const server =
    env.httpPort === undefined
      ? undefined
      : await startHealthServer({
          port: env.httpPort,
          registry: metrics.registry,
          log,
          ready: () => started && !stopping && databaseProbe.answers() && (connectionRef.current?.connected ?? false),
          postRoutes: {
            '/webhooks/': async (request, body, response) => {
              const route = webhookRoutes?.['/webhooks/'];
              if (!route) return reply(response, 503, { error: 'scheduler is starting' });
              return route(request, body, response);
            },
          },
          maxBodyBytes: WEBHOOK_MAX_BODY_BYTES,
        });
  if (server) log.info({ httpPort: server.boundPort }, 'http listening');

  // The database answers /readyz's question (README: "database reachable"), in the background.
  const databaseProbe = startDatabaseProbe(() => runsDatabaseNow(pool), log);

  const abandonStart = async (error: unknown): Promise<never> => {
    databaseProbe.stop();
    server?.close();
    await connectionRef.current?.close().catch(() => undefined); // never fully started
    await pool.end();
    throw error;
  };
  try {
    await assertSchemaCurrent(pool);
  } catch (error) {
    return abandonStart(error);
  }
  for (const policy of policies.values()) {
    try {
      const target = await targetResolve(pool, policy);
      if (retiresPartitions(policy)) {
        const missing = await partitionRetirePrivilegesMissing(pool, target);
        if (missing.length > 0) throw new Error(`partitions.retire needs ${missing.join('; ')}`);
      }
      targets.set(policy.name, target);
    } catch (error) {
      return abandonStart(new Error(`policy ${policy.name}: ${(error as Error).message}`));
    }
  }
  // Runs start on backends that are already up (makePool, 'keep').
  log.info({ connections: await warmPool(pool) }, 'database connections opened');
  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-scheduler ${env.amqpPrefix} ${env.workerId}`,
    topology: topologyFor(env, policyNames),
    log,
  });
  connectionRef.current = connection;
  connection.on('ready', () => metrics.amqpConnected.set(1));
  connection.on('lost', () => metrics.amqpConnected.set(0));
  const publisher = new ConfirmingPublisher(connection);
  await connection.start();
  // `reaper trigger`/`replay` tell the operator when no scheduler has been seen for a while.
  const heartbeat = await startHeartbeat(pool, { service: 'scheduler', workerId: env.workerId, amqpPrefix: env.amqpPrefix, policies: policyNames, maxBatchVersion: null }, log).catch(abandonStart);
  const gate = makeBatchVersionGate({ wanted: batchVersions.publish, pool, connection, names, amqpPrefix: env.amqpPrefix, log });

  /** Per policy: the latest cron tick skipped because its window was closed (for the catch-up at the opening). */
  const skippedTicks = new Map<string, Date>();
  // Schedule windows: read on this process's clock, exported as gauges; an opening makes the catch-up run.
  const windows = startWindowWatch({
    policies,
    metrics,
    log,
    onOpened: (policy) =>
      void catchUpAtOpening(policy).catch((error: Error) => log.warn({ err: error.message, policy: policy.name }, 'catch-up at the window opening failed; the next tick runs')),
  });

  const deps: RunExecutorDeps = {
    pool,
    publisher,
    names,
    owner: env.workerId,
    leaseMs: tuning.runLeaseMs,
    unroutableFailAfterMs: tuning.unroutableFailAfterMs,
    log,
    metrics,
    stopping: () => stopping,
    batchVersion: gate.versionFor,
    now: windows.now,
    paceBy: (policy) => paceFor(pool, policy),
  };

  /**
   * One policy's claim loop: claims and executes that policy's runs until none is left. A wake
   * while draining asks for one more pass. Loops of different policies run concurrently.
   */
  function makeRunLoop(policy: Policy) {
    let draining: Promise<void> | null = null;
    let wakeAgain = false;
    const target = targets.get(policy.name)!;
    async function claimAndExecute(): Promise<void> {
      try {
        do {
          wakeAgain = false;
          for (;;) {
            if (stopping) return;
            // Outside the schedule window no run starts: pending runs (a webhook's) wait for the opening.
            if (!windows.isOpen(policy)) break;
            const run = await runsClaimNext(pool, env.workerId, tuning.runLeaseMs, [policy.name]);
            if (!run) break;
            const outcome = await executeRun(deps, run, policy, target);
            // Shutting down mid-run, or the window closed: hand the run over now rather than when
            // the lease runs out (the next window's claim resumes it from its cursor).
            if (outcome === 'stopped' || outcome === 'window-closed') await runsReleaseLease(pool, runClaimOf(run, env.workerId));
            if (outcome === 'window-closed') break;
          }
        } while (wakeAgain && !stopping);
      } catch (error) {
        log.warn({ err: (error as Error).message, policy: policy.name }, 'claiming runs failed; will retry');
      }
    }
    return {
      wake(): Promise<void> {
        if (draining) {
          wakeAgain = true;
          return draining;
        }
        draining = claimAndExecute().finally(() => {
          draining = null;
        });
        return draining;
      },
      idle: (): Promise<void> => draining ?? Promise.resolve(),
    };
  }
  const loops = new Map([...policies.values()].map((policy) => [policy.name, makeRunLoop(policy)]));
  const wake = (policy?: string): void => {
    if (policy !== undefined && loops.has(policy)) void loops.get(policy)!.wake();
    else for (const loop of loops.values()) void loop.wake();
  };

  async function proposeRun(policy: Policy, trigger: 'cron' | 'catch-up', scheduledFor: Date): Promise<void> {
    if (!windows.isOpen(policy)) {
      // Not recorded: the catch-up at the window's opening makes one run for every tick skipped here.
      skippedTicks.set(policy.name, scheduledFor);
      log.info({ policy: policy.name, trigger, scheduledFor }, 'tick outside the schedule window: skipped until the window opens');
      return;
    }
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
    wake(policy.name);
  }

  const tasks: ScheduledTask[] = [...policies.values()].map((policy) =>
    scheduleCron(policy.schedule, (context) => proposeRun(policy, 'cron', truncateToSecond(context.date)), {
      timezone: CRON_TIMEZONE,
      name: `reaper-${policy.name}`,
    }),
  );
  // One catch-up run per policy for ticks missed while no scheduler was running (or, at a
  // window's opening, skipped while it was closed). Read the clock after the cron tasks started:
  // a tick in between is then made by cron, or by both (one wins).
  async function catchUp(policy: Policy): Promise<void> {
    const now = await runsDatabaseNow(pool);
    const latest = await runsLatestScheduledTick(pool, policy.name);
    if (!latest) return;
    const missed = latestMissedTick(policy.schedule, latest, now);
    if (missed) await proposeRun(policy, 'catch-up', missed);
  }
  for (const policy of policies.values()) if (windows.isOpen(policy)) await catchUp(policy);
  /**
   * At a window's opening: one catch-up run for the ticks skipped while it was closed, named after
   * the latest one this scheduler skipped (every replica skips the same ticks: one run wins), or,
   * when this one skipped none (it started after them), after the latest tick the runs table misses.
   */
  async function catchUpAtOpening(policy: Policy): Promise<void> {
    const skipped = skippedTicks.get(policy.name);
    skippedTicks.delete(policy.name);
    if (skipped) await proposeRun(policy, 'catch-up', skipped);
    else await catchUp(policy);
  }

  const backlog = startBacklogGauges({ db: pool, owner: env.workerId, policies, targets, metrics, log, intervalMs: env.backlogRefreshMs });
  const auditRetention = startAuditRetention({ pool, policies, log });
  const poller = setInterval(() => wake(), CLAIM_POLL_MS);
  const listener = listenForNewRuns(env.databaseUrl, log, (policy) => wake(policy));
  let completing = false;
  const completer = setInterval(() => {
    if (completing) return;
    completing = true;
    (async () => {
      for (let pass = 0; pass < COMPLETION_PASSES_IN_A_ROW; pass++) {
        const checked = await runsSettlePublished(pool, { limit: COMPLETION_BATCH, incompleteAfterMs: tuning.incompleteAfterMs });
        for (const run of checked) {
          if (run.state === 'completed') log.info({ runId: run.runId, policy: run.policy }, 'run completed');
          if (run.state === 'incomplete') {
            metrics.runsIncompleteTotal.inc({ policy: run.policy });
            log.error(
              { runId: run.runId, policy: run.policy, batches: run.batchesConfirmed, missing: run.batchesMissing, afterMs: tuning.incompleteAfterMs },
              'run incomplete: batches without a receipt and no progress',
            );
          }
        }
        if (!checked.some((run) => run.moreToWalk) || stopping) return;
      }
    })()
      .catch((error: Error) => log.warn({ err: error.message }, 'completion check failed; next pass retries'))
      .finally(() => {
        completing = false;
      });
  }, COMPLETION_POLL_MS);
  wake();

  webhookRoutes = makeWebhookRoutes({ secret: env.webhookSecret, pool, policies, targets, log, onRunProposed: () => wake() });
  started = true;

  return {
    metrics,
    httpPort: server?.boundPort,
    async stop() {
      stopping = true;
      windows.stop();
      clearInterval(poller);
      clearInterval(completer);
      databaseProbe.stop();
      await listener.close();
      for (const task of tasks) await task.destroy();
      await backlog.stop();
      await auditRetention.stop();
      // Every loop stops at its next checkpoint and hands an unfinished run over.
      await Promise.all([...loops.values()].map((loop) => loop.idle()));
      server?.close();
      await heartbeat.stop();
      await connection.close();
      await pool.end();
    },
  };
}
