/**
 * Issue 42 item 3: the demo leaves a way in and a way out. Under names of this test's own (the
 * demo's are shared by whoever runs `npm run demo` on this machine), the demo's own steps make its
 * database, roles and policies file, the services' topology is declared as they declare it; the
 * environment the summary prints then shows every policy through `reaper status` as the demo's
 * operator role, and `cleanDemo` (`reaper demo --clean`) removes the database, the queues and
 * exchanges, the roles and the policies file, and says so; a second clean finds nothing. The
 * demo's scheduler and worker, started as the demo starts them, log in as its roles (issue 40).
 */
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, test } from 'node:test';
import amqp from 'amqplib';
import pg from 'pg';
import { assertTopology, makeTopology } from '../../shared/amqp/topology';
import { loadEnv } from '../../shared/config/env';
import { loadPolicies } from '../../shared/config/policies';
import { cleanDemo, demoDatabaseUrl, demoRoles, demoServiceEnv, prepareDemoDatabase, serviceLogins, wayInAndOut, type DemoNames } from '../../services/cli/demo';
import { startObjectStorageDemo } from '../../services/cli/demo-s3';
import { AS_DEPLOYED_ROLES_VARIABLE, SUPERUSER_REASON_VARIABLE } from '../support/as-deployed';
import { runReaperCli, startReaper } from '../support/processes';
import { findServers } from '../support/servers';
import { stampedSuffix } from '../support/sweeper';

const suffix = stampedSuffix();
const folder = mkdtempSync(path.join(tmpdir(), 'reaper-test-demo-'));
const names: DemoNames = {
  database: `reaper_test_demo_${suffix}`,
  prefix: `test-demo-${suffix}`,
  roles: { migrator: `reaper_t_migrator_${suffix}`, scheduler: `reaper_t_scheduler_${suffix}`, worker: `reaper_t_worker_${suffix}`, operator: `reaper_t_operator_${suffix}` },
  policiesFile: path.join(folder, 'reaper-demo', 'policies.yaml'),
  tableOwner: `reaper_t_owner_${suffix}`,
};
/** Every role the demo makes: the four of `reaper roles --print` and its partitioned table's owner. */
const allRoles = [...Object.values(names.roles), names.tableOwner];

after(async () => {
  await cleanDemo(await demoEnv(), names).catch(() => undefined); // a failed test's leftovers; the sweeper finds the rest
  rmSync(folder, { recursive: true, force: true });
});

async function demoEnv() {
  const servers = await findServers();
  return loadEnv({ DATABASE_URL: servers.databaseUrl, AMQP_URL: servers.amqpUrl });
}

async function brokerHas(amqpUrl: string, kind: 'queue' | 'exchange', name: string): Promise<boolean> {
  const connection = await amqp.connect(amqpUrl);
  try {
    const channel = await connection.createChannel();
    channel.on('error', () => undefined); // a 404 closes the channel: that is the answer
    return await (kind === 'queue' ? channel.checkQueue(name) : channel.checkExchange(name)).then(() => true, () => false);
  } finally {
    await connection.close().catch(() => undefined);
  }
}

test('the printed environment shows what the demo made; `reaper demo --clean` removes all of it', async () => {
  const env = await demoEnv();
  const servers = await findServers();
  const superuser = decodeURIComponent(new URL(servers.databaseUrl).username);
  const pool = await prepareDemoDatabase(env, names);
  let operatorUrl: string;
  try {
    // The third policy (media-objects, object storage) is added to the kept file as the demo adds it.
    const objects = await startObjectStorageDemo(names.policiesFile);
    assert.ok(objects, 's3rver is installed here (a development dependency)');
    try {
      const roleUrl = await demoRoles(pool, demoDatabaseUrl(env, names), names);
      operatorUrl = roleUrl('operator');
      // The scheduler and a worker started as the demo starts them (demoServiceEnv): while they run,
      // their sessions log in as the demo's roles, never as the superuser (issue 40), and the check
      // the demo prints says so.
      const base = {
        ...process.env,
        AMQP_URL: env.amqpUrl,
        REAPER_AMQP_PREFIX: names.prefix,
        REAPER_POLICIES: names.policiesFile,
        ...objects.env,
        // Not rewritten by the suite's as-deployed harness: the user is the one the demo chose.
        [SUPERUSER_REASON_VARIABLE]: 'the demo picks its services\' users itself; this test checks whom it picked',
      };
      const services = (['scheduler', 'worker'] as const).map((kind) => startReaper(`demo ${kind}`, [kind], demoServiceEnv(base, roleUrl, [kind], `demo-test-${kind}`)));
      try {
        for (const [index, kind] of (['scheduler', 'worker'] as const).entries()) await services[index]!.waitForLine(`${kind} started`, (line) => line.msg === `${kind} started`, 60_000);
        const logins = await serviceLogins(pool, names);
        assert.deepEqual({ scheduler: logins.scheduler, worker: logins.worker }, { scheduler: [names.roles.scheduler], worker: [names.roles.worker] }, logins.line);
        assert.equal(logins.ok, true);
        assert.match(logins.line, new RegExp(`log in as ${names.roles.scheduler}, the workers' as ${names.roles.worker} \\(their roles\\)$`));
      } finally {
        await Promise.all(services.map((service) => service.stop()));
      }
    } finally {
      await objects.close();
    }
  } finally {
    await pool.end();
  }
  assert.match(operatorUrl, new RegExp(`^postgres(ql)?://${names.roles.operator}@`), 'the way in logs in as the demo\'s operator role');
  // What the services declare at start (the demo's scheduler and workers), for every policy of the kept file.
  const policyNames = [...loadPolicies(names.policiesFile).keys()];
  assert.deepEqual(policyNames, ['seat-holds', 'media-assets', 'day-events', 'media-objects']);
  const topology = makeTopology({ prefix: names.prefix, policies: policyNames, deliveryLimit: env.deliveryLimit });
  const connection = await amqp.connect(env.amqpUrl);
  try {
    await assertTopology(await connection.createChannel(), topology);
  } finally {
    await connection.close();
  }

  const said = wayInAndOut(names, operatorUrl);
  const lookLine = said.find((line) => line.includes('look at it:'))!;
  const printed = /look at it:\s+(DATABASE_URL=\S+ REAPER_AMQP_PREFIX=\S+ REAPER_POLICIES=\S+) npx reaper status$/.exec(lookLine);
  assert.ok(printed, `the summary prints the environment: ${said.join('\n')}`);
  assert.ok(said.some((line) => /remove it:\s+npx reaper demo --clean/.test(line)));
  const printedEnv = Object.fromEntries(printed[1]!.split(' ').map((pair) => [pair.slice(0, pair.indexOf('=')), pair.slice(pair.indexOf('=') + 1)]));
  assert.deepEqual(printedEnv, { DATABASE_URL: operatorUrl, REAPER_AMQP_PREFIX: names.prefix, REAPER_POLICIES: names.policiesFile });
  assert.ok(existsSync(names.policiesFile), 'the policies file stays where REAPER_POLICIES points');

  // As a person would: status with exactly that environment (the URL names the operator role, so
  // the process logs in as it: processes.ts leaves a URL naming another user than the superuser).
  const status = await runReaperCli(['status', '--json'], {
    ...process.env,
    AMQP_URL: env.amqpUrl,
    ...printedEnv,
    [AS_DEPLOYED_ROLES_VARIABLE]: JSON.stringify({ superuser, roles: names.roles }),
  });
  assert.equal(status.code, 0, status.stdout);
  const shown = JSON.parse(status.stdout) as { policies: Array<{ policy: string; queued: number | null }>; brokerError: string | null };
  assert.deepEqual(shown.policies.map((row) => row.policy), policyNames, 'every policy the demo ran, media-objects and day-events too');
  assert.equal(shown.brokerError, null);
  assert.ok(shown.policies.every((row) => row.queued === 0), 'its queues are the demo prefix\'s');

  const cleaned = await cleanDemo(env, names);
  assert.deepEqual(cleaned, [
    `removed database ${names.database}`,
    `removed roles ${allRoles.join(', ')}`,
    `removed ${topology.queues.length} queue(s) and ${topology.exchanges.length} exchange(s) named ${names.prefix}.*`,
    `removed ${names.policiesFile}`,
  ]);
  const admin = new pg.Client({ connectionString: servers.databaseUrl });
  await admin.connect();
  try {
    assert.equal((await admin.query('SELECT 1 FROM pg_database WHERE datname = $1', [names.database])).rowCount, 0, 'database gone');
    assert.equal((await admin.query('SELECT 1 FROM pg_roles WHERE rolname = ANY($1::text[])', [allRoles])).rowCount, 0, 'roles gone, the table owner too');
  } finally {
    await admin.end();
  }
  for (const queue of topology.queues) assert.equal(await brokerHas(env.amqpUrl, 'queue', queue.name), false, `queue ${queue.name} gone`);
  for (const exchange of topology.exchanges) assert.equal(await brokerHas(env.amqpUrl, 'exchange', exchange.name), false, `exchange ${exchange.name} gone`);
  assert.equal(existsSync(names.policiesFile), false, 'policies file gone');
  assert.equal(existsSync(path.dirname(names.policiesFile)), false, 'and its folder');

  assert.deepEqual(await cleanDemo(env, names), [
    `no database ${names.database}`,
    `no roles ${allRoles.join(', ')}`,
    `removed 0 queue(s) and 0 exchange(s) named ${names.prefix}.*`,
  ], 'a second clean finds nothing and fails on nothing');
});
