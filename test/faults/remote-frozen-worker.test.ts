import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { type MediaApi, type MediaApiCall } from '../../tools/media-api/server';
import { runReaperCli, type ReaperProcess } from '../support/processes';
import {
  assertRetention,
  assetStatuses,
  closeRemoteWorld,
  callsByKey,
  errorsLogged,
  ledgerRows,
  MEDIA_POLICY,
  openRemoteWorld,
  seedAssets,
  startSchedulerProcess,
  started,
  startWorkerProcess,
  stopStarted,
  type LedgerRow,
} from '../support/remote-helpers';
import { type TestBed } from '../support/testbed';

/**
 * docs/design.md invariant 8, "completion requires the current lease owner", with real processes:
 * worker A is frozen (SIGSTOP) while its remote call is in progress and stays frozen past its
 * lease; worker B claims the operation (a new lease, B as owner) and calls with the same key.
 * A is resumed (SIGCONT) and gets its answer or its timeout:
 *  - while B's call is still in progress (B holds the lease): A's outcome is refused, B records;
 *  - after B recorded: A's outcome is refused and the ledger row stays exactly what B left.
 * Either way A logs 'stale lease: outcome not recorded' and the remote deleted the asset once.
 * The stand-in HOLDS its answers (media-api `hold`/`release`): a call is in progress exactly until
 * the test releases it, so "A frozen mid-call" and "B's call still in progress" do not depend on
 * how fast this machine polls (a fixed slow answer did: a late poll missed the call in progress).
 * A, frozen past its timeout, times out as soon as it is continued: its outcome is 'uncertain'.
 */
const LEASE_MS = 11_000; // the shortest lease allowed: remote.timeoutMs + 10 s
const TIMEOUT_MS = 1_000;

describe('remote-delete: a worker frozen past its lease cannot overwrite the newer claim', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    ({ bed, api } = await openRemoteWorld('fault_remote_frozen', { ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 10, timeoutMs: TIMEOUT_MS, leaseMs: LEASE_MS }));
  });

  after(() => closeRemoteWorld({ bed, api }));

  interface TakenOver {
    processes: { scheduler: ReaperProcess; workerA: ReaperProcess; workerB: ReaperProcess };
    assetId: string;
    key: string;
    claimA: LedgerRow;
    callB: MediaApiCall;
  }

  /**
   * SIGSTOPs the worker at a moment it holds no open transaction. Frozen inside one (its admission
   * transaction holds the policy's admission row; the ledger sweeper's holds the per-policy sweep
   * lock) it would stop every other worker's admission or sweep, which is a different test (a
   * frozen lock holder), and B could never take over. Only A's worker runs at this point, and its
   * call is held by the stand-in, so it soon has nothing to do but wait; a stop that catches it in
   * a transaction is undone and tried again.
   */
  async function freezeOutsideTransactions(worker: ReaperProcess): Promise<void> {
    const openTransactions = async (states: string[]) =>
      (
        await bed.pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-worker' AND state = ANY($1::text[])`,
          [states],
        )
      ).rows[0]!.n;
    for (let attempt = 1; ; attempt++) {
      worker.signal('SIGSTOP');
      // A statement it had sent runs to its end without it; what is left open then needs the process.
      await eventually(`${worker.label}'s statements in progress to end`, async () => (await openTransactions(['active'])) === 0, { timeoutMs: 10_000, intervalMs: 10 });
      if ((await openTransactions(['idle in transaction', 'idle in transaction (aborted)'])) === 0) return;
      worker.signal('SIGCONT');
      assert.ok(attempt < 50, `${worker.label} could not be frozen outside a transaction`);
      await new Promise((resolve) => setTimeout(resolve, 7 * attempt)); // a different moment next time
    }
  }

  /** A calls and is frozen mid-call past its lease; B claims the operation and its call is in progress. */
  async function freezeAAndLetBTakeOver(prefix: string): Promise<TakenOver> {
    const [assetId] = await seedAssets(bed.pool, prefix, 1);
    const scheduler = startSchedulerProcess(bed, `${prefix}-scheduler`);
    // Prefetch 1: while A holds its batch the broker gives the next one to B, not to frozen A.
    const workerA = startWorkerProcess(bed, `${prefix}-a`, { REAPER_PREFETCH: '1' });
    await Promise.all([started(scheduler, 'scheduler'), started(workerA, 'worker')]);
    const callsBefore = api.calls.length;
    api.configure({ hold: true });

    assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0);
    const callA = await eventually('A to be in the middle of its call', () => api.calls.slice(callsBefore).find((call) => call.finishedAt === 0), {
      timeoutMs: 20_000,
      intervalMs: 20,
    });
    await freezeOutsideTransactions(workerA);
    assert.equal(callA.id, assetId);
    const key = callA.key!;
    const [claimA] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(claimA!.operation_key, key);
    assert.equal(claimA!.state, 'in_flight');
    assert.equal(claimA!.lease_owner, workerA.label, 'A holds the lease while its call is in progress');
    assert.equal(claimA!.attempt_count, 1);

    // A stays frozen past its lease.
    await eventually(
      'A lease to expire (database clock)',
      async () =>
        (await bed.pool.query<{ expired: boolean }>(`SELECT lease_expires_at < clock_timestamp() AS expired FROM cleanup_ledger WHERE operation_key = $1`, [key]))
          .rows[0]?.expired === true,
      { timeoutMs: LEASE_MS + 5_000 },
    );

    const workerB = startWorkerProcess(bed, `${prefix}-b`);
    await started(workerB, 'worker');
    assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv())).code, 0, 'a later run re-finds the still-active asset');

    // B's claim: a new lease with B as owner, visible while B's (slow) call is in progress.
    // B gets the operation through the lease reclaimer (every 5 s) and the ledger sweeper: on a
    // loaded machine that takes a while, so the deadline is generous (nothing here is a window).
    const callB = await eventually('B to call with the same key', () => api.calls.find((call) => call.seq > callA.seq && call.finishedAt === 0), {
      timeoutMs: 60_000,
      intervalMs: 20,
    });
    assert.equal(callB.key, key, 'B retries the same operation: same Idempotency-Key');
    const [claimB] = await ledgerRows(bed.pool, [assetId!]);
    assert.equal(claimB!.state, 'in_flight');
    assert.equal(claimB!.lease_owner, workerB.label, 'the newer claim belongs to B');
    assert.ok(claimB!.lease_expires_ms! > claimA!.lease_expires_ms!, 'with a newer lease');
    assert.equal(claimB!.attempt_count, 2, 'B claimed it: a second cleanup attempt');
    return { processes: { scheduler, workerA, workerB }, assetId: assetId!, key, claimA: claimA!, callB };
  }

  const staleLines = (worker: ReaperProcess, key: string) =>
    worker.lines.filter((line) => line.msg === 'stale lease: outcome not recorded' && line.operationKey === key);

  async function finish(taken: TakenOver): Promise<void> {
    const { key, assetId } = taken;
    api.configure({ hold: false });
    api.release();
    const [final] = await ledgerRows(bed.pool, [assetId]);
    assert.equal(final!.state, 'done');
    assert.equal(final!.outcome, 'confirmed');
    assert.equal(final!.attempt_count, 2);
    assertRetention([final!]);
    assert.equal((await assetStatuses(bed.pool, [assetId])).get(assetId), 'deleted');
    assert.equal(callsByKey(api).get(key)!.length, 2, 'one call from A, one from B, nothing after A woke up');
    assert.equal(api.executionsByKey().get(key), 1, 'deleted once');
    // A's batch settles too (by A, or by B after a delay tier), so nothing is left unacked.
    const batchOfA = staleLines(taken.processes.workerA, key)[0]!.batchId;
    await eventually('the batch A held to be settled', () =>
      [taken.processes.workerA, taken.processes.workerB].some((w) => w.lines.some((line) => line.msg === 'batch settled' && line.batchId === batchOfA)),
    );
    const all = Object.values(taken.processes);
    const exits = await Promise.all(all.map((p) => p.stop()));
    for (const [index, exit] of exits.entries()) assert.equal(exit.code, 0, `${all[index]!.label} exits 0`);
    assert.deepEqual(errorsLogged(all), []);
  }

  test('A resumed while B holds the lease and its call is in progress: A is refused, B records', async (t) => {
    t.after(async () => {
      api.configure({ hold: false });
      api.release();
      await stopStarted();
    });
    const taken = await freezeAAndLetBTakeOver('frozen-during');
    const { workerA, workerB } = taken.processes;
    workerA.signal('SIGCONT');
    const stale = await workerA.waitForLine('A to report its stale lease', (line) => staleLines(workerA, taken.key).includes(line));
    assert.equal(stale.outcome, 'uncertain', 'A, frozen past its timeout, timed out when continued');
    assert.equal(taken.callB.finishedAt, 0, "A was refused while B's call was still in progress (the interesting case)");
    const [duringB] = await ledgerRows(bed.pool, [taken.assetId]);
    assert.equal(duringB!.state, 'in_flight', "A's outcome did not end B's claim");
    assert.equal(duringB!.lease_owner, workerB.label, 'B still owns the operation');

    assert.equal(api.release((call) => call.seq === taken.callB.seq), 1, "B's answer released");
    await eventually('B to confirm', async () => (await ledgerRows(bed.pool, [taken.assetId]))[0]!.outcome === 'confirmed', { timeoutMs: 10_000 });
    const settledB = await workerB.waitForLine('B to settle', (line) => line.msg === 'batch settled');
    assert.equal(settledB.confirmed, 1, 'B recorded the confirmation');
    assert.deepEqual(staleLines(workerB, taken.key), [], 'B, the lease owner, was never refused');
    await finish(taken);
  });

  test('A resumed after B recorded: the ledger row stays exactly what B left', async (t) => {
    t.after(async () => {
      api.configure({ hold: false });
      api.release();
      await stopStarted();
    });
    const taken = await freezeAAndLetBTakeOver('frozen-after');
    const { workerA, workerB } = taken.processes;
    assert.equal(api.release((call) => call.seq === taken.callB.seq), 1, "B's answer released (A's stays held)");
    await eventually('B to confirm', async () => (await ledgerRows(bed.pool, [taken.assetId]))[0]!.outcome === 'confirmed', { timeoutMs: 10_000 });
    const [afterB] = await ledgerRows(bed.pool, [taken.assetId]);
    assert.equal(afterB!.lease_owner, null, 'a finished operation has no lease');
    const assetRow = () => bed.pool.query(`SELECT status, updated_at::text FROM media_assets WHERE asset_id = $1`, [taken.assetId]).then((r) => r.rows[0]);
    const markedByB = await assetRow();

    workerA.signal('SIGCONT');
    const stale = await workerA.waitForLine('A to report its stale lease', (line) => staleLines(workerA, taken.key).includes(line));
    assert.equal(stale.outcome, 'uncertain', 'A, frozen past its timeout, timed out when continued');
    assert.deepEqual((await ledgerRows(bed.pool, [taken.assetId]))[0], afterB, 'the ledger row is exactly what B recorded');
    assert.deepEqual(await assetRow(), markedByB, 'A did not touch the asset row');
    assert.deepEqual(staleLines(workerB, taken.key), []);
    await finish(taken);
  });
});
