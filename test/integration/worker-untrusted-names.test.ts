import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { encodeBatch, makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import { UNKNOWN_POLICY_LABEL, type WorkerHandle } from '../../services/worker/worker';
import { type TestBroker } from '../support/broker';
import { closeWorkerWorld, counterTotal, openWorkerWorld } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { countReservations, databaseNowIso, itemsFor, seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';

/**
 * Issue 7 item 18: what a message says is data, not a name the worker trusts.
 *  - The `policy` label of metrics never comes from a message body: an unknown policy is counted
 *    under one fixed label, however many different names arrive.
 *  - The same id twice in one batch is `invalid-message` at decode (dead-lettered at once, naming
 *    the id), not a statement error retried up to the delivery limit.
 */
describe('worker: names from messages', () => {
  let bed: TestBed;
  let worker: WorkerHandle;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;

  before(async () => ({ bed, broker, names, worker } = await openWorkerWorld('worker_untrusted_names')));
  after(() => closeWorkerWorld({ bed, broker, worker }));

  /** Every value the `policy` label takes in these metrics. */
  async function policyLabels(): Promise<Set<string>> {
    const labels = new Set<string>();
    for (const name of ['reaper_batches_total', 'reaper_batch_duration_seconds']) {
      const metric = await worker.metrics.registry.getSingleMetric(name)!.get();
      for (const value of metric.values) if (typeof value.labels.policy === 'string') labels.add(value.labels.policy);
    }
    return labels;
  }

  async function batchFor(ids: string[], overrides: Partial<BatchV1> = {}): Promise<BatchV1> {
    const runId = randomUUID();
    return { version: 1, runId, batchId: makeBatchId(runId, 1), policy: 'seat-holds', cutoff: await databaseNowIso(bed.pool), items: await itemsFor(bed.pool, ids), ...overrides };
  }

  const deadLetters = () =>
    eventually('dead-lettered messages', async () => {
      const messages = await broker.drain(names.deadLetterQueue);
      return messages.length > 0 ? messages : undefined;
    });

  test('unknown policies named in message bodies are all counted under one fixed label', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 1 });
    const invented = ['no-such-policy', `attacker-${randomUUID()}`, `attacker-${randomUUID()}`];
    for (const policy of invented) {
      const batch = await batchFor(seeded.expiredHeld, { policy });
      await broker.publish(names.workExchange, 'seat-holds', encodeBatch(batch), { messageId: batch.batchId });
    }
    const dead: unknown[] = [];
    await eventually('all three dead-lettered', async () => {
      dead.push(...(await broker.drain(names.deadLetterQueue)));
      return dead.length === invented.length;
    });
    const labels = await policyLabels();
    for (const policy of invented) assert.equal(labels.has(policy), false, `no label value "${policy}" (got ${[...labels].join(', ')})`);
    assert.ok(labels.has(UNKNOWN_POLICY_LABEL), `counted under ${UNKNOWN_POLICY_LABEL}`);
    assert.equal(await counterTotal(worker.metrics.registry, 'reaper_batches_total', { policy: UNKNOWN_POLICY_LABEL, outcome: 'dead-lettered' }), invented.length);
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 1, 'nothing deleted');
  });

  test('the same id twice in one batch is dead-lettered as invalid-message on its first delivery, naming the id', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 3 });
    const valid = await batchFor(seeded.expiredHeld);
    const twice: BatchV1 = { ...valid, items: [...valid.items, valid.items[1]!] };
    await broker.publish(names.workExchange, 'seat-holds', encodeBatch(twice), { messageId: twice.batchId });
    const [dead] = await deadLetters();
    assert.equal(dead!.properties.headers?.['x-reaper-reason'], 'invalid-message');
    assert.match(String(dead!.properties.headers?.['x-reaper-detail']), new RegExp(`"${valid.items[1]!.id}" appears more than once`));
    assert.equal(dead!.properties.headers?.['x-delivery-count'] ?? 0, 0, 'first delivery: not retried toward the delivery limit');
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 3, 'nothing deleted');
    assert.equal((await bed.pool.query('SELECT 1 FROM cleanup_batches WHERE batch_id = $1', [twice.batchId])).rowCount, 0, 'no receipt');
  });
});
