/**
 * reaper under its least-privilege RabbitMQ users (shared/amqp/permissions.ts, the permissions in
 * infra/rabbitmq/definitions.json; issue 11). In a scratch vhost of the running broker, one user
 * per service is created (test/support/broker-admin.ts) with exactly the configure/write/read
 * patterns of its role; a scheduler and a worker then run a row-delete and a remote-delete policy under them, and
 * `reaper status` counts the queues as the operator user. The worker user cannot declare or delete
 * a queue outside the prefix; the autoscaler user can read a work queue's depth and nothing more.
 * Vhost and users are removed in `after`.
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import amqp from 'amqplib';
import { brokerPermissions, brokerUserName, type BrokerRole } from '../../shared/amqp/permissions';
import { eventually } from '../support/eventually';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { assetStatuses, errorsLogged, mediaPolicyYaml, seedAssets, started, startSchedulerProcess, startWorkerProcess, stopStarted } from '../support/remote-helpers';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { brokerAnswerAt } from '../support/broker';
import { allOrFirstFailure, brokerAdmin } from '../support/broker-admin';

const vhost = `reaper-test-${randomBytes(4).toString('hex')}`;
const ROLES: BrokerRole[] = ['scheduler', 'worker', 'operator', 'autoscaler'];
const passwords = new Map(ROLES.map((role) => [role, randomBytes(12).toString('hex')]));
const created: string[] = [];
let vhostCreated = false;

let bed: TestBed;
let api: MediaApi;

function user(role: BrokerRole): string {
  return brokerUserName(bed.prefix, role);
}

function amqpUrlAs(role: BrokerRole): string {
  const url = new URL(bed.amqpUrl);
  url.username = user(role);
  url.password = passwords.get(role)!;
  url.pathname = `/${encodeURIComponent(vhost)}`;
  return url.toString();
}

/** What the broker answers when a channel operation is refused (the channel closes with it). */
async function brokerAnswer(role: BrokerRole, work: (channel: amqp.Channel) => Promise<unknown>): Promise<string> {
  return brokerAnswerAt(amqpUrlAs(role), work);
}

before(async () => {
  bed = await makeTestBed('least_privilege_broker');
  api = await startMediaApi({});
  const admin = await brokerAdmin();
  // Once per hook, here and in `after`: a serial file (broker-restart) may have restarted the broker
  // just before. (Serial files run alone, after this group: the broker stays up within a hook.)
  await admin.awaitRunning();
  vhostCreated = true; // before: `after` deletes it even when its making failed half-way
  await admin.addVhost(vhost);
  const permissions = brokerPermissions(bed.prefix);
  // The users side by side (where rabbitmqctl makes them, each call starts an Erlang node: ~2 s on a
  // loaded machine). All settled before a failure is thrown, so `after` sees every user that was made.
  await allOrFirstFailure(
    ROLES.map(async (role) => {
      await admin.addUser(user(role), passwords.get(role)!);
      created.push(user(role));
      await admin.setPermissions(vhost, user(role), permissions[role]);
    }),
  );
  bed.writePolicies(
    combinedPoliciesYaml(
      rowDeletePolicyYaml({ batchSize: 20 }),
      mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 500, burst: 50, concurrency: 8, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 }),
    ),
  );
});

after(async () => {
  const failures: unknown[] = [];
  // Every step runs whatever an earlier one did: a leftover vhost, user or server would outlive the file.
  for (const step of [
    () => stopStarted(),
    () => assertNoLeakedProcesses(),
    async () => (await brokerAdmin()).awaitRunning(),
    ...(vhostCreated ? [async () => (await brokerAdmin()).deleteVhost(vhost)] : []),
    async () => {
      const admin = await brokerAdmin();
      await allOrFirstFailure(created.map((name) => admin.deleteUser(name)));
    },
    () => api?.close(),
    () => bed?.close(),
  ]) {
    try {
      await step();
    } catch (error) {
      failures.push(error);
    }
  }
  if (failures.length > 0) throw failures[0];
});

test('a scheduler and a worker run both policy kinds as their own prefix-limited users; the operator reads the status', async () => {
  const holds = await seedHolds(bed.pool, { expiredHeld: 25 });
  const assets = await seedAssets(bed.pool, 'lpb', 8);
  const scheduler = startSchedulerProcess(bed, 'lpb-scheduler', { AMQP_URL: amqpUrlAs('scheduler') });
  const worker = startWorkerProcess(bed, 'lpb-worker', { AMQP_URL: amqpUrlAs('worker') });
  await Promise.all([started(scheduler, 'scheduler'), started(worker, 'worker')]);

  const operator = bed.processEnv({ AMQP_URL: amqpUrlAs('operator') });
  const rows = await runReaperCli(['trigger', 'seat-holds', '--wait', '--timeout', '60', '--json'], operator);
  assert.equal(rows.code, 0, rows.stdout);
  assert.equal(await countReservations(bed.pool, holds.expiredHeld), 0, 'every expired hold deleted');
  const remote = await runReaperCli(['trigger', 'media-assets', '--wait', '--timeout', '60', '--json'], operator);
  assert.equal(remote.code, 0, remote.stdout);
  await eventually('every asset marked deleted', async () => {
    const statuses = await assetStatuses(bed.pool, assets);
    return [...statuses.values()].every((status) => status === 'deleted') ? statuses : undefined;
  }, { timeoutMs: 30_000 });

  const status = await runReaperCli(['status', '--json'], operator);
  assert.equal(status.code, 0, status.stdout);
  const parsed = JSON.parse(status.stdout) as { policies: Array<{ policy: string; queued: number | null }>; deadLetters: number | null; delayed: number | null; brokerError: string | null };
  assert.equal(parsed.brokerError, null, 'the operator user reaches the broker');
  assert.ok(parsed.policies.every((policy) => policy.queued === 0), `work queues counted: ${status.stdout}`);
  assert.equal(parsed.deadLetters, 0, 'dead-letter queue counted');
  assert.equal(parsed.delayed, 0, 'delay tiers counted');

  assert.deepEqual(errorsLogged([scheduler, worker]), [], 'nothing was refused');
  assert.equal((await scheduler.stop()).code, 0);
  assert.equal((await worker.stop()).code, 0);
});

test('the worker user cannot declare or delete queues outside its prefix; the autoscaler user only reads depths', async () => {
  assert.equal(await brokerAnswer('worker', (channel) => channel.assertQueue('other.queue', { durable: false })), 'ACCESS_REFUSED', 'declare another queue');
  assert.equal(await brokerAnswer('worker', (channel) => channel.assertQueue(`${bed.prefix}x.cleanup.y`, { durable: false })), 'ACCESS_REFUSED', 'a prefix that merely starts the same');
  assert.equal(await brokerAnswer('worker', (channel) => channel.deleteExchange('amq.direct')), 'ACCESS_REFUSED', 'delete a broker exchange');
  // A refused publish closes the channel; the next call on it reports why.
  assert.equal(
    await brokerAnswer('worker', async (channel) => {
      channel.publish('amq.topic', 'x', Buffer.from('x'));
      await channel.checkQueue(`${bed.prefix}.dead-letter`);
    }),
    'ACCESS_REFUSED',
    'publish outside the prefix',
  );
  const workQueue = `${bed.prefix}.cleanup.seat-holds`;
  assert.equal(await brokerAnswer('autoscaler', (channel) => channel.checkQueue(workQueue)), 'ok', 'KEDA reads the depth (passive declare)');
  assert.equal(await brokerAnswer('autoscaler', (channel) => channel.purgeQueue(workQueue)), 'ACCESS_REFUSED', 'but cannot purge (no read)');
  assert.equal(await brokerAnswer('autoscaler', (channel) => channel.assertQueue(`${bed.prefix}.cleanup.new`)), 'ACCESS_REFUSED', 'nor declare');
});
