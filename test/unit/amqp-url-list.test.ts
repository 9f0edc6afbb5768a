import assert from 'node:assert/strict';
import { test } from 'node:test';
import { splitAmqpUrls } from '../../shared/amqp/connection';
import { DELAY_TIERS_MS, makeTopology } from '../../shared/amqp/topology';
import { loadEnv, withHeartbeat } from '../../shared/config/env';
import { ConfigError } from '../../shared/config/errors';
import { clientQueryTimeoutMs, CLIENT_TIMEOUT_MARGIN_MS } from '../../shared/db/pool';

/** Configuration for brokers in a cluster and for links that stall (issue 10). */

test('AMQP_URL: one URL or a comma-separated list, spaces trimmed, empty entries refused', () => {
  assert.deepEqual(splitAmqpUrls('amqp://a:5672'), ['amqp://a:5672']);
  assert.deepEqual(splitAmqpUrls('amqp://a:5672, amqp://b:5673 ,amqp://c'), ['amqp://a:5672', 'amqp://b:5673', 'amqp://c']);
  assert.throws(() => splitAmqpUrls('amqp://a,,amqp://b'), /empty entry/);
  assert.throws(() => loadEnv({ AMQP_URL: 'amqp://a,' }), (error: unknown) => error instanceof ConfigError && /AMQP_URL=\(hidden\): a comma-separated list/.test(error.message));
});

test('REAPER_AMQP_HEARTBEAT_S is folded into each URL that has no heartbeat of its own', () => {
  assert.equal(withHeartbeat('amqp://a,amqp://b?frameMax=0,amqp://c?heartbeat=7', 2), 'amqp://a?heartbeat=2,amqp://b?frameMax=0&heartbeat=2,amqp://c?heartbeat=7');
  assert.equal(withHeartbeat('amqp://a', undefined), 'amqp://a', 'unset: the URL as given (the broker proposes the heartbeat)');
  assert.equal(loadEnv({ AMQP_URL: 'amqp://x', REAPER_AMQP_HEARTBEAT_S: '5' }).amqpUrl, 'amqp://x?heartbeat=5');
  assert.throws(() => loadEnv({ REAPER_AMQP_HEARTBEAT_S: '0' }), /REAPER_AMQP_HEARTBEAT_S/);
});

test('REAPER_QUORUM_GROUP_SIZE declares x-quorum-initial-group-size on every quorum queue, and nothing when unset', () => {
  const quorumArgs = (size: number | undefined) =>
    makeTopology({ prefix: 'p', policies: ['a', 'b'], deliveryLimit: 20, quorumGroupSize: size })
      .queues.filter((q) => q.options.arguments?.['x-queue-type'] === 'quorum')
      .map((q) => [q.name, q.options.arguments?.['x-quorum-initial-group-size']]);
  const tiers = (size: number) => DELAY_TIERS_MS.map((ms) => [`p.delay.${ms}`, size] as const);
  assert.deepEqual(quorumArgs(3), [['p.dead-letter', 3], ['p.cleanup.a', 3], ['p.cleanup.b', 3], ...tiers(3)], 'on a cluster the delay tiers are replicated too');
  assert.deepEqual(quorumArgs(undefined), [['p.dead-letter', undefined], ['p.cleanup.a', undefined], ['p.cleanup.b', undefined]], 'unset: the topology as before (tiers classic)');
  assert.equal(loadEnv({ REAPER_QUORUM_GROUP_SIZE: '3' }).quorumGroupSize, 3);
  assert.equal(loadEnv({}).quorumGroupSize, undefined);
  assert.throws(() => loadEnv({ REAPER_QUORUM_GROUP_SIZE: '0' }), /REAPER_QUORUM_GROUP_SIZE/);
});

test('PostgreSQL: keepalive on by default, and a client-side bound of statement_timeout + margin', () => {
  const env = loadEnv({ REAPER_STATEMENT_TIMEOUT_MS: '2000' });
  assert.equal(env.sessionTimeouts.keepAliveMs, 10_000);
  assert.equal(clientQueryTimeoutMs(env.sessionTimeouts), 2_000 + CLIENT_TIMEOUT_MARGIN_MS);
  assert.equal(clientQueryTimeoutMs({ statementTimeoutMs: 0, lockTimeoutMs: 0 }), 0, 'statement_timeout off: no client bound either');
  assert.equal(loadEnv({ REAPER_DB_KEEPALIVE_MS: '0' }).sessionTimeouts.keepAliveMs, 0);
});
