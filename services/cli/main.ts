import { Command, CommanderError, Option } from 'commander';
import { loadEnv, type Env } from '../../shared/config/env';
import { ConfigError } from '../../shared/config/errors';
import { connectAny } from '../../shared/amqp/connection';
import { requirePolicy, type PolicySet, type RemoteDeletePolicy } from '../../shared/config/policies';
import { brokerNames, makeTopology, topologyAsDefinitions } from '../../shared/amqp/topology';
import { admissionList, admissionSetPaused } from '../../shared/db/queries/admission';
import { ledgerCountsByPolicy } from '../../shared/db/queries/ledger';
import { ELIGIBLE_ROWS_CAP } from '../../shared/db/queries/backlog';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/expiring-rows';
import { readBacklog } from '../scheduler/backlog-gauges';
import { deadLettersList, deadLettersPurge, deadLettersRequeue, describeRequeue } from './dead-letters';
import { migrate } from '../../shared/db/migrate';
import type { Pool } from '../../shared/db/pool';
import { runsGetSummary, runsInsertIfAbsent, runsListSummaries, type RunSummary } from '../../shared/db/queries/runs';
import { makeLogger } from '../../shared/observability/logger';
import { startScheduler } from '../scheduler/scheduler';
import { startWorker } from '../worker/worker';
import { runDemo } from './demo';
import { printResult, table } from './output';

import { context, ISO_INPUT, pastCutoff, UsageError, withPool } from './common';
import { registerApprovalCommands } from './approvals';
import { registerAuditCommand } from './audit';
import { registerHoldCommands } from './holds';
import { registerPlanCommand } from './plan';

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

function runRow(run: RunSummary): Record<string, unknown> {
  return {
    run: run.runId,
    policy: run.policy,
    trigger: run.trigger,
    state: run.state,
    cutoff: run.cutoff,
    candidates: run.candidates,
    skipped: run.skipped,
    batches: `${run.batchesDone}/${run.batchesConfirmed}`,
    deleted: run.deleted,
    noop: run.noop,
    // Why a run failed or is incomplete; the whole text is in `reaper run <id>`.
    reason: run.error === null ? null : run.error.length > 60 ? `${run.error.slice(0, 59)}…` : run.error,
  };
}

function describeRun(run: RunSummary): string {
  return [
    `run        ${run.runId}`,
    `policy     ${run.policy} (${run.trigger}${run.replayOf ? ` of ${run.replayOf}` : ''})`,
    `state      ${run.state}${run.error ? `: ${run.error}` : ''}`,
    `scheduled  ${run.scheduledFor}`,
    `cutoff     ${run.cutoff}`,
    `candidates ${run.candidates}`,
    `skipped    ${run.skipped}${run.skipped > 0 ? ' (keys too long for a message; not deleted)' : ''}`,
    `batches    ${run.batchesDone} done of ${run.batchesConfirmed} confirmed${run.state === 'incomplete' ? `, ${run.batchesConfirmed - run.batchesDone} missing` : ''}`,
    `deleted    ${run.deleted}`,
    `no-op      ${run.noop}`,
    `finished   ${run.finishedAt ?? '-'}`,
  ].join('\n');
}

/** Polls a run until it completes or fails, printing progress to stderr; bounded by `timeoutMs`. */
async function waitForRun(pool: Pool, runId: string, timeoutMs: number, quiet: boolean): Promise<RunSummary> {
  const deadline = Date.now() + timeoutMs;
  let last = '';
  for (;;) {
    const run = (await runsGetSummary(pool, runId))!;
    const progress = `${run.state}: ${run.batchesDone}/${run.batchesConfirmed} batches, ${run.deleted} deleted, ${run.noop} no-op`;
    if (!quiet && progress !== last) process.stderr.write(`${progress}\n`);
    last = progress;
    if (run.state === 'completed' || run.state === 'failed' || run.state === 'incomplete') return run;
    if (Date.now() > deadline) throw new Error(`run ${runId} not finished after ${timeoutMs} ms (${progress})`);
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
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
    const recent = await runsListSummaries(pool, { limit: 500 });
    const depths = await queueDepths(env, [...policies.keys()]);
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
    };
  });
}

/** Ages to the millisecond: enough for an operator, and stable in JSON. */
function roundSeconds(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

/** Message counts of the work queues and the dead-letter queue; null where the broker does not answer. */
async function queueDepths(env: Env, policyNames: string[]): Promise<{ work: Map<string, number>; deadLetters: number | null }> {
  const names = brokerNames(env.amqpPrefix);
  const work = new Map<string, number>();
  let deadLetters: number | null = null;
  try {
    const connection = await connectAny(env.amqpUrl, { timeout: 5000 });
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
    } finally {
      await connection.close();
    }
  } catch {
    // Broker unreachable: the status still shows what the database knows.
  }
  return { work, deadLetters };
}

export function makeProgram(): Command {
  const program = new Command('reaper')
    .description('Expires data reliably: scheduler, workers and operator commands.')
    .exitOverride()
    .configureOutput({ writeErr: (text) => process.stderr.write(text) });
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('migrate')
    .description('apply database migrations (safe to run from several processes at once)')
    .addOption(json())
    .action(async (options: { json?: boolean }) => {
      const env = loadEnv();
      const result = await migrate(env.databaseUrl);
      printResult(!!options.json, result, () =>
        result.applied.length ? `applied ${result.applied.join(', ')}; schema version ${result.current}` : `up to date (version ${result.current})`,
      );
    });

  program.command('scheduler').description('run the scheduler in the foreground').action(() => runService('scheduler'));
  program.command('worker').description('run a worker in the foreground').action(() => runService('worker'));

  program
    .command('trigger <policy>')
    .description('start a run of <policy> now, with the database clock as cutoff')
    .option('--wait', 'wait until the run completes and print its summary')
    .option('--timeout <seconds>', 'with --wait: give up after this long', '600')
    .addOption(json())
    .action(async (policyName: string, options: { wait?: boolean; timeout: string; json?: boolean }) => {
      const { env, policies } = context();
      requirePolicy(policies, policyName);
      const timeoutSeconds = Number(options.timeout);
      if (!Number.isFinite(timeoutSeconds) || timeoutSeconds <= 0) throw new UsageError(`--timeout: must be a positive number of seconds (got "${options.timeout}")`);
      await withPool(env, async (pool) => {
        const run = await runsInsertIfAbsent(pool, { policy: policyName, trigger: 'manual', scheduledFor: null, cutoff: null });
        if (!run) throw new Error('a run for this instant already exists; try again');
        const result = options.wait ? await waitForRun(pool, run.runId, timeoutSeconds * 1000, !!options.json) : await runsGetSummary(pool, run.runId);
        printResult(!!options.json, result, () => (options.wait ? describeRun(result!) : `run ${run.runId} created (cutoff ${run.cutoff}); a scheduler will execute it`));
        if (result?.state === 'failed' || result?.state === 'incomplete') process.exitCode = 1;
      });
    });

  program
    .command('replay')
    .description('run a policy again with a fixed cutoff: the cutoff of --run, or --policy with --cutoff')
    .option('--run <runId>', 'replay this run (same policy, same cutoff)')
    .option('--policy <policy>', 'policy to run')
    .option('--cutoff <iso>', 'cutoff, ISO 8601 with a time zone (e.g. 2026-11-29T20:00:00.000000Z)')
    .option('--wait', 'wait until the run completes')
    .addOption(json())
    .action(async (options: { run?: string; policy?: string; cutoff?: string; wait?: boolean; json?: boolean }) => {
      const { env, policies } = context();
      if (options.run && (options.policy || options.cutoff)) throw new UsageError('give either --run, or --policy with --cutoff, not both');
      if (!options.run && !(options.policy && options.cutoff)) throw new UsageError('give --run <runId>, or --policy <policy> with --cutoff <iso>');
      if (options.cutoff && !ISO_INPUT.test(options.cutoff)) {
        throw new UsageError(`--cutoff: "${options.cutoff}" is not an ISO 8601 timestamp with a time zone`);
      }
      if (options.run && !/^[0-9a-f-]{36}$/i.test(options.run)) throw new UsageError(`--run: "${options.run}" is not a run id (uuid)`);
      await withPool(env, async (pool) => {
        let policy = options.policy;
        let cutoff = options.cutoff;
        if (options.run) {
          const original = await runsGetSummary(pool, options.run);
          if (!original) throw new UsageError(`--run: no run ${options.run}`);
          policy = original.policy;
          cutoff = original.cutoff;
        }
        requirePolicy(policies, policy!);
        // A cutoff can only narrow what is eligible (DESIGN invariant 2): a future one is refused.
        if (options.cutoff) await pastCutoff(pool, options.cutoff);
        const run = await runsInsertIfAbsent(pool, { policy: policy!, trigger: 'replay', scheduledFor: null, cutoff: cutoff!, replayOf: options.run ?? null });
        if (!run) throw new Error('a run for this instant already exists; try again');
        const result = options.wait ? await waitForRun(pool, run.runId, 600_000, !!options.json) : await runsGetSummary(pool, run.runId);
        printResult(!!options.json, result, () => (options.wait ? describeRun(result!) : `replay run ${run.runId} created (policy ${run.policy}, cutoff ${run.cutoff})`));
      });
    });

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
        if (!run) throw new UsageError(`no run ${runId}`);
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
            })),
            ['policy', 'kind', 'paused', 'oldestEligible', 'oldestLeased', 'waiting', 'lastCompleted', 'lag', 'lastRun', 'lastRunState', 'lastRunError', 'queued', 'pending', 'inFlight', 'confirmed', 'rejected', 'gaveUp'],
          ),
          `dead-letter queue: ${status.deadLetters ?? 'unknown'} message(s)`,
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
      const topology = makeTopology({ prefix: env.amqpPrefix, policies: [...policies.keys()], deliveryLimit: env.deliveryLimit, quorumGroupSize: env.quorumGroupSize });
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

  program
    .command('demo')
    .description('run the demo end to end in the reaper_demo database (npm run demo)')
    .action(async () => {
      process.exitCode = await runDemo();
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
    if (error instanceof ConfigError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 1;
    }
    process.stderr.write(`reaper: ${(error as Error).message}\n`);
    return 1;
  }
}

/** Entry point: exits with main's code once stdout is flushed (a pipe may still be draining). */
export function runCli(): void {
  void main(process.argv).then((code) => process.stdout.write('', () => process.exit(code)));
}

if (require.main === module) runCli();
