import path from 'node:path';
import { Command, Option } from 'commander';
import { loadEnv } from '../../shared/config/env';
import { stringify as toYaml } from 'yaml';
import { kedaTriggersPatch, topologyFor, topologyAsDefinitions } from '../../shared/amqp/topology';
import { migrate } from '../../shared/db/migrate';
import { demoTablesCreate } from '../../shared/db/queries/demo-tables';
import { liveViewsCreate } from '../../shared/db/queries/live-views';
import { DEFAULT_DB_ROLE_NAMES } from '../../shared/db/queries/roles';
import { loadPolicies, loadPolicyNames } from '../../shared/config/policies';
import { makeLogger } from '../../shared/observability/logger';
import { startRelay } from '../relay/relay';
import { refuseTestOnlyVariables } from '../../shared/observability/failpoint-hook';
import { testTimings } from '../../shared/config/test-timings';
import { startScheduler } from '../scheduler/scheduler';
import { startWorker } from '../worker/worker';
import { context, UsageError, withPool } from './common';
import { roleList } from './sql';
import { explainDatabaseError } from './connections';
import { printResult } from './output';

/** `reaper migrate`, `scheduler`, `worker`, `topology` and `demo`: running and setting up reaper itself. */

/**
 * Runs a service in the foreground until SIGTERM/SIGINT, then drains and exits 0. A service
 * started with an IPC channel (`reaper demo` starts its services so) drains the same way when the
 * channel closes: its parent is gone, even by SIGKILL, and nobody else would ever stop it (a
 * demo killed abruptly left its scheduler claiming runs in the demo database until killed by hand).
 */
async function runService(kind: 'scheduler' | 'worker' | 'relay'): Promise<void> {
  refuseTestOnlyVariables();
  testTimings(); // validated at start, not at the first wait that reads them
  const { env, policies } = context();
  const log = makeLogger({ level: env.logLevel, service: kind, workerId: env.workerId });
  const start = { scheduler: startScheduler, worker: startWorker, relay: startRelay }[kind];
  const handle = await start(env, policies, log);
  log.info({ httpPort: handle.httpPort, policies: [...policies.keys()] }, `${kind} started`);
  await new Promise<void>((resolve) => {
    const shutdown = (signal: string) => {
      log.info({ signal }, `${kind} draining`);
      resolve();
    };
    process.once('SIGTERM', () => shutdown('SIGTERM'));
    process.once('SIGINT', () => shutdown('SIGINT'));
    if (process.channel) process.once('disconnect', () => shutdown('parent gone'));
  });
  await handle.stop();
  log.info(`${kind} stopped`);
}

/** Registers the commands that run or set up the services. */
export function registerServiceCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('migrate')
    .description('apply database migrations (safe to run from several processes at once), then grant reaper\'s tables to the service roles')
    .option('--with-demo-tables', "also create the demo's own tables seat_reservations and media_assets if missing (local stack, demo)")
    .option('--views', "also create (or replace) each policy table's live view <table>_live (reaper sql live-view), owned by this role")
    .option('--grant-to <roles>', 'with --views: comma-separated roles that get SELECT on the live views', roleList, [] as string[])
    .option('--scheduler <role>', 'role granted the scheduler\'s privileges on reaper\'s tables (if it exists)', DEFAULT_DB_ROLE_NAMES.scheduler)
    .option('--worker <role>', 'role granted the workers\' privileges on reaper\'s tables (if it exists)', DEFAULT_DB_ROLE_NAMES.worker)
    .option('--operator <role>', 'role granted the operator\'s privileges on reaper\'s tables (if it exists)', DEFAULT_DB_ROLE_NAMES.operator)
    .addOption(json())
    .action(async (options: { json?: boolean; withDemoTables?: boolean; views?: boolean; grantTo: string[]; scheduler: string; worker: string; operator: string }) => {
      const env = loadEnv();
      if (options.grantTo.length > 0 && !options.views) throw new UsageError('--grant-to: only with --views');
      // Policies only when views are asked for: a migrate Job without them still migrates.
      const policies = options.views ? loadPolicies(env.policiesPath) : undefined;
      // Progress on stderr as each file starts (not with --json, whose reader wants one document):
      // a long migration is visibly running, and the last line names the file that failed.
      const announce = options.json ? undefined : (name: string) => process.stderr.write(`applying ${name} ...\n`);
      const grantTo = { scheduler: options.scheduler, worker: options.worker, operator: options.operator };
      const migrated = await migrate(env.databaseUrl, { onApplying: announce, grantTo }).catch((error: unknown) => {
        throw explainDatabaseError(env.databaseUrl, error);
      });
      // Production databases never get them: they are the demo policies' targets, not reaper's.
      if (options.withDemoTables) await withPool(env, (pool) => demoTablesCreate(pool));
      const views = policies ? await withPool(env, (pool) => liveViewsCreate(pool, policies, options.grantTo)) : [];
      const result = { ...migrated, views };
      printResult(!!options.json, result, () =>
        [
          result.applied.length ? `applied ${result.applied.join(', ')}; schema version ${result.current}` : `up to date (version ${result.current})`,
          result.granted.roles.length ? `granted ${result.granted.tables.length} tables to ${result.granted.roles.join(', ')}` : 'no service roles exist: nothing granted',
          ...(views.length ? [`live views: ${views.join(', ')}${options.grantTo.length ? ` (SELECT to ${options.grantTo.join(', ')})` : ''}`] : []),
        ].join('\n'),
      );
    });

  program.command('scheduler').description('run the scheduler in the foreground').action(() => runService('scheduler'));
  program.command('worker').description('run a worker in the foreground').action(() => runService('worker'));
  program
    .command('relay')
    .description('publish expiry events from the outbox to <prefix>.events in the foreground (several may run)')
    .action(() => runService('relay'));

  program
    .command('topology')
    .description('print the broker topology (exchanges, queues, bindings) the services assert')
    .option('--definitions', "print it as a RabbitMQ definitions file (JSON) to pre-declare it, with each service user's permissions for REAPER_AMQP_PREFIX")
    .option('--keda-triggers', "print the workers' KEDA ScaledObject triggers, one per policy's work queue, as a kustomize patch (YAML; --json: the triggers)")
    .addOption(json())
    .action((options: { json?: boolean; definitions?: boolean; kedaTriggers?: boolean }) => {
      // Names only: the policies' variables and secret files need not exist where this runs.
      const env = loadEnv();
      const policies = loadPolicyNames(env.policiesPath);
      const topology = topologyFor(env, policies);
      if (options.definitions) return printResult(true, topologyAsDefinitions(topology, env.amqpPrefix), () => '');
      if (options.kedaTriggers) {
        const patch = kedaTriggersPatch(env, policies);
        return printResult(!!options.json, patch.spec.triggers, () =>
          [
            `# GENERATED by \`reaper topology --keda-triggers\` from ${path.basename(env.policiesPath)} (REAPER_AMQP_PREFIX=${env.amqpPrefix}):`,
            '# one trigger per policy. Regenerate it whenever the policies change.',
            toYaml(patch).trimEnd(),
          ].join('\n'),
        );
      }
      printResult(!!options.json, topology, () =>
        [
          ...topology.exchanges.map((e) => `exchange ${e.name} (${e.type})`),
          ...topology.queues.map((q) => `queue    ${q.name} ${JSON.stringify(q.options.arguments ?? {})}`),
          ...topology.bindings.map((b) => `binding  ${b.exchange} -> ${b.queue}${b.routingKey ? ` key ${b.routingKey}` : ''}${b.args ? ` ${JSON.stringify(b.args)}` : ''}`),
        ].join('\n'),
      );
    });

  program
    .command('demo')
    .description('run the demo end to end in the reaper_demo database (npm run demo); what it made stays until --clean')
    .option('--clean', "remove what the demo made: its database, its queues and exchanges (reaper-demo.*), its reaper_demo_* roles and its policies file")
    .action(async (options: { clean?: boolean }) => {
      // Loaded on demand: the demo brings the stand-in media API, which the runtime image need not carry.
      const { cleanDemo, runDemo } = require('./demo') as typeof import('./demo');
      if (options.clean) await cleanDemo(loadEnv());
      else process.exitCode = await runDemo();
    });
}
