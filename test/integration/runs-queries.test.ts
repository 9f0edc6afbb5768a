import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import {
  runClaimOf,
  runsClaimNext,
  runsExtendLease,
  runsInsertIfAbsent,
  runsMarkFailed,
  runsMarkPublished,
  runsRecordProgress,
  runsReleaseLease,
  runsSettlePublished,
  type Run,
} from '../../shared/db/queries/runs';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The run statements against the real database: fencing by claim number (issue 7 item 7), a
 * checkpoint that counts once when retried (item 17), and the bounded completion pass that ends
 * runs which can never complete as `incomplete` (item 13).
 */
describe('run statements', () => {
  let bed: TestBed;

  before(async () => {
    bed = await makeTestBed('runs_queries');
  });
  after(async () => {
    await bed?.close();
  });

  const LEASE_MS = 60_000;
  let policySeq = 0;
  const newRun = async (): Promise<string> => {
    const run = await runsInsertIfAbsent(bed.pool, { policy: `policy-${++policySeq}`, trigger: 'manual', scheduledFor: null, cutoff: null });
    return run!.runId;
  };
  const claimAs = async (owner: string, runId: string): Promise<Run> => {
    const policy = (await bed.pool.query<{ policy: string }>('SELECT policy FROM cleanup_runs WHERE run_id = $1', [runId])).rows[0]!.policy;
    const run = await runsClaimNext(bed.pool, owner, LEASE_MS, [policy]);
    assert.ok(run, `${owner} claims the run`);
    assert.equal(run.runId, runId);
    return run;
  };
  /** The lease runs out (a scheduler frozen, or its clock of work simply too long). */
  const expireLease = (runId: string) => bed.pool.query(`UPDATE cleanup_runs SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE run_id = $1`, [runId]);
  const row = async (runId: string) =>
    (
      await bed.pool.query<{ state: string; candidates: number; skipped: number; batches_confirmed: number; claim_count: number; cursor_key: string | null; error: string | null; lease_ms: number | null }>(
        `SELECT state, candidates::int, skipped::int, batches_confirmed, claim_count, cursor_key, error,
           (extract(epoch FROM lease_expires_at - clock_timestamp()) * 1000)::int AS lease_ms
         FROM cleanup_runs WHERE run_id = $1`,
        [runId],
      )
    ).rows[0]!;
  const cursor = (n: number) => ({ expiry: `2026-01-01T00:00:0${n}.000001Z`, key: `key-${n}` });

  test('two schedulers with the same worker id: the older claim can no longer checkpoint, extend, release, publish or fail the run', async () => {
    const runId = await newRun();
    const first = runClaimOf(await claimAs('same-id', runId), 'same-id');
    await expireLease(runId);
    const second = runClaimOf(await claimAs('same-id', runId), 'same-id');
    assert.deepEqual([first.claim, second.claim], [1, 2]);

    const window = { from: null, cursor: cursor(1), totals: { candidates: 10, skipped: 0, batchesConfirmed: 1 }, batchIds: [`${runId}:000001`], leaseMs: LEASE_MS };
    assert.equal(await runsRecordProgress(bed.pool, { claim: first, ...window }), false, 'the old claim cannot checkpoint');
    assert.equal(await runsExtendLease(bed.pool, first, LEASE_MS), false, 'the old claim cannot extend the lease');
    const leaseBefore = (await row(runId)).lease_ms!;
    await runsReleaseLease(bed.pool, first);
    assert.ok((await row(runId)).lease_ms! > leaseBefore - 5_000, 'the old claim cannot hand the run over');
    assert.equal(await runsMarkPublished(bed.pool, first), false, 'the old claim cannot publish');
    assert.equal(await runsMarkFailed(bed.pool, first, 'not mine'), false, 'the old claim cannot fail');
    assert.deepEqual(
      { state: (await row(runId)).state, candidates: (await row(runId)).candidates, error: (await row(runId)).error },
      { state: 'scanning', candidates: 0, error: null },
      'nothing the old claim did changed the run',
    );

    assert.equal(await runsRecordProgress(bed.pool, { claim: second, ...window }), true, 'the current claim checkpoints');
    assert.equal(await runsMarkPublished(bed.pool, second), true, 'and publishes');
  });

  test('runsRecordProgress called twice with the same window (the answer to the first was lost) counts once', async () => {
    const runId = await newRun();
    const claim = runClaimOf(await claimAs('scheduler-a', runId), 'scheduler-a');
    const firstWindow = {
      claim,
      from: null,
      cursor: cursor(1),
      totals: { candidates: 100, skipped: 3, batchesConfirmed: 2 },
      batchIds: [`${runId}:000001`, `${runId}:000002`],
      leaseMs: LEASE_MS,
    };
    assert.equal(await runsRecordProgress(bed.pool, firstWindow), true);
    assert.equal(await runsRecordProgress(bed.pool, firstWindow), true, 'the retry succeeds: the progress is there');
    let now = await row(runId);
    assert.deepEqual([now.candidates, now.skipped, now.batches_confirmed, now.cursor_key], [100, 3, 2, 'key-1'], 'counted once');
    assert.equal(
      (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_run_batches WHERE run_id = $1', [runId])).rows[0]!.n,
      2,
    );

    const secondWindow = { ...firstWindow, from: cursor(1), cursor: cursor(2), totals: { candidates: 150, skipped: 3, batchesConfirmed: 3 }, batchIds: [`${runId}:000003`] };
    assert.equal(await runsRecordProgress(bed.pool, secondWindow), true);
    assert.equal(await runsRecordProgress(bed.pool, secondWindow), true);
    now = await row(runId);
    assert.deepEqual([now.candidates, now.batches_confirmed, now.cursor_key], [150, 3, 'key-2'], 'the second window counted once too');
    // A window that is neither the next one nor the last recorded one is not this claim's progress.
    assert.equal(await runsRecordProgress(bed.pool, firstWindow), false, 'a stale window does not move the run back');
    assert.equal((await row(runId)).candidates, 150);
  });

  test('the completion pass: complete when every batch has a receipt, incomplete after a time without progress, bounded per pass', async () => {
    // Three published runs with two checkpointed batches each.
    const publish = async (receipts: number, publishedAgo: string): Promise<string> => {
      const runId = await newRun();
      const claim = runClaimOf(await claimAs('scheduler-a', runId), 'scheduler-a');
      const batchIds = [`${runId}:000001`, `${runId}:000002`];
      await runsRecordProgress(bed.pool, { claim, from: null, cursor: cursor(1), totals: { candidates: 20, skipped: 0, batchesConfirmed: 2 }, batchIds, leaseMs: LEASE_MS });
      await runsMarkPublished(bed.pool, claim);
      await bed.pool.query(`UPDATE cleanup_runs SET published_at = clock_timestamp() - $2::interval WHERE run_id = $1`, [runId, publishedAgo]);
      for (const batchId of batchIds.slice(0, receipts)) {
        await bed.pool.query(
          `INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id, completed_at)
           VALUES ($1, $2, 'p', 10, 10, 0, 'w', clock_timestamp() - $3::interval)`,
          [batchId, runId, publishedAgo],
        );
      }
      return runId;
    };
    const done = await publish(2, '1 hour');
    const stuck = await publish(1, '1 hour');
    const fresh = await publish(0, '1 second');
    const checked = await runsSettlePublished(bed.pool, { limit: 100, incompleteAfterMs: 60_000 });
    const byRun = new Map(checked.map((c) => [c.runId, c]));
    assert.equal(byRun.get(done)?.state, 'completed');
    assert.deepEqual(byRun.get(stuck), { runId: stuck, policy: byRun.get(stuck)!.policy, state: 'incomplete', batchesConfirmed: 2, batchesMissing: 1, moreToWalk: false });
    assert.equal(byRun.get(fresh)?.state, 'published', 'a run still within the time without progress waits');
    const stuckRow = await row(stuck);
    assert.equal(stuckRow.state, 'incomplete');
    assert.match(stuckRow.error!, /^1 of 2 batches have no receipt/);
    assert.equal((await row(done)).state, 'completed');
    assert.equal((await row(fresh)).state, 'published');

    // Bounded: 40 more published runs; a pass with limit 10 looks at 10, and the passes go round.
    await bed.pool.query(
      `INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, state, published_at)
       SELECT gen_random_uuid(), 'bulk-' || i, 'manual', clock_timestamp(), clock_timestamp(), 'published', clock_timestamp()
       FROM generate_series(1, 40) i`,
    );
    const seen = new Set<string>();
    for (let pass = 0; pass < 5; pass++) {
      const looked = await runsSettlePublished(bed.pool, { limit: 10, incompleteAfterMs: 60_000 });
      assert.ok(looked.length <= 10, `a pass looks at no more than its limit (got ${looked.length})`);
      for (const run of looked) seen.add(run.runId);
    }
    // No batches: every bulk run completes at its first look. 40 bulk runs plus the ones still
    // published from before (`fresh`, one from the fencing test) fit in five passes of ten.
    const leftPublished = (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_runs WHERE policy LIKE 'bulk-%' AND state = 'published'`)).rows[0]!.n;
    assert.equal(leftPublished, 0, 'round robin: every published run is looked at within a few passes');
    assert.ok(seen.has(fresh), 'including the one still waiting, again');
  });
});
