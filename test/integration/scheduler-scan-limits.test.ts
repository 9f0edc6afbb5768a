import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { brokerNames } from '../../shared/amqp/topology';
import { MAX_MESSAGE_BYTES } from '../../shared/contracts/batch';
import type { RunSummary } from '../../shared/db/queries/runs';
import { type TestBroker } from '../support/broker';
import { eventually } from '../support/eventually';
import { runReaperCli, type ReaperProcess } from '../support/processes';
import { seedHolds } from '../support/seed';
import { type TestBed } from '../support/testbed';
import { closeBedAndBroker, openBedAndBroker, rowDeletePolicyYaml, startReaperStoppedAfterEach, triggerRunId } from '../support/fixtures';

/**
 * A scan that meets what a message cannot carry, and runs that can never complete, with a real
 * scheduler and worker:
 *  - item 12: a window made only of keys over 512 characters does not spin; those rows are counted
 *    as skipped, the cursor moves past them and the run completes;
 *  - item 12: a batch whose message would exceed 1 MiB is split before publishing;
 *  - item 13: a run one of whose batches was dead-lettered ends `incomplete` with its counts
 *    (REAPER_RUN_INCOMPLETE_AFTER_SECONDS shortens the time without progress for the test).
 */
const textKeyTable = (table: string) =>
  `CREATE TABLE ${table} (k text PRIMARY KEY, status text NOT NULL, expires_at timestamptz NOT NULL)`;

describe('scan limits and runs that cannot complete', () => {
  let bed: TestBed;
  let broker: TestBroker;
  let names: ReturnType<typeof brokerNames>;
  const startReaper = startReaperStoppedAfterEach();

  before(async () => {
    ({ bed, broker, names } = await openBedAndBroker('scheduler_scan_limits'));
  });
  after(() => closeBedAndBroker({ bed, broker }));

  const summary = async (runId: string): Promise<RunSummary> => {
    const result = await runReaperCli(['run', runId, '--json'], bed.processEnv());
    assert.equal(result.code, 0, result.stdout);
    return JSON.parse(result.stdout) as RunSummary;
  };
  const stateOf = async (runId: string): Promise<string> =>
    (await bed.pool.query<{ state: string }>('SELECT state FROM cleanup_runs WHERE run_id = $1', [runId])).rows[0]!.state;
  const trigger = (policyName: string): Promise<string> => triggerRunId(bed, policyName);
  const startServices = async (withWorker = true): Promise<ReaperProcess[]> => {
    const services = [startReaper('scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'scheduler-1', REAPER_RUN_INCOMPLETE_AFTER_SECONDS: '2' }))];
    if (withWorker) services.push(startReaper('worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'worker-1' })));
    await services[0]!.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
    if (withWorker) await services[1]!.waitForLine('worker consuming', (line) => line.msg === 'worker consuming');
    return services;
  };
  const stopAll = async (services: ReaperProcess[]) => {
    const exits = await Promise.all(services.map((s) => s.stop()));
    assert.deepEqual(exits.map((e) => e.code), services.map(() => 0), 'every service drains and exits 0');
  };

  test('keys over 512 characters filling whole windows are skipped and counted; the scan moves on and the run completes', async () => {
    await bed.pool.query(textKeyTable('long_key_holds'));
    // batchSize 10: a window is 320 rows. The 330 oldest rows all have 605-character keys, so the
    // first window holds nothing publishable; 25 ordinary rows come after them.
    await bed.pool.query(
      `INSERT INTO long_key_holds SELECT repeat('k', 600) || lpad(i::text, 5, '0'), 'held', now() - interval '2 hours' + i * interval '1 ms'
       FROM generate_series(1, 330) i`,
    );
    await bed.pool.query(
      `INSERT INTO long_key_holds SELECT 'short-' || i, 'held', now() - interval '1 hour' + i * interval '1 ms' FROM generate_series(1, 25) i`,
    );
    bed.writePolicies(rowDeletePolicyYaml({ name: 'long-keys', table: 'long_key_holds', key: 'k', batchSize: 10 }));
    const services = await startServices();
    const runId = await trigger('long-keys');
    await eventually('the run to complete', async () => (await stateOf(runId)) === 'completed', {
      timeoutMs: 30_000,
      describe: async () => ({ run: await summary(runId), scheduler: services[0]!.output.slice(-3) }),
    });
    const run = await summary(runId);
    assert.deepEqual(
      { skipped: run.skipped, candidates: run.candidates, deleted: run.deleted, batches: run.batchesConfirmed },
      { skipped: 330, candidates: 25, deleted: 25, batches: 3 },
      'the long keys are counted as skipped, the others deleted',
    );
    const left = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM long_key_holds')).rows[0]!.n;
    assert.equal(left, 330, 'rows with long keys stay (they cannot travel in a message)');
    const shown = await runReaperCli(['run', runId], bed.processEnv());
    assert.match(shown.stdout, /skipped\s+330/);
    const listed = await runReaperCli(['runs'], bed.processEnv());
    // By default the run shows as its first 8 hex digits and the skipped keys on a line under it; --wide has the column.
    assert.match(listed.stdout, new RegExp(`^${runId.slice(0, 8)}\\s.*completed[^\\n]*\\n {4}skipped: 330 `, 'm'), listed.stdout);
    assert.match((await runReaperCli(['runs', '--wide'], bed.processEnv())).stdout, new RegExp(`${runId}.*completed.*\\b330\\b`));
    await stopAll(services);
  });

  test('a batch whose message would pass 1 MiB is split before it is published', async () => {
    await bed.pool.query(textKeyTable('wide_key_holds'));
    // 1000 keys of 500 CJK characters (1,500 bytes of UTF-8 each): one 1000-item batch would be
    // about 1.6 MB, which workers dead-letter as too-large.
    await bed.pool.query(
      `INSERT INTO wide_key_holds SELECT repeat('界', 495) || lpad(i::text, 5, '0'), 'held', now() - interval '1 hour' + i * interval '1 ms'
       FROM generate_series(1, 1000) i`,
    );
    bed.writePolicies(rowDeletePolicyYaml({ name: 'wide-keys', table: 'wide_key_holds', key: 'k', batchSize: 1000 }));
    const services = await startServices();
    const runId = await trigger('wide-keys');
    await eventually('the run to complete', async () => (await stateOf(runId)) === 'completed', {
      timeoutMs: 30_000,
      describe: async () => ({ run: await summary(runId), worker: services[1]!.output.slice(-3) }),
    });
    const run = await summary(runId);
    assert.deepEqual({ deleted: run.deleted, candidates: run.candidates, skipped: run.skipped }, { deleted: 1000, candidates: 1000, skipped: 0 });
    assert.ok(run.batchesConfirmed >= 2, `the page was split (${run.batchesConfirmed} batches)`);
    const sizes = services[1]!.lines.filter((line) => line.msg === 'batch settled').length;
    assert.equal(sizes, run.batchesConfirmed, 'every part was settled by the worker');
    assert.equal((await broker.drain(names.deadLetterQueue)).length, 0, `nothing dead-lettered as larger than ${MAX_MESSAGE_BYTES} bytes`);
    assert.equal((await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM wide_key_holds')).rows[0]!.n, 0);
    await stopAll(services);
  });

  test('a run one of whose batches was dead-lettered ends incomplete with the counts', async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 50 });
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 10 }));
    // No worker yet: the five batches wait in the work queue.
    const [scheduler] = await startServices(false);
    const runId = await trigger('seat-holds');
    await eventually('the run to be published', async () => (await stateOf(runId)) === 'published');
    const messages = await broker.drain(names.workQueue('seat-holds'));
    assert.equal(messages.length, 5);
    // One batch goes to the dead-letter queue (as a worker would send a batch it cannot handle);
    // the other four go back to the work queue.
    const [lost, ...kept] = messages;
    await broker.publish('', names.deadLetterQueue, lost!.content, {
      messageId: lost!.properties.messageId as string,
      headers: { 'x-reaper-reason': 'invalid-message', 'x-reaper-detail': 'test: dead-lettered on purpose' },
    });
    for (const message of kept) {
      await broker.publish(names.workExchange, 'seat-holds', message.content, {
        messageId: message.properties.messageId as string,
        headers: message.properties.headers as Record<string, unknown>,
      });
    }
    const worker = startReaper('worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'worker-1' }));
    await eventually('the run to end incomplete', async () => (await stateOf(runId)) === 'incomplete', { timeoutMs: 30_000 });
    const run = await eventually('the four batches to be counted', async () => {
      const found = await summary(runId);
      return found.batchesDone === 4 ? found : undefined;
    });
    assert.deepEqual({ confirmed: run.batchesConfirmed, done: run.batchesDone, deleted: run.deleted }, { confirmed: 5, done: 4, deleted: 40 });
    assert.match(run.error!, /of 5 batches have no receipt/);
    assert.ok(run.finishedAt, 'incomplete is a final state');
    const shown = await runReaperCli(['run', runId], bed.processEnv());
    assert.match(shown.stdout, /state\s+incomplete: \d of 5 batches have no receipt/);
    assert.match(shown.stdout, /4 done of 5 confirmed, 1 missing/);
    assert.ok(
      scheduler!.lines.some((line) => line.msg === 'run incomplete: batches without a receipt and no progress' && line.runId === runId),
      'the scheduler says so in its log',
    );
    await broker.drain(names.deadLetterQueue);
    await stopAll([scheduler!, worker]);
  });
});
