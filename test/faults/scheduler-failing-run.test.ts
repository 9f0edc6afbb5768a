import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import type { Channel, ChannelModel } from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses, runReaperCli, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { startReaperStoppedAfterEach, triggerRunId } from '../support/fixtures';

/**
 * One failing run must not stop the others (issue 7 item 11), with real scheduler processes:
 *  - a run of a policy whose table was dropped fails with the reason (shown by `runs`, `run`,
 *    `status` and reaper_runs_failed_total) while another policy's run completes;
 *  - a retryable error (publishes unroutable for a while) keeps the lease: a second replica does
 *    not take the run over while its owner is alive and retrying;
 *  - an unroutable work queue that stays so fails the run instead of retrying forever.
 */
const policy = (name: string, table: string, batchSize = 50) => `  - name: ${name}
    kind: row-delete
    schedule: "0 0 1 1 *"
    table: ${table}
    key: reservation_id
    expiresAt: expires_at
    guard: { status: held }
    batchSize: ${batchSize}
`;

interface RunRow {
  state: string;
  error: string | null;
  claim_count: number;
  owner: string | null;
}

describe('a failing run does not stop the others', () => {
  let bed: TestBed;
  let admin: ChannelModel;
  let adminChannel: Channel;
  let names: ReturnType<typeof brokerNames>;

  before(async () => {
    bed = await makeTestBed('fault_failing_run');
    names = brokerNames(bed.prefix);
    admin = await amqp.connect(bed.amqpUrl);
    adminChannel = await admin.createChannel();
  });
  // A test that fails mid-way must not leave its services running into the next test (an old
  // scheduler would claim the next test's runs): stop what is still running after each test.
  const startReaper = startReaperStoppedAfterEach();
  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await admin?.close().catch(() => undefined); // closing anyway
      await bed?.close();
    }
  });

  const runOf = async (runId: string): Promise<RunRow> =>
    (await bed.pool.query<RunRow>('SELECT state, error, claim_count, owner FROM cleanup_runs WHERE run_id = $1', [runId])).rows[0]!;
  const trigger = (policyName: string): Promise<string> => triggerRunId(bed, policyName);
  const stopAll = async (services: ReaperProcess[]) => {
    const exits = await Promise.all(services.map((s) => s.stop()));
    assert.deepEqual(exits.map((e) => e.code), services.map(() => 0), 'every service drains and exits 0');
  };

  test('a run whose table was dropped fails with the reason while another policy runs to completion', async () => {
    await bed.pool.query(`CREATE TABLE doomed_holds (reservation_id uuid PRIMARY KEY, status text NOT NULL, expires_at timestamptz NOT NULL)`);
    await bed.pool.query(
      `INSERT INTO doomed_holds SELECT gen_random_uuid(), 'held', now() - interval '1 hour' + i * interval '1 ms' FROM generate_series(1, 200) i`,
    );
    const seeded = await seedHolds(bed.pool, { expiredHeld: 300 });
    bed.writePolicies(`policies:\n${policy('doomed', 'doomed_holds')}${policy('seat-holds', 'seat_reservations')}`);
    const scheduler = startReaper('scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'scheduler-1', HTTP_PORT: '0' }));
    const worker = startReaper('worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'worker-1' }));
    const started = await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
    await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming');

    // Both services resolved the table at start-up; now it is gone.
    await bed.pool.query('DROP TABLE doomed_holds');
    const doomedRun = await trigger('doomed'); // the older run: claimed first by a single loop
    const healthyRun = await trigger('seat-holds');

    await eventually('the healthy policy to complete', async () => (await runOf(healthyRun)).state === 'completed', {
      timeoutMs: 30_000,
      describe: async () => ({ doomed: await runOf(doomedRun), healthy: await runOf(healthyRun), scheduler: scheduler.output.slice(-5) }),
    });
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0, 'the healthy policy deleted its expired rows');
    const failed = await eventually('the run of the dropped table to fail', async () => {
      const run = await runOf(doomedRun);
      return run.state === 'failed' ? run : undefined;
    });
    assert.match(failed.error!, /42P01/, 'the reason carries the SQLSTATE');
    assert.match(failed.error!, /doomed_holds/, 'and names the table');
    assert.equal(failed.claim_count, 1, 'failed by its first owner: no replica retried it forever');

    // Shown where an operator looks.
    const runs = await runReaperCli(['runs'], bed.processEnv());
    assert.match(runs.stdout, new RegExp(`${doomedRun.slice(0, 8)}.*failed[^\\n]*\\n\\s+reason: scan: database error 42P01`), runs.stdout);
    const wide = await runReaperCli(['runs', '--wide'], bed.processEnv());
    assert.match(wide.stdout, new RegExp(`${doomedRun}.*failed.*42P01`), wide.stdout);
    const one = await runReaperCli(['run', doomedRun], bed.processEnv());
    assert.match(one.stdout, /state\s+failed: scan: database error 42P01: relation "doomed_holds" does not exist/, one.stdout);
    const status = await runReaperCli(['status', '--json'], bed.processEnv());
    const doomedStatus = (JSON.parse(status.stdout) as { policies: Array<{ policy: string; lastRunState: string; lastRunError: string | null }> }).policies.find(
      (p) => p.policy === 'doomed',
    )!;
    assert.equal(doomedStatus.lastRunState, 'failed');
    assert.match(doomedStatus.lastRunError!, /42P01/);
    const metrics = await (await fetch(`http://127.0.0.1:${String(started.httpPort)}/metrics`)).text();
    assert.match(metrics, /reaper_runs_failed_total\{policy="doomed"\} 1/);
    assert.doesNotMatch(metrics, /reaper_runs_failed_total\{policy="seat-holds"\}/);
    await stopAll([scheduler, worker]);
  });

  test('a retryable error keeps the lease: no other replica takes the run over while its owner retries', async () => {
    const LEASE_MS = 1_500;
    await bed.pool.query('DELETE FROM seat_reservations');
    const seeded = await seedHolds(bed.pool, { expiredHeld: 200 });
    bed.writePolicies(`policies:\n${policy('seat-holds', 'seat_reservations')}`);
    // The backoff capped at 4 s (shared/config/test-timings.ts), not 10 s: the same waits until the
    // fifth refusal (a 4 s gap is longer than a lease plus the other replica's 1 s claim poll: a
    // lease left to run out is taken over; with a 2 s cap that went unseen), and the owner's retry
    // once the binding is back comes within 4 s, not 8.
    const env = (id: string) => bed.processEnv({ REAPER_WORKER_ID: id, REAPER_RUN_LEASE_MS: String(LEASE_MS), REAPER_TEST_RUN_RETRY_MAX_MS: '4000' });
    // Both replicas are up before the binding goes: a scheduler asserts the topology (and so the
    // binding) when it connects.
    const replicas = ['scheduler-a', 'scheduler-b'].map((id) => startReaper(id, ['scheduler'], env(id)));
    await Promise.all(replicas.map((r) => r.waitForLine('scheduler started', (line) => line.msg === 'scheduler started')));
    await adminChannel.unbindQueue(names.workQueue('seat-holds'), names.workExchange, 'seat-holds');
    const runId = await trigger('seat-holds');
    const refused = (r: ReaperProcess) => r.lines.filter((line) => line.msg === 'run publish failed; retrying' && line.runId === runId).length;
    const owner = await eventually('a replica to meet the refused publish', () => replicas.find((r) => refused(r) > 0));
    const other = replicas.find((r) => r !== owner)!;
    // Retries at 0.5, 1, 2, 4 s: several lease lengths pass; the run must stay with its owner.
    const claimsSeen = new Set<string>();
    await eventually(
      'the owner to retry for more than three leases',
      async () => {
        const run = await runOf(runId);
        claimsSeen.add(`${run.owner}#${run.claim_count}`);
        return refused(owner) >= 5;
      },
      { timeoutMs: 30_000, intervalMs: 100 },
    );
    assert.deepEqual([...claimsSeen], [`${owner.label}#1`], 'only the first claim ever held the run');
    assert.equal(other.lines.filter((line) => line.msg === 'run scanning').length, 0, 'the other replica never started the run');

    await adminChannel.bindQueue(names.workQueue('seat-holds'), names.workExchange, 'seat-holds');
    const worker = startReaper('worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'worker-1' }));
    await eventually('the run to complete', async () => (await runOf(runId)).state === 'completed', { timeoutMs: 30_000 });
    assert.equal((await runOf(runId)).claim_count, 1, 'completed by its first claim');
    assert.equal(await countReservations(bed.pool, seeded.expiredHeld), 0);
    await stopAll([...replicas, worker]);
  });

  test('a work queue that stays unroutable fails the run with the reason instead of retrying forever', async () => {
    await bed.pool.query('DELETE FROM seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 20 });
    bed.writePolicies(`policies:\n${policy('seat-holds', 'seat_reservations')}`);
    const scheduler = startReaper('scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'scheduler-1', REAPER_RUN_UNROUTABLE_FAIL_AFTER_SECONDS: '2' }));
    await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
    await adminChannel.unbindQueue(names.workQueue('seat-holds'), names.workExchange, 'seat-holds');
    try {
      const runId = await trigger('seat-holds');
      const failed = await eventually('the run to fail', async () => {
        const run = await runOf(runId);
        return run.state === 'failed' ? run : undefined;
      });
      assert.match(failed.error!, /^publish: unroutable/);
    } finally {
      await adminChannel.bindQueue(names.workQueue('seat-holds'), names.workExchange, 'seat-holds');
    }
    await stopAll([scheduler]);
  });
});
