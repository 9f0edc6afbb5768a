import { randomBytes } from 'node:crypto';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { parse as parseYaml } from 'yaml';
import { makeTopology } from '../../shared/amqp/topology';
import { loadEnv, type Env } from '../../shared/config/env';
import { parsePolicies } from '../../shared/config/policies';
import { rolesSql, type DbRoleNames } from '../../shared/db/queries/roles';
import { AS_DEPLOYED_ROLES_VARIABLE, SUPERUSER_REASON_VARIABLE, type AsDeployedRoles } from './as-deployed';
import { deleteBrokerNames, listBrokerObjects, namesUnder } from './broker';
import { findServers } from './servers';
import { stampedSuffix } from './sweeper';
import { migrateForTests, TEMPLATE_DATABASE_VARIABLE } from './template-database';


/** The test bed pool's application_name: reaper's prefix, so the adaptive admission does not count the test as an application. */
export const TEST_BED_APPLICATION = 'reaper-test-bed';
/**
 * One test file's private world: its own database (migrated), its own broker name prefix and a
 * temp folder for its policies file. `close()` drops the database and deletes every queue and
 * exchange under the prefix, so files run in parallel and leave nothing behind. The names end in
 * a stamped suffix (creation time, then random): after a killed file, the next run's sweeper
 * (test/support/sweeper.ts) knows they are an hour old.
 */
export interface TestBed {
  databaseUrl: string;
  amqpUrl: string;
  prefix: string;
  pool: pg.Pool;
  /** Writes a policies file (YAML text) and returns its path. Its policy names are cleaned up on close. */
  writePolicies(yaml: string): string;
  /** Environment for a reaper process or for loadEnv(), with overrides. */
  processEnv(overrides?: Record<string, string>): NodeJS.ProcessEnv;
  env(overrides?: Record<string, string>): Env;
  /** The printed roles this bed's processes log in as; null for a bed made with superuserBecause. */
  roles: DbRoleNames | null;
  /**
   * `env` for a service run in process, as deployed: its database URL logs in as the role (an URL
   * naming another user than the bed's superuser is left alone, as startReaper does).
   */
  as(env: Env, role: 'scheduler' | 'worker'): Env;
  close(): Promise<void>;
}

/** The demo policies: what a process started without REAPER_POLICIES declares queues for. */
const DEMO_POLICIES = path.resolve(__dirname, '..', '..', '..', 'infra', 'policies.demo.yaml');

export interface TestBedOptions {
  /** Replaces the migration (tests of the test bed itself make it fail). */
  migrate?: (databaseUrl: string) => Promise<unknown>;
  /** Replaces the broker URL used by close() (tests of the test bed itself make it unreachable). */
  cleanupAmqpUrl?: string;
  /** Makes the database on this PostgreSQL instead of the shared one (a test's own cluster: test/support/private-postgres.ts). */
  adminDatabaseUrl?: string;
  /**
   * Issue 40, "test as deployed" (the default): the roles `reaper roles --print` makes are created
   * for this bed (names ending in its suffix, dropped by close()) and re-applied for every policies
   * file written; reaper processes this bed's environment starts (startReaper, runReaperCli) log in
   * as the role of their command (scheduler, worker, relay: scheduler, CLI: operator, migrate:
   * migrator). One process that must be the superuser says why in its environment
   * (REAPER_TEST_SUPERUSER_BECAUSE); a whole file, here (its processes then all log in as the
   * superuser, and the reason is in their environment).
   */
  superuserBecause?: string;
}

export async function makeTestBed(label: string, options: TestBedOptions = {}): Promise<TestBed> {
  const servers = await findServers();
  const adminDatabaseUrl = options.adminDatabaseUrl ?? servers.databaseUrl;
  const suffix = stampedSuffix();
  const safeLabel = label.replace(/[^a-z0-9]/gi, '_').toLowerCase();
  const database = `reaper_test_${safeLabel}_${suffix}`;
  const prefix = `test-${safeLabel.replace(/_/g, '-')}-${suffix}`;
  const dropDatabase = async () => {
    const admin = new pg.Client({ connectionString: adminDatabaseUrl });
    await admin.connect();
    try {
      await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(database)} WITH (FORCE)`);
    } finally {
      await admin.end();
    }
  };
  // The run's migrated template (template-database.ts), when there is one and this bed wants the
  // usual migrations on the usual server: a copy of it is what migrating would make.
  const template = options.migrate === undefined && options.adminDatabaseUrl === undefined ? process.env[TEMPLATE_DATABASE_VARIABLE] : undefined;
  const admin = new pg.Client({ connectionString: adminDatabaseUrl });
  await admin.connect();
  try {
    await admin.query(`CREATE DATABASE ${pg.escapeIdentifier(database)}${template ? ` TEMPLATE ${pg.escapeIdentifier(template)}` : ''}`);
  } finally {
    await admin.end();
  }
  const url = new URL(adminDatabaseUrl);
  url.pathname = `/${database}`;
  const databaseUrl = url.toString();
  try {
    if (!template) await migrateForTests(databaseUrl, options.migrate);
  } catch (error) {
    // A failed migration must not leave a half-made database behind for every later run to find.
    await dropDatabase();
    throw error;
  }
  // Named as reaper's own: the adaptive admission leaves "reaper"-named sessions out of what it sees
  // of the others (shared/db/queries/admission.ts OTHER_CLIENTS). The test's set-up, its polls and its
  // checks are not an application: counted as one (a statement within the last second at every
  // sample), they held every worker in every test beside a quiet application, at its shared ceiling
  // and never alone. A test that wants an application makes one (a pool of another name).
  const pool = new pg.Pool({ connectionString: databaseUrl, max: 4, application_name: TEST_BED_APPLICATION });
  const folder = mkdtempSync(path.join(tmpdir(), `reaper-test-${safeLabel}-`));
  const roles: DbRoleNames | null = options.superuserBecause === undefined
    ? { migrator: `reaper_t_migrator_${suffix}`, scheduler: `reaper_t_scheduler_${suffix}`, worker: `reaper_t_worker_${suffix}`, operator: `reaper_t_operator_${suffix}` }
    : null;
  /** The printed roles for a policies file, applied to this bed's database (synchronously: writePolicies is). */
  const applyRoles = (file: string, strict = false) => {
    if (!roles) return;
    let sql: string;
    try {
      sql = rolesSql(parsePolicies(readFileSync(file, 'utf8'), file, process.env), roles);
    } catch (error) {
      if (strict) throw error;
      return; // a policies file broken on purpose: the processes refuse it before touching the database
    }
    try {
      execFileSync('psql', ['-X', '-q', '-v', 'ON_ERROR_STOP=1', databaseUrl], { input: sql, stdio: ['pipe', 'ignore', 'pipe'] });
    } catch (error) {
      if (strict) throw error;
      // A policy naming a table that does not exist (on purpose: a start-up error under test): the
      // grants stay as they were, and the processes meet the missing table first.
      process.stderr.write(`# test bed: the printed roles were not applied for ${path.basename(file)}: ${String((error as { stderr?: Buffer }).stderr ?? (error as Error).message).trim()}\n`);
    }
  };
  const dropRoles = async () => {
    if (!roles) return;
    const admin = new pg.Client({ connectionString: adminDatabaseUrl });
    await admin.connect();
    try {
      for (const role of Object.values(roles)) await admin.query(`DROP ROLE IF EXISTS ${pg.escapeIdentifier(role)}`);
    } finally {
      await admin.end();
    }
  };
  // The default policies are the demo's, without its blast-radius `limits`: tests seed mostly
  // expired tables on purpose; the brake has its own tests (guardrails-brake.test.ts).
  let policiesPath = path.join(folder, 'policies-demo-unbraked.yaml');
  writeFileSync(policiesPath, readFileSync(DEMO_POLICIES, 'utf8').replace(/^\s*limits:.*\n/gm, ''));
  try {
    applyRoles(policiesPath, true);
  } catch (error) {
    // Nothing half-made is left behind: not the database, not a role.
    await pool.end().catch(() => undefined);
    await dropDatabase().catch(() => undefined);
    await dropRoles().catch(() => undefined);
    rmSync(folder, { recursive: true, force: true });
    throw error;
  }
  // What close() deletes on the broker: every prefix a process of this file was given, and every
  // policy name of every policies file written (plus the demo's, the default file).
  const prefixes = new Set([prefix]);
  const policyNames = new Set(policyNamesIn(readFileSync(DEMO_POLICIES, 'utf8')));

  const processEnv = (overrides: Record<string, string> = {}): NodeJS.ProcessEnv => {
    if (overrides.REAPER_AMQP_PREFIX) prefixes.add(overrides.REAPER_AMQP_PREFIX);
    return {
      PATH: process.env.PATH,
      HOME: process.env.HOME,
      DATABASE_URL: databaseUrl,
      AMQP_URL: servers.amqpUrl,
      REAPER_AMQP_PREFIX: prefix,
      LOG_LEVEL: process.env.TEST_LOG_LEVEL ?? 'info',
      ...(policiesPath ? { REAPER_POLICIES: policiesPath } : {}),
      ...(roles
        ? { [AS_DEPLOYED_ROLES_VARIABLE]: JSON.stringify({ superuser: decodeURIComponent(url.username), roles } satisfies AsDeployedRoles) }
        : { [SUPERUSER_REASON_VARIABLE]: options.superuserBecause! }),
      ...overrides,
    };
  };

  let closed = false;
  return {
    databaseUrl,
    amqpUrl: servers.amqpUrl,
    prefix,
    pool,
    writePolicies(yaml) {
      for (const name of policyNamesIn(yaml)) policyNames.add(name);
      policiesPath = path.join(folder, `policies-${randomBytes(3).toString('hex')}.yaml`);
      writeFileSync(policiesPath, yaml);
      applyRoles(policiesPath);
      return policiesPath;
    },
    processEnv,
    env: (overrides) => loadEnv(processEnv(overrides)),
    roles,
    as(env, role) {
      if (!roles) return env;
      const given = new URL(env.databaseUrl);
      if (decodeURIComponent(given.username) !== decodeURIComponent(url.username)) return env;
      given.username = roles[role];
      given.password = '';
      return { ...env, databaseUrl: given.toString() };
    },
    async close() {
      if (closed) return;
      closed = true;
      // Every step runs whatever the others did; the first failure is reported at the end. The
      // database is dropped even when the broker is unreachable (WITH (FORCE) also ends the
      // connections a killed test left open).
      const failures: unknown[] = [];
      const step = async (what: () => Promise<unknown> | unknown) => {
        try {
          await what();
        } catch (error) {
          failures.push(error);
        }
      };
      await step(() => pool.end());
      await step(() => deleteBrokerObjects(options.cleanupAmqpUrl ?? servers.amqpUrl, [...prefixes], [...policyNames]));
      await step(dropDatabase);
      await step(dropRoles); // after the database: the grants and ownerships went with it
      await step(() => rmSync(folder, { recursive: true, force: true }));
      if (failures.length > 0) throw failures[0];
    },
  };
}

function policyNamesIn(yaml: string): string[] {
  try {
    const parsed = parseYaml(yaml) as { policies?: Array<{ name?: unknown }> } | null;
    return (parsed?.policies ?? []).map((policy) => policy?.name).filter((name): name is string => typeof name === 'string');
  } catch {
    return []; // a test writing a broken file on purpose: no queues were declared from it
  }
}

/**
 * Deletes, over AMQP, every queue and exchange under these prefixes: what reaper's topology
 * declares for them and these policies (work and delay exchanges, work queues, delay tiers, the
 * dead-letter queue), and whatever else the broker lists under them (a test's own probe queues,
 * a policy of a file written outside writePolicies). Listing needs the management API or a local
 * `rabbitmqctl`; without either (a remote broker), the topology's names are still deleted.
 * Deleting a queue or exchange that was never declared is not an error in RabbitMQ.
 */
export async function deleteBrokerObjects(amqpUrl: string, prefixes: readonly string[], policies: readonly string[]): Promise<void> {
  const declared = prefixes.map((prefix) => brokerObjectNames(prefix, policies));
  const listed = namesUnder((await listBrokerObjects(amqpUrl)) ?? { queues: [], exchanges: [] }, prefixes);
  await deleteBrokerNames(amqpUrl, {
    queues: [...new Set([...declared.flatMap((names) => names.queues), ...listed.queues])],
    exchanges: [...new Set([...declared.flatMap((names) => names.exchanges), ...listed.exchanges])],
  });
}

/** The names close() deletes for a prefix and policies (the test bed's own test checks they are gone). */
export function brokerObjectNames(prefix: string, policies: readonly string[]): { queues: string[]; exchanges: string[] } {
  const topology = makeTopology({ prefix, policies, deliveryLimit: 1 });
  return { queues: topology.queues.map((q) => q.name), exchanges: topology.exchanges.map((e) => e.name) };
}
