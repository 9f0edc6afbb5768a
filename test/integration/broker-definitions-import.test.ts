/**
 * infra/rabbitmq/definitions.json imports, and its configure permissions keep each service to what
 * it declares (issue 20 item 6). Into a scratch vhost of the running broker, `rabbitmqctl
 * import_definitions` loads one document: a users file made as a deployment makes it (salted
 * SHA-256 hashes of the passwords in its AMQP URLs, docs/deploying.md "Deploying") plus the shipped topology
 * and permissions, with the vhost and user names made unique. Then, logged in as each service: the
 * topology each asserts at start is allowed, the worker's presence queue too, and the scheduler
 * can neither declare nor delete a presence queue (ACCESS_REFUSED). Vhost and users go in `after`.
 */
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { chmodSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import amqp from 'amqplib';
import { brokerNames, makeTopology, assertTopology } from '../../shared/amqp/topology';
import { findServers } from '../support/servers';
import { brokerAnswerAt } from '../support/broker';
import { brokerAdmin } from '../support/broker-admin';

const run = promisify(execFile);
// The import stays rabbitmqctl: it is the deployment's way in (docs/deploying.md) that this file proves.
const rabbitmqctl = async (...args: string[]) => {
  await run('rabbitmqctl', ['-q', 'await_startup', '--timeout', '120'], { timeout: 130_000 });
  return run('rabbitmqctl', ['-q', ...args], { timeout: 60_000 });
};

const ROOT = path.resolve(__dirname, '..', '..', '..');
const DEFINITIONS = path.join(ROOT, 'infra', 'rabbitmq', 'definitions.json');
const PREFIX = 'reaper'; // what definitions.json was made for
const suffix = randomBytes(4).toString('hex');
const vhost = `reaper-import-${suffix}`;
const ROLES = ['scheduler', 'worker'] as const;
type Role = (typeof ROLES)[number];
const userOf = (role: Role) => `${PREFIX}-${role}-${suffix}`;
const passwords = new Map(ROLES.map((role) => [role, randomBytes(12).toString('hex')]));

/** RabbitMQ's rabbit_password_hashing_sha256: base64(salt(4) ++ sha256(salt ++ password)). */
function passwordHash(password: string): string {
  const salt = randomBytes(4);
  return Buffer.concat([salt, createHash('sha256').update(Buffer.concat([salt, Buffer.from(password, 'utf8')])).digest()]).toString('base64');
}

after(async () => {
  const admin = await brokerAdmin();
  await admin.deleteVhost(vhost).catch(() => undefined);
  for (const role of ROLES) await admin.deleteUser(userOf(role)).catch(() => undefined);
});

async function answer(role: Role, work: (channel: amqp.Channel) => Promise<unknown>): Promise<string> {
  const { amqpUrl } = await findServers();
  const url = new URL(amqpUrl);
  url.username = userOf(role);
  url.password = passwords.get(role)!;
  url.pathname = `/${encodeURIComponent(vhost)}`;
  return brokerAnswerAt(url.toString(), work);
}

test('definitions.json imports with its users; the scheduler cannot declare or delete the worker presence queues', { timeout: 240_000 }, async () => {
  const shipped = JSON.parse(readFileSync(DEFINITIONS, 'utf8')) as {
    permissions: Array<{ user: string; vhost: string }>;
    queues: Array<{ vhost: string }>;
    exchanges: Array<{ vhost: string }>;
    bindings: Array<{ vhost: string }>;
  };
  const inScratch = <T extends { vhost: string }>(items: T[]) => items.map((item) => ({ ...item, vhost }));
  const document = {
    users: ROLES.map((role) => ({ name: userOf(role), password_hash: passwordHash(passwords.get(role)!), hashing_algorithm: 'rabbit_password_hashing_sha256', tags: [] })),
    vhosts: [{ name: vhost }],
    permissions: ROLES.map((role) => {
      const permission = shipped.permissions.find((p) => p.user === `${PREFIX}-${role}`);
      assert.ok(permission, `definitions.json grants ${PREFIX}-${role}`);
      return { ...permission, user: userOf(role), vhost };
    }),
    queues: inScratch(shipped.queues),
    exchanges: inScratch(shipped.exchanges),
    bindings: inScratch(shipped.bindings),
  };
  // rabbitmqctl may run as the rabbitmq user: the scratch folder and file must be readable by it.
  const scratch = mkdtempSync(path.join(tmpdir(), 'reaper-definitions-'));
  try {
    chmodSync(scratch, 0o755);
    const file = path.join(scratch, 'definitions.json');
    writeFileSync(file, JSON.stringify(document), { mode: 0o644 });
    await rabbitmqctl('import_definitions', file);
  } finally {
    rmSync(scratch, { recursive: true, force: true });
  }

  const names = brokerNames(PREFIX);
  const topology = makeTopology({ prefix: PREFIX, policies: ['seat-holds', 'media-assets'], deliveryLimit: 20 });
  const presence = names.presenceQueue('seat-holds', `w-${suffix}`);
  const presenceOptions = { durable: false, autoDelete: true, arguments: { 'x-queue-type': 'classic' } };

  // What each asserts at start-up is allowed (the imported queues have the same arguments).
  assert.equal(await answer('scheduler', (channel) => assertTopology(channel, topology)), 'ok', 'the scheduler asserts the topology');
  assert.equal(await answer('worker', (channel) => assertTopology(channel, topology)), 'ok', 'the worker asserts the topology');
  assert.equal(await answer('worker', (channel) => channel.assertQueue(presence, presenceOptions)), 'ok', 'the worker declares its presence queue');
  // The scheduler reads a presence queue's consumers with a passive declare: no permission needed.
  assert.equal(await answer('scheduler', (channel) => channel.checkQueue(presence)), 'ok', 'the scheduler counts presence consumers');

  // The scheduler's login cannot touch the worker's queues.
  assert.equal(await answer('scheduler', (channel) => channel.deleteQueue(presence)), 'ACCESS_REFUSED', 'the scheduler cannot delete a presence queue');
  assert.equal(await answer('scheduler', (channel) => channel.assertQueue(names.presenceQueue('seat-holds', 'forged'), presenceOptions)), 'ACCESS_REFUSED', 'nor declare one');
  // Neither reaches outside the prefix.
  for (const role of ROLES) assert.equal(await answer(role, (channel) => channel.assertQueue(`other-${suffix}`)), 'ACCESS_REFUSED', `${role}: nothing outside the prefix`);
  assert.equal(await answer('worker', (channel) => channel.checkQueue(presence)), 'ok', 'the presence queue is still there');
});
