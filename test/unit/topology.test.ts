/**
 * Unit tests for the broker topology as data (shared/amqp/topology.ts): the exact names and
 * arguments docs/design.md promises ("Broker topology"), and the delay tier choice.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DELAY_HEADER, DELAY_TIERS_MS, brokerNames, makeTopology, pickDelayTier, type Topology } from '../../shared/amqp/topology';

const POLICIES = ['seat-holds', 'media-assets'];

function topology(prefix = 'P', deliveryLimit = 20): Topology {
  return makeTopology({ prefix, policies: POLICIES, deliveryLimit });
}

function queue(t: Topology, name: string) {
  const found = t.queues.find((q) => q.name === name);
  assert.ok(found, `queue ${name} is declared; declared: ${t.queues.map((q) => q.name).join(', ')}`);
  return found;
}

function exchange(t: Topology, name: string) {
  const found = t.exchanges.find((e) => e.name === name);
  assert.ok(found, `exchange ${name} is declared; declared: ${t.exchanges.map((e) => e.name).join(', ')}`);
  return found;
}

/** Where a dead-lettered message from `queueName` ends up: the queue it is routed to. */
function deadLetterTarget(t: Topology, queueName: string, originalRoutingKey: string): string | undefined {
  const args = queue(t, queueName).options.arguments ?? {};
  const dlx = args['x-dead-letter-exchange'] as string | undefined;
  if (dlx === undefined) return undefined;
  const routingKey = (args['x-dead-letter-routing-key'] as string | undefined) ?? originalRoutingKey;
  if (dlx === '') return routingKey; // the default exchange routes by queue name
  const ex = exchange(t, dlx);
  assert.equal(ex.type, 'direct', `dead-letter exchange ${dlx} routes by key`);
  return t.bindings.find((b) => b.exchange === dlx && b.routingKey === routingKey)?.queue;
}

test('brokerNames follows docs/design.md for a prefix', () => {
  const names = brokerNames('P');
  assert.equal(names.workExchange, 'P.cleanup');
  assert.equal(names.deadLetterQueue, 'P.dead-letter');
  assert.equal(names.workQueue('seat-holds'), 'P.cleanup.seat-holds');
  assert.equal(names.delayQueue(5000), 'P.delay.5000');
});

test('the default prefix reaper gives reaper.cleanup, reaper.cleanup.X, reaper.dead-letter', () => {
  const names = brokerNames('reaper');
  assert.equal(names.workExchange, 'reaper.cleanup');
  assert.equal(names.workQueue('media-assets'), 'reaper.cleanup.media-assets');
  assert.equal(names.deadLetterQueue, 'reaper.dead-letter');
});

test('exchange P.cleanup is direct and durable', () => {
  const work = exchange(topology(), 'P.cleanup');
  assert.equal(work.type, 'direct');
  assert.equal(work.options.durable, true);
});

test('every declared name is unique and starts with the prefix', () => {
  const t = topology('pfx');
  const queueNames = t.queues.map((q) => q.name);
  const exchangeNames = t.exchanges.map((e) => e.name);
  assert.equal(new Set(queueNames).size, queueNames.length);
  assert.equal(new Set(exchangeNames).size, exchangeNames.length);
  for (const name of [...queueNames, ...exchangeNames]) assert.ok(name.startsWith('pfx.'), name);
});

test('a work queue P.cleanup.X per policy: durable quorum with x-delivery-limit, bound to P.cleanup with key X', () => {
  const t = topology('P', 17);
  for (const policy of POLICIES) {
    const q = queue(t, `P.cleanup.${policy}`);
    assert.equal(q.options.durable, true);
    assert.equal(q.options.arguments?.['x-queue-type'], 'quorum');
    assert.equal(q.options.arguments?.['x-delivery-limit'], 17);
    const bindings = t.bindings.filter((b) => b.queue === `P.cleanup.${policy}`);
    assert.deepEqual(
      bindings.map((b) => ({ exchange: b.exchange, routingKey: b.routingKey })),
      [{ exchange: 'P.cleanup', routingKey: policy }],
    );
  }
});

test('a work queue dead-letters to P.dead-letter', () => {
  const t = topology();
  for (const policy of POLICIES) {
    assert.equal(deadLetterTarget(t, `P.cleanup.${policy}`, policy), 'P.dead-letter');
  }
});

test('the dead-letter queue P.dead-letter is declared and durable', () => {
  const dlq = queue(topology(), 'P.dead-letter');
  assert.equal(dlq.options.durable, true);
  assert.equal(dlq.options.arguments?.['x-dead-letter-exchange'], undefined, 'the dead-letter queue does not loop');
});

test('no policies: the exchange, the dead-letter queue and the delay tiers still exist', () => {
  const t = makeTopology({ prefix: 'P', policies: [], deliveryLimit: 20 });
  exchange(t, 'P.cleanup');
  queue(t, 'P.dead-letter');
  for (const ms of DELAY_TIERS_MS) queue(t, `P.delay.${ms}`);
  assert.equal(t.queues.filter((q) => q.name.startsWith('P.cleanup.')).length, 0);
});

test('delay tiers P.delay.<ms>: fixed x-message-ttl, dead-lettering to exchange P.cleanup under the original key', () => {
  const t = topology();
  assert.ok(DELAY_TIERS_MS.length > 0);
  for (const ms of DELAY_TIERS_MS) {
    const q = queue(t, `P.delay.${ms}`);
    assert.equal(q.options.durable, true);
    assert.equal(q.options.arguments?.['x-message-ttl'], ms);
    assert.equal(q.options.arguments?.['x-dead-letter-exchange'], 'P.cleanup');
    assert.equal(
      q.options.arguments?.['x-dead-letter-routing-key'],
      undefined,
      'no fixed routing key: an expired message returns under its own policy key',
    );
    // Back to the right work queue for every policy.
    for (const policy of POLICIES) assert.equal(deadLetterTarget(t, `P.delay.${ms}`, policy), `P.cleanup.${policy}`);
  }
});

test('every delay tier is reachable: bound to the delay exchange on its DELAY_HEADER value', () => {
  const t = topology();
  const names = brokerNames('P');
  const delay = exchange(t, names.delayExchange);
  assert.equal(delay.options.durable, true);
  for (const ms of DELAY_TIERS_MS) {
    const bindings = t.bindings.filter((b) => b.queue === `P.delay.${ms}`);
    assert.equal(bindings.length, 1, `one binding for P.delay.${ms}`);
    assert.equal(bindings[0]!.exchange, names.delayExchange);
    if (delay.type === 'headers') {
      assert.equal(bindings[0]!.args?.['x-match'], 'all');
      assert.equal(bindings[0]!.args?.[DELAY_HEADER], String(ms));
    }
  }
});

test('every binding refers to a declared queue and exchange', () => {
  const t = topology();
  const queues = new Set(t.queues.map((q) => q.name));
  const exchanges = new Set(t.exchanges.map((e) => e.name));
  for (const binding of t.bindings) {
    assert.ok(queues.has(binding.queue), binding.queue);
    assert.ok(exchanges.has(binding.exchange), binding.exchange);
  }
});

test('DELAY_TIERS_MS is strictly increasing', () => {
  for (let i = 1; i < DELAY_TIERS_MS.length; i += 1) assert.ok(DELAY_TIERS_MS[i]! > DELAY_TIERS_MS[i - 1]!);
});

test('pickDelayTier takes the longest tier that does not exceed the delay', () => {
  const smallest = DELAY_TIERS_MS[0];
  assert.equal(pickDelayTier(0), smallest);
  assert.equal(pickDelayTier(1), smallest);
  assert.equal(pickDelayTier(-500), smallest);
  for (let i = 0; i < DELAY_TIERS_MS.length; i += 1) {
    const tier = DELAY_TIERS_MS[i]!;
    assert.equal(pickDelayTier(tier), tier, `exactly ${tier}`);
    assert.equal(pickDelayTier(tier + 1), tier, `just over ${tier}`);
    if (i > 0) assert.equal(pickDelayTier(tier - 1), DELAY_TIERS_MS[i - 1], `just under ${tier}`);
  }
});

test('pickDelayTier never returns a tier longer than the delay, except below the smallest tier', () => {
  const largest = DELAY_TIERS_MS[DELAY_TIERS_MS.length - 1]!;
  for (const delay of [250, 999, 1000, 1001, 1500, 4999, 29_999, 30_001, 119_999, largest - 1]) {
    const tier = pickDelayTier(delay);
    assert.ok(tier <= delay, `${delay} -> ${tier}`);
    assert.ok((DELAY_TIERS_MS as readonly number[]).includes(tier));
  }
  assert.equal(pickDelayTier(24 * 3600 * 1000), largest, 'longer delays take the largest tier (delayed again on arrival)');
});
