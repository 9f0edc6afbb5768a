import { Command, Option } from 'commander';
import type { Env } from '../../shared/config/env';
import { loadBatchVersionConfig } from '../../shared/config/batch-version';
import { requirePolicy, type Policy, type PolicySet } from '../../shared/config/policies';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames, topologyFor } from '../../shared/amqp/topology';
import { withTransaction, type Pool } from '../../shared/db/pool';
import { targetResolve } from '../../shared/db/queries/target';
import { heartbeatsLatestScheduler } from '../../shared/db/queries/heartbeats';
import {
  runClaimOf,
  runsClaimById,
  runsCompleteIfAllBatchesDone,
  runsGetSummary,
  runsInsertIfAbsent,
  runsReleaseLease,
  type Run,
  type RunSummary,
  type RunTrigger,
} from '../../shared/db/queries/runs';
import { SCHEDULER_RECENT_SECONDS } from '../../shared/observability/heartbeat';
import { makeLogger } from '../../shared/observability/logger';
import { makeMetrics } from '../../shared/observability/metrics';
import { makeBatchVersionGate } from '../scheduler/batch-version-gate';
import { executeRun, type RunOutcome } from '../scheduler/run-executor';
import { loadSchedulerTuning } from '../scheduler/tuning';
import { ConnectionError, describeAmqpUrl } from './connections';
import { context, ISO_INPUT, NotFoundError, pastCutoff, UsageError, withPool } from './common';
import { formatDuration, humanLogDestination, printResult } from './output';
import { outsideWindowMessage, windowStateAt } from '../../shared/schedule/window';
import { makeProgressLine, renderProgress } from './progress';
import { resolveRunId, runIdArgument } from './run-id';

/**
 * The run commands that start work: `trigger`, `replay` and `execute`, plus the run display helpers
 * `runs` and `run` share. Without --execute a run is only recorded and a scheduler executes it;
 * with --execute this process claims it and publishes it itself, through the scheduler's own
 * executor (services/scheduler/run-executor.ts): same claim, lease, checkpoints and takeover, so a
 * scheduler that starts meanwhile never executes it twice, and one that finds it abandoned (Ctrl-C,
 * a killed CLI) resumes it from the last checkpoint.
 */

/** States a run does not leave by itself: --wait stops there. */
const SETTLED_STATES: ReadonlySet<RunSummary['state']> = new Set(['completed', 'failed', 'incomplete', 'awaiting-approval', 'rejected']);
/** Final states that mean the work was not done: exit code 1. */
const UNSUCCESSFUL_STATES: ReadonlySet<RunSummary['state']> = new Set(['failed', 'incomplete', 'awaiting-approval', 'rejected']);
/** How long --execute waits for the broker before giving the run back and failing. */
const BROKER_CONNECT_TIMEOUT_MS = 15_000;
const PROGRESS_POLL_MS = 500;

export function runRow(run: RunSummary): Record<string, unknown> {
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
    // Why a run failed, is incomplete or awaits approval: whole (`reaper runs` wraps it under the row).
    reason: run.error,
  };
}

export function describeRun(run: RunSummary): string {
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

/**
 * Polls a run until it settles (SETTLED_STATES), printing progress to stderr; bounded by `timeoutMs`.
 * `complete`: this process published the run, and no scheduler may be running to notice that every
 * batch has its receipt, so each poll also makes the run completed when it is (the same conditional
 * statement the scheduler's completion pass uses; running it twice changes nothing).
 */
export async function waitForRun(pool: Pool, runId: string, timeoutMs: number, quiet: boolean, complete = false): Promise<RunSummary> {
  const deadline = Date.now() + timeoutMs;
  let last = '';
  for (;;) {
    if (complete) await runsCompleteIfAllBatchesDone(pool, runId);
    const run = (await runsGetSummary(pool, runId))!;
    const progress = `${run.state}: ${run.batchesDone}/${run.batchesConfirmed} batches, ${run.deleted} deleted, ${run.noop} no-op`;
    if (!quiet && progress !== last) process.stderr.write(`${progress}\n`);
    last = progress;
    if (SETTLED_STATES.has(run.state)) return run;
    if (Date.now() > deadline) throw new Error(`run ${runId} not finished after ${timeoutMs} ms (${progress})`);
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
}

interface StartOptions {
  wait?: boolean;
  timeout: string;
  execute?: boolean;
  json?: boolean;
}

function timeoutMsOf(options: StartOptions): number {
  const seconds = Number(options.timeout);
  if (!Number.isFinite(seconds) || seconds <= 0) throw new UsageError(`--timeout: must be a positive number of seconds (got "${options.timeout}")`);
  return seconds * 1000;
}

/** The owner name runs claimed by the CLI carry (visible in `cleanup_runs.owner`). */
function cliOwner(env: Env): string {
  return `cli:${env.workerId}`;
}

export function registerRunCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');
  const execute = () => new Option('--execute', 'claim the run and publish it from this process (no scheduler needed; same claim and lease rules)');
  const wait = () => new Option('--wait', 'wait until the run completes and print its summary');
  const timeout = () => new Option('--timeout <seconds>', 'with --wait: give up waiting after this long').default('600');

  program
    .command('trigger <policy>')
    .description('start a run of <policy> now, with the database clock as cutoff')
    .addOption(execute())
    .addOption(wait())
    .addOption(timeout())
    .addOption(json())
    .action(async (policyName: string, options: StartOptions) => {
      const { env, policies } = context();
      requirePolicy(policies, policyName);
      const timeoutMs = timeoutMsOf(options);
      await withPool(env, (pool) => startRun(env, policies, pool, { policy: policyName, trigger: 'manual', cutoff: null, replayOf: null }, options, timeoutMs));
    });

  program
    .command('replay')
    .description('run a policy again with a fixed cutoff: the cutoff of --run, or --policy with --cutoff')
    .option('--run <runId>', 'replay this run (same policy, same cutoff)')
    .option('--policy <policy>', 'policy to run')
    .option('--cutoff <iso>', 'cutoff, ISO 8601 with a time zone (e.g. 2026-11-29T20:00:00.000000Z)')
    .addOption(execute())
    .addOption(wait())
    .addOption(timeout())
    .addOption(json())
    .action(async (options: StartOptions & { run?: string; policy?: string; cutoff?: string }) => {
      const { env, policies } = context();
      if (options.run && (options.policy || options.cutoff)) throw new UsageError('give either --run, or --policy with --cutoff, not both');
      if (!options.run && !(options.policy && options.cutoff)) throw new UsageError('give --run <runId>, or --policy <policy> with --cutoff <iso>');
      if (options.cutoff && !ISO_INPUT.test(options.cutoff)) {
        throw new UsageError(`--cutoff: "${options.cutoff}" is not an ISO 8601 timestamp with a time zone`);
      }
      const runArgument = options.run ? runIdArgument('--run', options.run) : null;
      const timeoutMs = timeoutMsOf(options);
      await withPool(env, async (pool) => {
        let policy = options.policy;
        let cutoff = options.cutoff;
        let replayOf: string | null = null;
        if (runArgument) {
          replayOf = await resolveRunId(pool, runArgument);
          const original = await runsGetSummary(pool, replayOf);
          if (!original) throw new NotFoundError(`--run: no run ${options.run}`);
          policy = original.policy;
          cutoff = original.cutoff;
        }
        requirePolicy(policies, policy!);
        // A cutoff can only narrow what is eligible (docs/design.md invariant 2): a future one is refused.
        if (options.cutoff) await pastCutoff(pool, options.cutoff);
        await startRun(env, policies, pool, { policy: policy!, trigger: 'replay', cutoff: cutoff!, replayOf }, options, timeoutMs);
      });
    });

  program
    .command('execute <runId>')
    .description('claim an existing run (waiting, or abandoned mid-scan: Ctrl-C, a crash) and publish it from this process')
    .addOption(wait())
    .addOption(timeout())
    .addOption(json())
    .action(async (given: string, options: StartOptions) => {
      const id = runIdArgument('runId', given);
      const { env, policies } = context();
      const timeoutMs = timeoutMsOf(options);
      await withPool(env, async (pool) => {
        const runId = await resolveRunId(pool, id);
        const found = await runsGetSummary(pool, runId);
        if (!found) throw new NotFoundError(`no run ${runId}`);
        const policy = requirePolicy(policies, found.policy);
        const tuning = loadSchedulerTuning();
        const claimed = await runsClaimById(pool, runId, cliOwner(env), tuning.runLeaseMs);
        if (!claimed) {
          const now = (await runsGetSummary(pool, runId))!;
          process.stderr.write(
            `reaper: run ${runId} is ${now.state}${now.state === 'scanning' || now.state === 'pending' ? ' and held by another process (its lease has not expired); it is being executed there' : '; nothing to execute'}\n`,
          );
          process.exitCode = 1;
          return;
        }
        await executeHere(env, pool, claimed, policy, options, timeoutMs);
      });
    });
}

/** Records a run; with --execute, records it already claimed and executes it here. */
async function startRun(
  env: Env,
  policies: PolicySet,
  pool: Pool,
  spec: { policy: string; trigger: RunTrigger; cutoff: string | null; replayOf: string | null },
  options: StartOptions,
  timeoutMs: number,
): Promise<void> {
  const label = spec.trigger === 'replay' ? 'replay run' : 'run';
  refuseOutsideWindow(requirePolicy(policies, spec.policy));
  if (!options.execute) {
    const run = await runsInsertIfAbsent(pool, { ...spec, scheduledFor: null });
    if (!run) throw new Error('a run for this instant already exists; try again');
    const warning = await noRecentScheduler(pool, run);
    if (warning) process.stderr.write(`reaper: ${warning}\n`);
    const result = options.wait ? await waitForRun(pool, run.runId, timeoutMs, !!options.json) : (await runsGetSummary(pool, run.runId))!;
    printResult(!!options.json, result, () =>
      options.wait ? describeRun(result) : `${label} ${run.runId} created (policy ${run.policy}, cutoff ${run.cutoff}); a scheduler will execute it`,
    );
    // Without --wait the command's job was to record the run: a state it reached meanwhile (a
    // scheduler may already have failed it) is shown, not turned into the exit code.
    if (options.wait && UNSUCCESSFUL_STATES.has(result.state)) process.exitCode = 1;
    return;
  }
  const policy = requirePolicy(policies, spec.policy);
  const tuning = loadSchedulerTuning();
  // Recorded and claimed in one transaction: schedulers are notified at commit, when the run
  // already has this process's lease, so none of them can start it first.
  const run = await withTransaction(pool, async (client) => {
    const inserted = await runsInsertIfAbsent(client, { ...spec, scheduledFor: null });
    if (!inserted) throw new Error('a run for this instant already exists; try again');
    return (await runsClaimById(client, inserted.runId, cliOwner(env), tuning.runLeaseMs))!;
  });
  if (!options.json) process.stderr.write(`${label} ${run.runId} created (policy ${run.policy}, cutoff ${run.cutoff}); publishing it from here\n`);
  await executeHere(env, pool, run, policy, options, timeoutMs);
}

/**
 * A manual run outside the policy's schedule window is refused, not recorded: no scheduler would
 * start it and no worker would delete for it until the window opens (README "Schedule windows").
 */
function refuseOutsideWindow(policy: Policy): void {
  const state = windowStateAt(policy.window, new Date());
  if (state.open) return;
  throw new Error(`policy ${policy.name} is ${outsideWindowMessage(policy.window!, state.opensAt)}; nothing recorded: runs start only inside the window (try again then, or change the policy's window)`);
}

/** The warning printed when no scheduler of this policy has recorded a heartbeat recently; null when one has. */
async function noRecentScheduler(pool: Pool, run: Run): Promise<string | null> {
  const latest = await heartbeatsLatestScheduler(pool, run.policy).catch(() => null); // unknown: no warning rather than a wrong one
  if (latest && latest.ageSeconds <= SCHEDULER_RECENT_SECONDS) return null;
  const seen = latest ? `no scheduler has been seen for ${formatDuration(latest.ageSeconds)} (last: ${latest.workerId} at ${latest.seenAt})` : 'no scheduler has ever been seen';
  return `${seen}; run ${run.runId} waits until one runs. To publish it from here: reaper execute ${run.runId} (or pass --execute next time)`;
}

/**
 * Executes a run this process has claimed, with the scheduler's executor and the scheduler's
 * tuning (lease, unroutable limit) and batch-version gate. SIGINT/SIGTERM stop at the next window
 * boundary and hand the run back (lease released at once); a second one exits immediately (the
 * lease then runs out and a scheduler takes the run over from its last checkpoint).
 */
async function executeHere(env: Env, pool: Pool, run: Run, policy: Policy, options: StartOptions, timeoutMs: number): Promise<void> {
  const json = !!options.json;
  const tuning = loadSchedulerTuning();
  // Logs go to stderr (stdout is the result); warnings and errors only unless LOG_LEVEL says more.
  // For a person (no --json) each log line is a line of text: JSON lines only beside a JSON result.
  const log = makeLogger({ level: process.env.LOG_LEVEL ?? 'warn', service: 'cli', workerId: cliOwner(env) }, json ? process.stderr : humanLogDestination(process.stderr));
  const names = brokerNames(env.amqpPrefix);
  const claim = runClaimOf(run, cliOwner(env));
  let stopping = false;
  const onSignal = (signal: NodeJS.Signals): void => {
    if (stopping) {
      process.stderr.write(`\nreaper: ${signal} again: exiting now; run ${run.runId} resumes from its last checkpoint once its lease expires\n`);
      process.exit(1);
    }
    stopping = true;
    process.stderr.write(`\nreaper: ${signal}: stopping at the next window boundary (again to exit at once)\n`);
  };
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  const connection = new ReconnectingConnection({
    url: env.amqpUrl,
    connectionName: `reaper-cli ${env.amqpPrefix} ${cliOwner(env)}`,
    topology: topologyFor(env, [policy.name]),
    log,
  });
  const progressLine = process.stderr.isTTY && !json ? makeProgressLine(process.stderr) : null;
  let progress: { stop(): Promise<void> } | null = null;
  try {
    let outcome: RunOutcome;
    try {
      const versions = loadBatchVersionConfig(); // refused here (REAPER_BATCH_VERSION): the run is handed back too
      let connectTimer: NodeJS.Timeout | undefined;
      const connected = await Promise.race([
        connection.start().then(() => true),
        new Promise<false>((resolve) => (connectTimer = setTimeout(() => resolve(false), BROKER_CONNECT_TIMEOUT_MS))),
      ]).finally(() => clearTimeout(connectTimer));
      if (!connected) throw new ConnectionError(`cannot connect to RabbitMQ at ${describeAmqpUrl(env.amqpUrl)} within ${BROKER_CONNECT_TIMEOUT_MS / 1000} s`);
      const target = await targetResolve(pool, policy);
      const publisher = new ConfirmingPublisher(connection);
      const gate = makeBatchVersionGate({ wanted: versions.publish, pool, connection, names, amqpPrefix: env.amqpPrefix, log });
      // The bar's total is the executor's own (bounded) count: the run is never counted twice.
      let counted: number | null = null;
      if (progressLine) progress = await startProgress(pool, run, () => counted, progressLine);
      outcome = await executeRun(
        {
          pool,
          publisher,
          names,
          owner: cliOwner(env),
          leaseMs: tuning.runLeaseMs,
          unroutableFailAfterMs: tuning.unroutableFailAfterMs,
          log,
          metrics: makeMetrics([policy]),
          stopping: () => stopping,
          batchVersion: gate.versionFor,
          onCounted: progressLine ? (total) => (counted = total) : undefined,
        },
        run,
        policy,
        target,
      );
    } catch (error) {
      // Whatever failed (the broker refused the topology, the target table is gone, the executor
      // threw), the run is handed back at once rather than left `scanning` under this process's
      // lease until it expires: a scheduler or `reaper execute` claims it. Conditional on the
      // claim, so a run the executor already ended is left as it is.
      await runsReleaseLease(pool, claim).catch(() => undefined); // database gone too: the lease expires by itself
      process.stderr.write(`reaper: run ${run.runId} was handed back (a scheduler or \`reaper execute ${run.runId}\` runs it)\n`);
      throw error; // as it is: its class sets the exit code and the message
    }
    await progress?.stop();
    if (outcome === 'stopped' || outcome === 'window-closed') await runsReleaseLease(pool, claim);
    await report(pool, run, outcome, options, timeoutMs);
  } finally {
    await progress?.stop();
    process.off('SIGINT', onSignal);
    process.off('SIGTERM', onSignal);
    await connection.close();
  }
}

/** Redraws the bar from the run's checkpoints; `total()` is the executor's count once it made it (null before). */
async function startProgress(
  pool: Pool,
  run: Run,
  total: () => number | null,
  line: ReturnType<typeof makeProgressLine>,
): Promise<{ stop(): Promise<void> }> {
  const started = Date.now();
  const from = run.candidates;
  const draw = async () => {
    const now = await runsGetSummary(pool, run.runId).catch(() => null); // next tick draws
    if (!now) return;
    // Rate and ETA from what THIS process published (a resumed run starts with earlier counts).
    const counted = total();
    const snapshot = renderProgress({ confirmed: now.candidates - from, counted: counted === null ? null : counted - from, batches: now.batchesConfirmed, elapsedMs: Date.now() - started });
    line.draw(snapshot);
  };
  let drawing = draw();
  const timer = setInterval(() => {
    drawing = drawing.then(draw);
  }, PROGRESS_POLL_MS);
  let stopped = false;
  return {
    async stop() {
      if (stopped) return;
      stopped = true;
      clearInterval(timer);
      await drawing;
      await draw(); // the last checkpoint, then the line ends
      line.done();
    },
  };
}

/** Says how the execution ended, waits with --wait, and sets the exit code. */
async function report(pool: Pool, run: Run, outcome: RunOutcome, options: StartOptions, timeoutMs: number): Promise<void> {
  const json = !!options.json;
  const summary = (await runsGetSummary(pool, run.runId))!;
  const resume = `resumable: a scheduler takes it over, or \`reaper execute ${run.runId}\``;
  const messages: Record<RunOutcome, string> = {
    published: `run ${run.runId} published: ${summary.batchesConfirmed} batches, ${summary.candidates} candidates`,
    stopped: `run ${run.runId} stopped at a window boundary after ${summary.batchesConfirmed} confirmed batches (${summary.candidates} candidates); ${resume}`,
    'lost-lease': `run ${run.runId} was taken over by another process (this one lost its lease); it continues there`,
    failed: `run ${run.runId} failed: ${summary.error ?? 'see the log'}`,
    'window-closed': `run ${run.runId} stopped at a window boundary: its policy's schedule window is closed (${summary.batchesConfirmed} confirmed batches, ${summary.candidates} candidates); it continues, with its cutoff, in the next window`,
    'awaiting-approval': `run ${run.runId} is over its policy's limits and awaits approval (${summary.error ?? ''}); nothing was published: reaper approve ${run.runId} --expect ${summary.countedCandidates ?? 0}@${summary.holdCount} or reaper reject ${run.runId}`,
  };
  const continues = outcome === 'published' || outcome === 'lost-lease';
  if (options.wait && continues) {
    if (!json) process.stderr.write(`${messages[outcome]}\n`);
    const final = await waitForRun(pool, run.runId, timeoutMs, json, true);
    printResult(json, final, () => describeRun(final));
    if (UNSUCCESSFUL_STATES.has(final.state)) process.exitCode = 1;
    return;
  }
  printResult(json, { ...summary, outcome }, () => messages[outcome]);
  if (outcome !== 'published') process.exitCode = 1;
}
