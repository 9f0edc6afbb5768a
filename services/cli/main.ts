import { Command, CommanderError, Option } from 'commander';
import { loadEnv, type Env } from '../../shared/config/env';
import { ConfigError } from '../../shared/config/errors';
import amqp from 'amqplib';
import { requirePolicy, type PolicySet, type RemoteDeletePolicy } from '../../shared/config/policies';
import { brokerNames, DELAY_TIERS_MS, makeTopology, topologyAsDefinitions } from '../../shared/amqp/topology';
import { admissionList, admissionSetPaused, replicationLagRead } from '../../shared/db/queries/admission';
import { admissionViews } from '../../shared/admission/overrides';
import { describe as describeAdmission } from './admission';
import { ledgerCountsByPolicy } from '../../shared/db/queries/ledger';
import { ELIGIBLE_ROWS_CAP } from '../../shared/db/queries/backlog';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import { readBacklog } from '../scheduler/backlog-gauges';
import { deadLettersList, deadLettersPurge, deadLettersRequeue, describeRequeue } from './dead-letters';
import { migrate } from '../../shared/db/migrate';
import { demoTablesCreate } from '../../shared/db/queries/demo-tables';
import { runsGetSummary, runsListSummaries } from '../../shared/db/queries/runs';
import { makeLogger } from '../../shared/observability/logger';
import { startScheduler } from '../scheduler/scheduler';
import { startWorker } from '../worker/worker';
import { printResult, table } from './output';
import { addRolesCommand } from './roles';

import { context, NotFoundError, UsageError, withPool } from './common';
import { registerApprovalCommands } from './approvals';
import { registerAuditCommand } from './audit';
import { registerHoldCommands } from './holds';
import { registerPlanCommand } from './plan';
import { registerAdmissionCommands } from './admission';
import { describeRun, registerRunCommands, runRow } from './runs';

/** Runs a service in the foreground until SIGTERM/SIGINT, then drains and exits 0. */
async function runService(kind: 'scheduler' | 'worker'): Promise<void> {
  const { env, policies } = context();
  const log = makeLogger({ level: env.logLevel, service: kind, workerId: env.workerId });
  const handle = kind === 'scheduler' ? await startScheduler(env, policies, log) : await startWorker(env, policies, log);
  log.info({ httpPort: handle.httpPort, policies: [...policies.keys()] }, `${kind} started`);
  await new Promise<void>((resolve) => {
    const shutdown = (signal: string) => {
      log.info({ signal }, `${kind} draining`);
      resolve();
    };
    process.once('SIGTERM', () => shutdown('SIGTERM'));
    process.once('SIGINT', () => shutdown('SIGINT'));
  });
  await handle.stop();
  log.info(`${kind} stopped`);
}

function parseLimit(value: string): number {
  const limit = Number(value);
  if (!Number.isInteger(limit) || limit < 1 || limit > 100_000) throw new UsageError(`--limit: must be an integer from 1 to 100000 (got "${value}")`);
  return limit;
}

async function setPaused(policyName: string | undefined, paused: boolean, json: boolean): Promise<void> {
  const { env, policies } = context();
  const remote = [...policies.values()].filter((policy): policy is RemoteDeletePolicy => policy.kind === 'remote-delete');
  let chosen = remote;
  if (policyName !== undefined) {
    const policy = requirePolicy(policies, policyName);
    if (policy.kind !== 'remote-delete') throw new UsageError(`policy "${policyName}" is ${policy.kind}; pause applies to remote-delete policies`);
    chosen = [policy];
  }
  await withPool(env, async (pool) => {
    const names = chosen.map((policy) => policy.name);
    const changed = await admissionSetPaused(pool, names, paused, new Map(chosen.map((policy) => [policy.name, policy.admission.burst])));
    printResult(json, { paused, policies: names, changed }, () =>
      `${paused ? 'paused' : 'resumed'}: ${names.join(', ') || '(no remote-delete policy)'}${changed.length < names.length ? ` (already ${paused ? 'paused' : 'running'}: ${names.filter((n) => !changed.includes(n)).join(', ')})` : ''}`,
    );
  });
}

async function collectStatus(env: Env, policies: PolicySet) {
  return withPool(env, async (pool) => {
    // The same reads as the scheduler's backlog gauges; a policy whose table cannot be resolved shows nulls.
    const targets = new Map<string, ResolvedTarget>();
    for (const policy of policies.values()) {
      const target = await targetResolve(pool, policy).catch(() => null); // reported as unknown (null) below
      if (target) targets.set(policy.name, target);
    }
    const backlog = new Map((await readBacklog(pool, [...policies.values()], targets)).map((entry) => [entry.policy, entry]));
    const ledger = new Map((await ledgerCountsByPolicy(pool)).map((row) => [row.policy, row]));
    const admission = new Map((await admissionList(pool)).map((row) => [row.policy, row]));
    const inForce = new Map((await admissionViews(pool, [...policies.values()])).map((view) => [view.policy, view]));
    const replication = await replicationLagRead(pool);
    const recent = await runsListSummaries(pool, { limit: 500 });
    const depths = await queueDepths(env, [...policies.keys()]);
    const brokerError = depths.error;
    return {
      policies: [...policies.values()].map((policy) => {
        const last = recent.find((run) => run.policy === policy.name);
        const counts = ledger.get(policy.name);
        const waiting = backlog.get(policy.name);
        return {
          policy: policy.name,
          kind: policy.kind,
          oldestEligibleAgeSeconds: waiting ? roundSeconds(waiting.target.oldestEligibleAgeSeconds) : null,
          oldestLeasedAgeSeconds: waiting ? roundSeconds(waiting.ledger?.oldestLeasedAgeSeconds ?? 0) : null,
          waitingRows: waiting?.target.eligibleRows ?? null,
          waitingRowsCapped: waiting ? waiting.target.eligibleRows >= ELIGIBLE_ROWS_CAP : null,
          lastCompletedRun: waiting?.lastCompleted?.runId ?? null,
          lastCompletedAt: waiting?.lastCompleted?.finishedAt ?? null,
          lastCompletedLagSeconds: waiting?.lastCompleted ? roundSeconds(waiting.lastCompleted.lagSeconds) : null,
          paused: admission.get(policy.name)?.paused ?? false,
          // Live admission (file values, `reaper admission set` override with who and when, in force).
          admission: inForce.get(policy.name)!,
          // row-delete replica-lag brake: engaged while a standby's replay lag is over the maximum.
          brake:
            policy.kind === 'row-delete' && policy.brake
              ? { maxReplicationLagSeconds: policy.brake.maxReplicationLagSeconds, lagSeconds: roundSeconds(replication.lagSeconds), standbys: replication.standbys, engaged: replication.lagSeconds > policy.brake.maxReplicationLagSeconds }
              : null,
          lastRun: last?.createdAt ?? null,
          lastRunState: last?.state ?? null,
          // Why the last run failed or is incomplete (null when it did not).
          lastRunError: last?.error ?? null,
          queued: depths.work.get(policy.name) ?? null,
          pending: counts?.pending ?? 0,
          inFlight: counts?.inFlight ?? 0,
          confirmed: counts?.confirmed ?? 0,
          rejected: counts?.rejected ?? 0,
          gaveUp: counts?.gaveUp ?? 0,
        };
      }),
      deadLetters: depths.deadLetters,
      delayed: depths.delayed,
      brokerError,
    };
  });
}

/** Ages to the millisecond: enough for an operator, and stable in JSON. */
function roundSeconds(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

/**
 * Message counts of the work queues, the delay tiers (retries waiting out their delay) and the
 * dead-letter queue; null where the broker does not answer, with the reason in `error`.
 */
async function queueDepths(
  env: Env,
  policyNames: string[],
): Promise<{ work: Map<string, number>; deadLetters: number | null; delayed: number | null; error: string | null }> {
  const names = brokerNames(env.amqpPrefix);
  const work = new Map<string, number>();
  let deadLetters: number | null = null;
  let delayed: number | null = null;
  let error: string | null = null;
  try {
    const connection = await amqp.connect(env.amqpUrl, { timeout: 5000 });
    try {
      for (const policy of policyNames) {
        const channel = await connection.createChannel();
        channel.on('error', () => undefined); // a missing queue closes the channel; reported as null
        const found = await channel.checkQueue(names.workQueue(policy)).catch(() => null);
        if (found) work.set(policy, found.messageCount);
        await channel.close().catch(() => undefined);
      }
      const channel = await connection.createChannel();
      channel.on('error', () => undefined);
      deadLetters = (await channel.checkQueue(names.deadLetterQueue).catch(() => null))?.messageCount ?? null;
      // Each tier on its own channel: a missing tier queue closes the channel it was checked on.
      for (const tier of DELAY_TIERS_MS) {
        const tierChannel = await connection.createChannel();
        tierChannel.on('error', () => undefined);
        const found = await tierChannel.checkQueue(names.delayQueue(tier)).catch(() => null);
        if (found) delayed = (delayed ?? 0) + found.messageCount;
        await tierChannel.close().catch(() => undefined);
      }
    } finally {
      await connection.close().catch(() => undefined);
    }
  } catch (failure) {
    // Broker unreachable: the status still shows what the database knows, and says why not more.
    const { code, message } = failure as NodeJS.ErrnoException;
    error = `${redactUrl(env.amqpUrl)}: ${message || code || String(failure)}`;
  }
  return { work, deadLetters, delayed, error };
}

/** An AMQP/PostgreSQL URL without its password, for messages. */
function redactUrl(url: string): string {
  try {
    const parsed = new URL(url);
    if (parsed.password) parsed.password = '***';
    return parsed.toString();
  } catch {
    return '(unparseable URL)';
  }
}

export function makeProgram(): Command {
  const program = new Command('reaper')
    .description('Expires data reliably: scheduler, workers and operator commands.')
    .version(packageVersion(), '-V, --version', 'print the version')
    .exitOverride()
    .configureOutput({ writeErr: (text) => process.stderr.write(text) });
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('migrate')
    .description('apply database migrations (safe to run from several processes at once)')
    .option('--with-demo-tables', "also create the demo's own tables seat_reservations and media_assets if missing (local stack, demo)")
    .addOption(json())
    .action(async (options: { json?: boolean; withDemoTables?: boolean }) => {
      const env = loadEnv();
      // Progress on stderr as each file starts (not with --json, whose reader wants one document):
      // a long migration is visibly running, and the last line names the file that failed.
      const announce = options.json ? undefined : (name: string) => process.stderr.write(`applying ${name} ...\n`);
      const result = await migrate(env.databaseUrl, { onApplying: announce });
      // Production databases never get them: they are the demo policies' targets, not reaper's.
      if (options.withDemoTables) await withPool(env, (pool) => demoTablesCreate(pool));
      printResult(!!options.json, result, () =>
        result.applied.length ? `applied ${result.applied.join(', ')}; schema version ${result.current}` : `up to date (version ${result.current})`,
      );
    });

  program.command('scheduler').description('run the scheduler in the foreground').action(() => runService('scheduler'));
  program.command('worker').description('run a worker in the foreground').action(() => runService('worker'));

  registerRunCommands(program);

  program
    .command('runs')
    .description('list recent runs')
    .option('--policy <policy>', 'only this policy')
    .option('--limit <n>', 'how many', '20')
    .addOption(json())
    .action(async (options: { policy?: string; limit: string; json?: boolean }) => {
      const env = loadEnv();
      const limit = Number(options.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > 10_000) throw new UsageError(`--limit: must be an integer from 1 to 10000 (got "${options.limit}")`);
      await withPool(env, async (pool) => {
        const runs = await runsListSummaries(pool, { policy: options.policy, limit });
        printResult(!!options.json, runs, () => table(runs.map(runRow), ['run', 'policy', 'trigger', 'state', 'cutoff', 'candidates', 'skipped', 'batches', 'deleted', 'noop', 'reason']));
      });
    });

  program
    .command('run <runId>')
    .description('show one run with its counts')
    .addOption(json())
    .action(async (runId: string, options: { json?: boolean }) => {
      if (!/^[0-9a-f-]{36}$/i.test(runId)) throw new UsageError(`runId: "${runId}" is not a run id (uuid)`);
      const env = loadEnv();
      await withPool(env, async (pool) => {
        const run = await runsGetSummary(pool, runId);
        if (!run) throw new NotFoundError(`no run ${runId}`);
        printResult(!!options.json, run, () => describeRun(run));
      });
    });

  program
    .command('pause [policy]')
    .description('stop remote calls for a remote-delete policy (all when omitted); no ledger row is touched')
    .addOption(json())
    .action((policy: string | undefined, options: { json?: boolean }) => setPaused(policy, true, !!options.json));

  program
    .command('resume [policy]')
    .description('resume remote calls; the backlog drains from where it stopped')
    .addOption(json())
    .action((policy: string | undefined, options: { json?: boolean }) => setPaused(policy, false, !!options.json));

  program
    .command('status')
    .description('per policy: backlog age and size, oldest lease, last completed run and its lag, queue depths, ledger states, admission')
    .addOption(json())
    .action(async (options: { json?: boolean }) => {
      const { env, policies } = context();
      const status = await collectStatus(env, policies);
      printResult(!!options.json, status, () =>
        [
          table(
            status.policies.map((row) => ({
              ...row,
              oldestEligible: row.oldestEligibleAgeSeconds === null ? null : `${row.oldestEligibleAgeSeconds}s`,
              oldestLeased: row.oldestLeasedAgeSeconds === null ? null : `${row.oldestLeasedAgeSeconds}s`,
              waiting: row.waitingRows === null ? null : `${row.waitingRows}${row.waitingRowsCapped ? '+' : ''}`,
              lastCompleted: row.lastCompletedAt,
              lag: row.lastCompletedLagSeconds === null ? null : `${row.lastCompletedLagSeconds}s`,
              admission: `${describeAdmission(row.admission.inForce, row.admission.rateUnit)}${row.admission.override ? ` (override by ${row.admission.override.setBy})` : ''}`,
              brake: row.brake === null ? null : `${row.brake.engaged ? 'ENGAGED' : 'off'} (lag ${row.brake.lagSeconds}s, max ${row.brake.maxReplicationLagSeconds}s)`,
            })),
            ['policy', 'kind', 'paused', 'admission', 'brake', 'oldestEligible', 'oldestLeased', 'waiting', 'lastCompleted', 'lag', 'lastRun', 'lastRunState', 'lastRunError', 'queued', 'pending', 'inFlight', 'confirmed', 'rejected', 'gaveUp'],
          ),
          `delay tiers (retries waiting): ${status.delayed ?? 'unknown'} message(s)`,
          `dead-letter queue: ${status.deadLetters ?? 'unknown'} message(s)`,
          ...(status.brokerError ? [`broker not reachable, queue counts unknown: ${status.brokerError}`] : []),
        ].join('\n'),
      );
    });

  program
    .command('topology')
    .description('print the broker topology (exchanges, queues, bindings) the services assert')
    .option('--definitions', 'print it as a RabbitMQ definitions file (JSON) to pre-declare it')
    .addOption(json())
    .action((options: { json?: boolean; definitions?: boolean }) => {
      const { env, policies } = context();
      const topology = makeTopology({ prefix: env.amqpPrefix, policies: [...policies.keys()], deliveryLimit: env.deliveryLimit });
      if (options.definitions) return printResult(true, topologyAsDefinitions(topology), () => '');
      printResult(!!options.json, topology, () =>
        [
          ...topology.exchanges.map((e) => `exchange ${e.name} (${e.type})`),
          ...topology.queues.map((q) => `queue    ${q.name} ${JSON.stringify(q.options.arguments ?? {})}`),
          ...topology.bindings.map((b) => `binding  ${b.exchange} -> ${b.queue}${b.routingKey ? ` key ${b.routingKey}` : ''}${b.args ? ` ${JSON.stringify(b.args)}` : ''}`),
        ].join('\n'),
      );
    });

  const dlq = program.command('dlq').description('inspect and handle the dead-letter queue');
  const limitOption = () => new Option('--limit <n>', 'at most this many messages').default('100');
  dlq
    .command('list')
    .description('show dead-lettered messages with their reasons (they stay in the queue)')
    .addOption(limitOption())
    .addOption(json())
    .action(async (options: { limit: string; json?: boolean }) => {
      const env = loadEnv();
      const messages = await deadLettersList(env.amqpUrl, env.amqpPrefix, parseLimit(options.limit));
      printResult(!!options.json, messages, () => table(messages.map((m) => ({ ...m, detail: m.detail.slice(0, 80) })), ['messageId', 'policy', 'reason', 'bytes', 'detail']));
    });
  dlq
    .command('requeue')
    .description('publish dead-lettered messages back to their work queue (after you fixed the cause)')
    .addOption(limitOption())
    .option('--reason <reason>', 'only messages dead-lettered for this reason')
    .addOption(json())
    .action(async (options: { limit: string; reason?: string; json?: boolean }) => {
      const env = loadEnv();
      const result = await deadLettersRequeue(env.amqpUrl, env.amqpPrefix, { limit: parseLimit(options.limit), reason: options.reason });
      printResult(!!options.json, result, () => describeRequeue(result));
      if (result.failed > 0) process.exitCode = 1; // some stayed behind against the operator's wish
    });
  dlq
    .command('purge')
    .description('delete every message in the dead-letter queue')
    .option('--yes', 'confirm: the messages are gone for good')
    .addOption(json())
    .action(async (options: { yes?: boolean; json?: boolean }) => {
      if (!options.yes) throw new UsageError('purge deletes every dead-lettered message for good; add --yes to confirm');
      const env = loadEnv();
      const purged = await deadLettersPurge(env.amqpUrl, env.amqpPrefix);
      printResult(!!options.json, { purged }, () => `purged ${purged} message(s)`);
    });

  registerPlanCommand(program);
  registerApprovalCommands(program);
  registerHoldCommands(program);
  registerAuditCommand(program);
  registerAdmissionCommands(program);

  program
    .command('demo')
    .description('run the demo end to end in the reaper_demo database (npm run demo)')
    .action(async () => {
      // Loaded on demand: the demo brings the stand-in media API, which the runtime image need not carry.
      const { runDemo } = require('./demo') as typeof import('./demo');
      process.exitCode = await runDemo();
    });

  addRolesCommand(program);

  // Operator commands stop on SIGINT/SIGTERM at once (the services drain instead: runService).
  // Explicit handlers matter when the command is PID 1 (a container, a Kubernetes Job): the kernel
  // delivers no signal to PID 1 that it has not installed a handler for.
  program.hook('preAction', (_program, action) => {
    if (action.name() !== 'scheduler' && action.name() !== 'worker') stopOnSignals();
  });

  return program;
}

export async function main(argv: string[]): Promise<number> {
  const program = makeProgram();
  try {
    await program.parseAsync(argv);
    return typeof process.exitCode === 'number' ? process.exitCode : 0;
  } catch (error) {
    if (error instanceof CommanderError) {
      // --help and --version end here with exit code 0; a bad option or argument with 1 → usage (2).
      return error.exitCode === 0 ? 0 : 2;
    }
    if (error instanceof UsageError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 2;
    }
    if (error instanceof NotFoundError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 1;
    }
    if ((error as { code?: string }).code === '42P01') {
      // undefined_table: the database has no reaper schema (or an older one).
      process.stderr.write(`reaper: ${(error as Error).message}: the database has no reaper schema yet; run \`reaper migrate\` first\n`);
      return 1;
    }
    if (error instanceof ConfigError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 1;
    }
    process.stderr.write(`reaper: ${(error as Error).message}\n`);
    return 1;
  }
}

function packageVersion(): string {
  // dist/services/cli/main.js -> package.json at the package root (also /app in the image).
  const { version } = require('../../../package.json') as { version: string };
  return version;
}

const SIGNAL_EXIT_CODES = { SIGINT: 130, SIGTERM: 143 } as const;

/** Exits 130/143 on SIGINT/SIGTERM (the shell's convention), after saying so on stderr. */
function stopOnSignals(): void {
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    process.once(signal, () => {
      process.stderr.write(`reaper: stopped by ${signal}\n`);
      process.exit(SIGNAL_EXIT_CODES[signal]);
    });
  }
}

/** Entry point: exits with main's code once stdout is flushed (a pipe may still be draining). */
export function runCli(): void {
  void main(process.argv).then((code) => process.stdout.write('', () => process.exit(code)));
}

if (require.main === module) runCli();
