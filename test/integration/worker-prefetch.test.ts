import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { describe, test } from 'node:test';
import type pg from 'pg';
import pino from 'pino';
import { PREFETCH_DEFAULTS } from '../../shared/config/env';
import { loadPolicies } from '../../shared/config/policies';
import { makeBatchId, type BatchV1 } from '../../shared/contracts/batch';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { bedAndBrokerSuite, publishBatch } from '../support/fixtures';
import { eventually } from '../support/eventually';
import { databaseNowIso } from '../support/seed';

/**
 * How many batches a worker holds per queue (REAPER_PREFETCH, shared/config/env.ts): unset, a
 * row-delete queue's consumer holds PREFETCH_DEFAULTS.rowDelete (its batches coalesce into one
 * statement) and a remote-delete queue's PREFETCH_DEFAULTS.remoteDelete; set, every queue holds
 * that many. Seen from the broker: both policies' tables are locked, so every batch the worker
 * takes stays in its hands, and the ready count of each queue falls by exactly what it holds; the
 * test then takes the rest itself, which is all the rest only if the worker held no more.
 */
describe('worker prefetch per kind of queue', () => {
  const world = bedAndBrokerSuite('worker_prefetch');
  const ROW_BATCHES = PREFETCH_DEFAULTS.rowDelete + 8;
  const REMOTE_BATCHES = PREFETCH_DEFAULTS.remoteDelete + 8;

  /** Batches of keys no row has (nothing to delete once the lock is gone): what they wait on is the lock. */
  async function publishBatches(policy: string, count: number): Promise<void> {
    const { bed, broker, names } = world;
    const cutoff = await databaseNowIso(bed.pool);
    for (let i = 0; i < count; i++) {
      const runId = randomUUID();
      const batch: BatchV1 = { version: 1, runId, batchId: makeBatchId(runId, 1), policy, cutoff, items: [{ id: randomUUID(), observedExpiry: cutoff }] };
      await publishBatch(broker, names, batch);
    }
  }

  /** Holds both policies' tables so that a batch taken by the worker cannot finish; released in `finally`. */
  async function withTablesLocked(work: () => Promise<void>): Promise<void> {
    const client: pg.PoolClient = await world.bed.pool.connect();
    try {
      await client.query('BEGIN');
      await client.query('LOCK TABLE seat_reservations, media_assets IN ACCESS EXCLUSIVE MODE');
      await work();
    } finally {
      await client.query('ROLLBACK').catch(() => undefined);
      client.release();
    }
  }

  async function holdsPerQueue(overrides: Record<string, string>, expected: { row: number; remote: number }): Promise<void> {
    const { bed, broker, names } = world;
    // A long lock timeout: the statements wait for the test's lock instead of failing back to the queue.
    const env = bed.env({ ...overrides, REAPER_LOCK_TIMEOUT_MS: '120000', REAPER_WORKER_ID: `prefetch-${randomUUID().slice(0, 8)}` });
    const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });
    const worker: WorkerHandle = await startWorker(bed.as(env, 'worker'), loadPolicies(env.policiesPath), log);
    try {
      await withTablesLocked(async () => {
        await publishBatches('seat-holds', ROW_BATCHES);
        await publishBatches('media-assets', REMOTE_BATCHES);
        const ready = async () => ({ row: await broker.messageCount(names.workQueue('seat-holds')), remote: await broker.messageCount(names.workQueue('media-assets')) });
        const want = { row: ROW_BATCHES - expected.row, remote: REMOTE_BATCHES - expected.remote };
        await eventually(`ready counts ${JSON.stringify(want)} (each queue's prefetch in the worker's hands)`, async () => {
          const now = await ready();
          return now.row === want.row && now.remote === want.remote;
        }, { describe: ready });
        // Never more than the prefetch, and no window of time to miss an over-delivery in: the test
        // takes every batch still in each queue. Once a queue is empty nothing more can reach the
        // worker (what it holds stays held: the tables are locked), so what the test got is exactly
        // what the worker did not take. A worker allowed more would have taken more of the ready
        // batches already (the counts above fall short of `want`) or races the test for them now.
        const left = { row: (await broker.drain(names.workQueue('seat-holds'))).length, remote: (await broker.drain(names.workQueue('media-assets'))).length };
        assert.deepEqual(left, want, 'no queue gave the worker more than its prefetch: the rest was still in the queue');
        assert.deepEqual(await ready(), { row: 0, remote: 0 });
      });
    } finally {
      // After the lock is gone (withTablesLocked ended): the held batches finish and are acked.
      await worker.stop();
      // What the worker never took is purged: the next case starts with empty queues.
      await broker.drain(names.workQueue('seat-holds'));
      await broker.drain(names.workQueue('media-assets'));
    }
  }

  test('unset: a row-delete queue holds its coalescing prefetch, a remote-delete queue the smaller one', async () => {
    assert.ok(PREFETCH_DEFAULTS.rowDelete > PREFETCH_DEFAULTS.remoteDelete);
    await holdsPerQueue({}, { row: PREFETCH_DEFAULTS.rowDelete, remote: PREFETCH_DEFAULTS.remoteDelete });
  });

  test('REAPER_PREFETCH set: every queue holds that many', async () => {
    await holdsPerQueue({ REAPER_PREFETCH: '5' }, { row: 5, remote: 5 });
  });
});
