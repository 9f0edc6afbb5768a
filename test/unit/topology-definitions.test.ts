/**
 * `reaper topology --definitions` (issue 42 item 5): the RabbitMQ definitions file for the
 * configured prefix, with each service user's permissions derived from that prefix, so an operator
 * with a prefix other than `reaper` writes no regular expression by hand. For the prefix `reaper`
 * and the demo policies it is byte for byte the shipped infra/rabbitmq/definitions.json's content.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { makeTopology, topologyAsDefinitions } from '../../shared/amqp/topology';
import { BROKER_ROLES, brokerPermissions } from '../../shared/amqp/permissions';
import { DEFINITIONS_FILE, DEFINITIONS_PREFIX, DEMO_POLICY_NAMES, ROOT } from '../support/deployment-files';

const CLI = path.join(ROOT, 'dist', 'services', 'cli', 'main.js');
const DEMO_POLICIES = path.join(ROOT, 'infra', 'policies.demo.yaml');

type Permission = { user: string; vhost: string; configure: string; write: string; read: string };
type Definitions = { permissions: Permission[]; queues: { name: string }[]; exchanges: { name: string }[] };

function definitionsFromCli(prefix: string): Definitions {
  const output = execFileSync(process.execPath, [CLI, 'topology', '--definitions'], {
    encoding: 'utf8',
    env: { PATH: process.env.PATH ?? '', REAPER_POLICIES: DEMO_POLICIES, REAPER_AMQP_PREFIX: prefix },
  });
  return JSON.parse(output) as Definitions;
}

test('topology --definitions: one permission per service user of the prefix, from shared/amqp/permissions.ts', () => {
  const definitions = definitionsFromCli('acme-prod');
  const expected = brokerPermissions('acme-prod');
  assert.deepEqual(
    definitions.permissions,
    BROKER_ROLES.map((role) => ({ user: `acme-prod-${role}`, vhost: '/', ...expected[role] })),
  );
});

test('topology --definitions: the permissions cover what each service declares, and nothing of another prefix', () => {
  const prefix = 'acme-prod';
  const definitions = definitionsFromCli(prefix);
  const permission = (role: string) => definitions.permissions.find((p) => p.user === `${prefix}-${role}`)!;
  const names = [...definitions.queues, ...definitions.exchanges].map((item) => item.name);
  assert.ok(names.length > 10 && names.every((name) => name.startsWith(`${prefix}.`)), 'the topology is the prefix\'s');
  for (const role of ['scheduler', 'worker', 'operator']) {
    const { configure, write, read } = permission(role);
    for (const name of names) assert.match(name, new RegExp(configure), `${role} may declare ${name}`);
    // Queues and exchanges of another deployment on the same vhost: no right at all.
    for (const other of ['reaper.cleanup.seat-holds', 'acme-prod-x.cleanup.a', 'acme-prodx.delay', 'other.acme-prod.cleanup.a', 'amq.topic']) {
      for (const [kind, pattern] of Object.entries({ configure, write, read })) {
        assert.doesNotMatch(other, new RegExp(pattern), `${role} ${kind}: not ${other}`);
      }
    }
  }
  assert.match(`${prefix}.presence.seat-holds.pod-1`, new RegExp(permission('worker').configure), 'the worker declares its presence queues');
  assert.doesNotMatch(`${prefix}.presence.seat-holds.pod-1`, new RegExp(permission('scheduler').configure), 'the scheduler cannot delete them');
  assert.match('amq.default', new RegExp(permission('worker').write), 'the worker dead-letters through the default exchange');
  assert.deepEqual(permission('autoscaler'), { user: `${prefix}-autoscaler`, vhost: '/', configure: '', write: '', read: '' });
});

test('topology --definitions: for prefix reaper and the demo policies, exactly infra/rabbitmq/definitions.json', () => {
  const shipped = JSON.parse(readFileSync(DEFINITIONS_FILE, 'utf8')) as unknown;
  assert.deepEqual(definitionsFromCli(DEFINITIONS_PREFIX), shipped, 'regenerate it: REAPER_POLICIES=infra/policies.demo.yaml reaper topology --definitions');
  assert.deepEqual(topologyAsDefinitions(makeTopology({ prefix: DEFINITIONS_PREFIX, policies: DEMO_POLICY_NAMES, deliveryLimit: 20 }), DEFINITIONS_PREFIX), shipped);
});
