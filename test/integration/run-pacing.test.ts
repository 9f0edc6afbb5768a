import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import pg from 'pg';
import pino from 'pino';
import { ConfirmingPublisher } from '../../shared/amqp/publisher';
import { brokerNames } from '../../shared/amqp/topology';
import { parsePolicies, type RowDeletePolicy } from '../../shared/config/policies';
import { ADAPTIVE, lookLongestMs } from '../../shared/admission/adaptive';
import { admitRows } from '../../shared/admission/rows';
import { makePool } from '../../shared/db/pool';
import { admissionAdaptivePaceRead, admissionOverrideSet, admissionRowsEnsure, admissionSetPaused } from '../../shared/db/queries/admission';
import { targetResolve } from '../../shared/db/queries/target';
import { runsClaimNext, runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { makeMetrics } from '../../shared/observability/metrics';
import { executeRun, type PaceSource, type RunExecutorDeps } from '../../services/scheduler/run-executor';
import { paceFor } from '../../services/scheduler/scheduler';
import { executorSuite } from '../support/executor-suite';
import { combinedPoliciesYaml, rowDeletePolicyYaml, runRow } from '../support/fixtures';
import { seedHolds } from '../support/seed';
import { untilNobodyElse } from '../support/nobody-else';

/**
 * Issue 18: the scheduler paces a run by its workers' adaptive rate while that rate is in force
 * (run-executor.ts paceWindow), so a run's scans are spread over the run instead of all at its
 * start. The real executor, run statements and broker; the rate comes from a function the test
 * controls (the scheduler's reads the admission row: the last test checks that read). What is
 * asserted is the window sizes and that the executor waits (lower bounds on time, which hold on
 * any machine), never a speed.
 */
const POLICY = 'seat-holds';

describe('run pacing by the admitted rate (adaptive, or fixed)', () => {
  const world = executorSuite('run_pacing', [POLICY]);
  const names = () => brokerNames(world.bed.prefix);

  /**
   * Runs one run of `rows` expired holds (batch size 2 unless given) with `rate()` as the admitted rate; returns
   * each window as published (its batches, and the ms since the first window's checkpoint) and the
   * outcome. `onScan` runs before each scan (after any wait), `onWindow` after each window is recorded.
   * `firstTake` (an adaptive policy's): `lastTake()` is the policy's last take as the scheduler reads
   * it (read after `rate()`); `source` replaces the test's pace altogether (the scheduler's own, paceFor).
   */
  async function pacedRun(
    rows: number,
    rate: () => number | null,
    options: {
      batchSize?: number;
      leaseMs?: number;
      policyYaml?: string;
      now?: () => Date;
      firstTake?: PaceSource['firstTake'];
      lastTake?: () => { lastTakeAt: string | null; lastTakeSawOthers: boolean | null };
      source?: (policy: RowDeletePolicy) => PaceSource | null;
      onScan?: (windowsSoFar: number) => Promise<void>;
      onWindow?: (windowsSoFar: number) => void;
      stopping?: () => boolean;
    } = {},
  ): Promise<{ windows: Array<{ batches: number; atMs: number }>; outcome: string; runId: string }> {
    await world.bed.pool.query('DELETE FROM seat_reservations');
    const policy = parsePolicies(`${rowDeletePolicyYaml({ batchSize: options.batchSize ?? 2 })}${options.policyYaml ?? ''}`, 'pacing.yaml', {}).get(POLICY)!;
    const target = await targetResolve(world.bed.pool, policy);
    await seedHolds(world.bed.pool, { expiredHeld: rows });
    const windows: Array<{ batches: number; atMs: number }> = [];
    let firstAt: number | null = null;
    const deps: RunExecutorDeps = {
      pool: world.bed.pool,
      publisher: new ConfirmingPublisher(world.connection),
      names: names(),
      owner: 'scheduler-a',
      leaseMs: options.leaseMs ?? 60_000,
      unroutableFailAfterMs: 60_000,
      log: pino({ level: 'silent' }),
      metrics: makeMetrics([]),
      stopping: options.stopping ?? (() => false),
      batchVersion: async () => 1,
      windowBatches: 16,
      ...(options.now ? { now: options.now } : {}),
      paceBy: (paced) =>
        options.source?.(paced as RowDeletePolicy) ?? {
          read: async () => ({ rate: rate(), ...(options.lastTake ? options.lastTake() : {}) }),
          firstTake: options.firstTake ?? null,
        },
      beforeStep: async (step) => {
        if (step === 'scan') await options.onScan?.(windows.length);
        if (step !== 'checkpoint') return;
        // The window was published and confirmed (the executor's pacing clock starts there): its
        // time is taken before the queue is drained. Taken after the drain, a slow drain of the
        // first window (CI under two busy loops, issue 43) moved the test's zero later than the
        // executor's by more than the slack, and the second window read 447 ms for 667.
        const at = Date.now();
        const published = await world.broker.drain(names().workQueue(POLICY));
        firstAt ??= at;
        windows.push({ batches: published.length, atMs: at - firstAt });
        options.onWindow?.(windows.length);
      },
    };
    const inserted = (await runsInsertIfAbsent(world.bed.pool, { policy: POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const run = (await runsClaimNext(world.bed.pool, deps.owner, deps.leaseMs, [POLICY]))!;
    assert.equal(run.runId, inserted.runId);
    const outcome = await executeRun(deps, run, policy, target);
    return { windows, outcome, runId: inserted.runId };
  }

  test('no rate in force and no first take to wait for: full windows, none paced; every row once', async () => {
    const paced = await pacedRun(100, () => null);
    assert.equal(paced.outcome, 'published');
    // 50 batches in windows of 16 (windowBatches here), one after the other.
    assert.deepEqual(paced.windows.map((window) => window.batches), [16, 16, 16, 2]);
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 100);
  });

  /**
   * An adaptive policy's run with no rate in force (issue 41): its first window is two seconds of
   * the floor (here 2 rows/s: 4 rows, two batches), then the scheduler waits for its workers' first
   * take. Counted in the scheduler's reads of the pace after the first window (1 = the first):
   * `takeAt`, the read that first sees a new take (`sawOthers`: what that take's sample saw);
   * `rateAt` (default `takeAt`), the first read with `rate` in force. `failFirstRead`: the read
   * before the first window fails. The wait's bound is a minute unless given: a run that ends sooner
   * ended its wait at a take, never at the bound. Each read records how many windows were out then.
   */
  async function firstTakeRun(
    rows: number,
    take: { takeAt: number; sawOthers: boolean; rate: number | null; rateAt?: number },
    options: { batchSize?: number; withinMs?: number; failFirstRead?: boolean; holdFirstScanMs?: number } = {},
  ) {
    let windowsSoFar = 0;
    let readsBeforeFirst = 0;
    const readsAfterFirst: Array<{ stamp: string | null; windows: number }> = [];
    // rate() comes first in each read (then lastTake() records it): this read's number is length + 1.
    const readNumber = () => readsAfterFirst.length + 1;
    const paced = await pacedRun(
      rows,
      () => {
        if (windowsSoFar === 0 && options.failFirstRead && readsBeforeFirst++ === 0) throw new Error('the pace read failed');
        return windowsSoFar > 0 && readNumber() >= (take.rateAt ?? take.takeAt) ? take.rate : null;
      },
      {
        ...(options.batchSize ? { batchSize: options.batchSize } : {}),
        firstTake: { rowsPerSecond: options.batchSize ? 500 : 2, withinMs: options.withinMs ?? 60_000 },
        lastTake: () => {
          // The policy took before this run (an earlier run): the stamp the wait starts from.
          if (windowsSoFar === 0) return { lastTakeAt: '2026-12-07T18:00:00.000000Z', lastTakeSawOthers: false };
          const taken = readNumber() >= take.takeAt;
          const stamp = taken ? '2026-12-07T18:00:01.000000Z' : '2026-12-07T18:00:00.000000Z';
          readsAfterFirst.push({ stamp, windows: windowsSoFar });
          return { lastTakeAt: stamp, lastTakeSawOthers: taken ? take.sawOthers : false };
        },
        onWindow: (count) => {
          windowsSoFar = count;
        },
        ...(options.holdFirstScanMs
          ? { onScan: async (windowsBefore: number) => (windowsBefore === 0 ? await new Promise<void>((resolve) => setTimeout(resolve, options.holdFirstScanMs)) : undefined) }
          : {}),
      },
    );
    return { ...paced, readsAfterFirst };
  }

  test('adaptive, alone: the first window is the floor\'s, and a first take that saw nobody lets full windows follow at once', async () => {
    // Before, the first window was full (16,000 rows at batch 500) and went out before the workers
    // had looked: a run's first second doubled a 300 statements/s foreground's p99 (bench figure 7b).
    const paced = await firstTakeRun(100, { takeAt: 3, sawOthers: false, rate: null });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(
      paced.readsAfterFirst.slice(0, 3),
      [
        { stamp: '2026-12-07T18:00:00.000000Z', windows: 1 },
        { stamp: '2026-12-07T18:00:00.000000Z', windows: 1 },
        { stamp: '2026-12-07T18:00:01.000000Z', windows: 1 },
      ],
      'the scheduler read the pace three times with only the first window out: it waited until a take came',
    );
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 16, 16, 16]);
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 100);
  });

  test('adaptive, others present: the first take puts a rate in force; the run is paced from there, the first window counted at it', async () => {
    // Batch 500: the first window is the floor's two seconds, 1,000 rows (two batches). The take
    // comes at the scheduler's second read after it with 1,500 rows/s in force: windows of 6
    // batches (two seconds of it); the first window's 1,000 rows are 0.67 s of it, so the second
    // window goes at once (what was published is then 2.67 s of the rate) and the third waits
    // until 0.67 s, when it is two seconds ahead again.
    const paced = await firstTakeRun(7_000, { takeAt: 2, sawOthers: true, rate: 1_500 }, { batchSize: 500 });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 6, 6]);
    assert.ok(paced.windows[2]!.atMs >= 667 - 150, `the third window waited for the first two's rows at the rate: at ${paced.windows[2]!.atMs} ms`);
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 7_000);
  });

  test('adaptive, a first take that saw others but put no rate in force: the scheduler waits on for the step that does', async () => {
    // A take that decides nothing yet (a rate stepped 5-30 s ago is neither in force nor restarted;
    // the harm law holds until it has durations): before, any take ended the wait, and with no rate
    // in force full windows followed beside a busy application. The take at the second read saw
    // others, the rate (1,500) comes at the fourth: paced from there, as in the test above.
    const paced = await firstTakeRun(7_000, { takeAt: 2, sawOthers: true, rate: 1_500, rateAt: 4 }, { batchSize: 500 });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.readsAfterFirst.slice(0, 4).map((read) => read.windows), [1, 1, 1, 1], 'four reads with only the first window out');
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 6, 6]);
  });

  test('adaptive, no take within the bound (no worker running): full windows once it has passed', async () => {
    const paced = await firstTakeRun(100, { takeAt: Number.POSITIVE_INFINITY, sawOthers: false, rate: null }, { withinMs: 300 });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 16, 16, 16]);
    assert.ok(paced.windows[1]!.atMs >= 300 - 150, `the second window waited out the bound: at ${paced.windows[1]!.atMs} ms`);
  });

  test("adaptive, a first window slow to go out (a slow or retried scan) does not use up the take's bound: its clock starts after the window", async () => {
    // The first scan is held 600 ms, longer than the bound (300 ms); the take comes at the third read
    // after the window (about 100 ms later) with 1,500 rows/s in force. Before, the bound ran from the
    // read before the window: spent at the first read after it, full windows followed ([2, 12]).
    const paced = await firstTakeRun(7_000, { takeAt: 3, sawOthers: true, rate: 1_500 }, { batchSize: 500, withinMs: 300, holdFirstScanMs: 600 });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.readsAfterFirst.slice(0, 3).map((read) => read.windows), [1, 1, 1], 'it waited for the take at the third read');
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 6, 6]);
  });

  test('adaptive, the read before the first window failed: the first good read is the baseline, not a take', async () => {
    // Before, a failed first read left "no take yet" as the baseline, and the policy's existing
    // stamp (an earlier run's take) read as this run's first take at the next good read: "alone".
    const paced = await firstTakeRun(100, { takeAt: 3, sawOthers: false, rate: null }, { failFirstRead: true });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.readsAfterFirst.slice(0, 3).map((read) => read.windows), [1, 1, 1], 'it waited for the take at the third read');
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 16, 16, 16]);
  });

  test('a rate in force: windows of two seconds of it, each published no more than two seconds ahead of it; the lease is kept while waiting', async () => {
    // 10 rows/s, batch 2: windows of 20 rows (10 batches). The first two go at once (two seconds
    // ahead), the third once the first two seconds have passed, the fourth two seconds later.
    const takeovers: unknown[] = [];
    const paced = await pacedRun(80, () => 10, {
      // Shorter than the waits (2 s): only the lease keeper's extensions keep another scheduler out.
      // 1.5 s, extended every 0.5 s: a pause of the test process under 1 s does not lose it.
      leaseMs: 1_500,
      onScan: async (windowsSoFar) => {
        if (windowsSoFar >= 2) takeovers.push(await runsClaimNext(world.bed.pool, 'scheduler-b', 1_500, [POLICY]));
      },
    });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.windows.map((window) => window.batches), [10, 10, 10, 10]);
    const slack = 150; // the first window's own confirm and checkpoint, before its time is taken
    assert.ok(paced.windows[2]!.atMs >= 2_000 - slack, `third window waited for the rate: at ${paced.windows[2]!.atMs} ms`);
    assert.ok(paced.windows[3]!.atMs >= 4_000 - slack, `fourth window waited for the rate: at ${paced.windows[3]!.atMs} ms`);
    // Scans after a wait: the third and fourth windows', and the last one's, which finds nothing more.
    assert.ok(takeovers.length >= 2 && takeovers.every((claimed) => claimed === null), `no other scheduler could claim the run while it waited: ${JSON.stringify(takeovers)}`);
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 80);
  });

  test('a rate raised while the scheduler waits (an operator\'s override) moves what is still due to the new rate: the next window goes out at the first read of it', async () => {
    // 10 rows/s, batch 2: windows of 10 batches, the first two at once (then 4 s of the rate are
    // published). After the second window the rate reads 10,000: what is still due, about 4 s at 10
    // rows/s, is 4 ms at the new rate, so the third window goes at the first read that sees it, in
    // windows of 16 batches (windowBatches). Before, the run waited out the old rate's schedule,
    // reading the rate again every second (the bench's override to finish a run off waited minutes).
    let windowsSoFar = 0;
    const readsBeforeThird: number[] = [];
    const paced = await pacedRun(100, () => {
      const rate = windowsSoFar >= 2 ? 10_000 : 10;
      if (windowsSoFar === 2) readsBeforeThird.push(rate);
      return rate;
    }, {
      onWindow: (count) => {
        windowsSoFar = count;
      },
    });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(readsBeforeThird, [10_000], 'one read of the raised rate, then the third window at once');
    assert.deepEqual(paced.windows.map((window) => window.batches), [10, 10, 16, 14]);
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 100);
  });

  test('rows published unpaced after a rate went stale count from when they went out, not from an earlier unpaced stretch', async () => {
    // Batch 2, windows of 16. The rate read before each window: none (the first window goes out
    // unpaced), 1,000 (counted, the second paced), none again (the third unpaced, published 1.5 s
    // later: the test holds its scan), then 10 rows/s. The third window's 32 rows are 3.2 s at 10
    // rows/s from when they went out, so the fourth waits about 1.2 s (two seconds ahead). Counted
    // from the first stretch's start (the unpaced stretch was never reset), they were due 1.5 s
    // earlier and the fourth went at once.
    let windowsSoFar = 0;
    const rates = [null, 1_000, null, 10];
    const paced = await pacedRun(110, () => rates[Math.min(windowsSoFar, rates.length - 1)] ?? null, {
      onScan: async (count) => {
        if (count === 2) await new Promise((resolve) => setTimeout(resolve, 1_500));
      },
      onWindow: (count) => {
        windowsSoFar = count;
      },
    });
    assert.equal(paced.outcome, 'published');
    assert.deepEqual(paced.windows.map((window) => window.batches), [16, 16, 16, 7]);
    const gapMs = paced.windows[3]!.atMs - paced.windows[2]!.atMs;
    assert.ok(gapMs >= 1_200 - 200, `the fourth window waited for the third's rows at 10 rows/s from when they went out: ${gapMs} ms after it`);
  });

  test('a schedule window that closes while the scheduler waits for the rate: the run stops there, nothing more goes out', async () => {
    // 1 row/s, batch 2: windows of one batch, the first two at once, the third after about 2 s.
    // The policy's window is 00:00-12:00 UTC on a clock the test sets: open until the scheduler's
    // first read of the rate after the second window (made after the loop's own window check),
    // closed from then on, so only a check after the pace's wait can see it. Before, the third
    // window was scanned and published after the close (at a low fixed rate the wait is batch ÷ rate).
    let windowsSoFar = 0;
    let clock = new Date('2026-01-05T11:59:00Z');
    const paced = await pacedRun(10, () => {
      if (windowsSoFar === 2) clock = new Date('2026-01-05T12:00:01Z');
      return 1;
    }, {
      policyYaml: '    window: { start: "00:00", end: "12:00", timeZone: UTC }\n',
      now: () => clock,
      onWindow: (count) => {
        windowsSoFar = count;
      },
    });
    assert.equal(paced.outcome, 'window-closed');
    assert.deepEqual(paced.windows.map((window) => window.batches), [1, 1], 'nothing published once the window closed');
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 4);
  });

  test('a slow rate: windows of one batch; a shutdown during the wait stops at once, the cursor at the last window confirmed', async () => {
    // 0.1 rows/s: each 2-row window is 20 s of the rate ahead; the second would wait 18 s.
    // The shutdown comes during that wait: at the scheduler's fifth look at the flag after the first
    // window (it looks every 100 ms while it waits), not at a time a slow machine might miss.
    let windowsSoFar = 0;
    let looksAfterFirst = 0;
    let stopsSeen = 0;
    const paced = await pacedRun(10, () => 0.1, {
      onWindow: (count) => {
        windowsSoFar = count;
      },
      stopping: () => {
        if (windowsSoFar === 0) return false;
        looksAfterFirst += 1;
        const stop = looksAfterFirst >= 5;
        if (stop) stopsSeen += 1;
        return stop;
      },
    });
    assert.equal(paced.outcome, 'stopped');
    // Stopped at once: the first look that saw the shutdown ended the run, without waiting out the
    // pace (which would have published the second window first) nor looking again.
    assert.equal(stopsSeen, 1, `the run ended at the first look that saw the shutdown (${stopsSeen} looks saw it)`);
    assert.deepEqual(paced.windows.map((window) => window.batches), [1]);
    assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 2);
  });

  test("the rate the scheduler paces a fixed-rate policy by: the file's rate from a run's start, an operator's override once set; a policy with no rate is not paced", async () => {
    // Issue 41: a fixed-rate run was not paced, so its first window (windowBatches, 16,000 rows at
    // batch 500) was scanned, encoded and published whole in its first second at any rate, and that
    // second doubled a 300 statements/s foreground's p99 even at 1 row/s (bench figure 7b).
    const policies = parsePolicies(
      combinedPoliciesYaml(
        rowDeletePolicyYaml({ name: 'fixed-pace' }).replace(/\n$/, '\n    admission: { adaptive: false, rowsPerSecond: 250 }\n'),
        rowDeletePolicyYaml({ name: 'unthrottled-pace' }).replace(/\n$/, '\n    admission: { adaptive: false }\n'),
        rowDeletePolicyYaml({ name: 'adaptive-pace' }),
      ),
      'fixed-pace.yaml',
      {},
    );
    const fixed = paceFor(world.bed.pool, policies.get('fixed-pace')!);
    assert.ok(fixed, 'a fixed-rate policy is paced');
    assert.equal(fixed.firstTake, null, 'a fixed rate is known before any take: no first take to wait for');
    assert.equal((await fixed.read()).rate, 250, "the file's rate, before any worker took");
    await admissionOverrideSet(world.bed.pool, { policy: 'fixed-pace', rate: 4_000, setBy: 'run-pacing test' });
    assert.equal((await fixed.read()).rate, 4_000, "an operator's override, read afresh");
    assert.equal(paceFor(world.bed.pool, policies.get('unthrottled-pace')!), null, 'no rate: not paced');
    const adaptive = paceFor(world.bed.pool, policies.get('adaptive-pace')!);
    assert.ok(adaptive, 'an adaptive policy is paced by its rate in force');
    assert.deepEqual(adaptive.firstTake, { rowsPerSecond: ADAPTIVE.floorRowsPerSecond, withinMs: lookLongestMs('load') + 1_000 }, "its first window is the floor's, and waits for a take");
    assert.equal((await adaptive.read()).rate, null, 'no rate in force before its workers step it');
  });

  test('the rate the scheduler paces by: the policy\'s adaptive rate while workers stepped it lately; none when never stepped or not lately', async () => {
    const rateOf = async (policy: string) => (await admissionAdaptivePaceRead(world.bed.pool, policy, 5)).rate;
    await admissionRowsEnsure(world.bed.pool, 'paced-policy', 1_000);
    assert.equal(await rateOf('paced-policy'), null, 'never stepped');
    assert.equal((await admissionAdaptivePaceRead(world.bed.pool, 'paced-policy', 5)).lastTakeAt, null, 'a row made for a take not yet sent is no take');
    assert.deepEqual(await admissionAdaptivePaceRead(world.bed.pool, 'no-such-policy', 5), { rate: null, lastTakeAt: null, lastTakeSawOthers: null }, 'no admission row');
    // A policy's very first take stores the start rate and its time, with no pressure, alone too.
    // (As the take statement writes it: the rate, its time, and the take's own stamp, taken_at.)
    await world.bed.pool.query(
      `UPDATE cleanup_admission SET adaptive_rate = ${ADAPTIVE.startRowsPerSecond}, adapted_at = clock_timestamp(), taken_at = clock_timestamp(), taken_saw_others = false WHERE policy = 'paced-policy'`,
    );
    assert.equal(await rateOf('paced-policy'), null, 'the first take only: not a step');
    assert.ok((await admissionAdaptivePaceRead(world.bed.pool, 'paced-policy', 5)).lastTakeAt, 'but a take');
    await world.bed.pool.query(`UPDATE cleanup_admission SET adaptive_rate = 750, adaptive_pressure = 2.4, adapted_at = clock_timestamp() WHERE policy = 'paced-policy'`);
    assert.equal(await rateOf('paced-policy'), 750, 'stepped just now');
    await world.bed.pool.query(`UPDATE cleanup_admission SET adapted_at = clock_timestamp() - interval '6 seconds' WHERE policy = 'paced-policy'`);
    assert.equal(await rateOf('paced-policy'), null, 'stepped 6 s ago: not in force');
  });

  /**
   * The scheduler's own pace (paceFor, its real read of the admission row) and a real worker's
   * first take (admitRows through a reaper-named pool, started when the first window is recorded),
   * batch 500: the first window is the floor's two seconds (1,000 rows, two batches). The bound on
   * the wait is a minute here: a run that goes on sooner went on at the take.
   */
  async function withRealFirstTake(rows: number): Promise<{ windows: Array<{ batches: number; atMs: number }>; outcome: string; runId: string; stored: { rate: number; inForce: number | null } }> {
    const workerPool = makePool(world.bed.databaseUrl, 2, 'reaper-worker-run-pacing');
    let take: Promise<unknown> | null = null;
    try {
      const paced = await pacedRun(rows, () => null, {
        batchSize: 500,
        source: (policy) => {
          const real = paceFor(world.bed.pool, policy)!;
          return { ...real, firstTake: { ...real.firstTake!, withinMs: 60_000 } };
        },
        onWindow: (count) => {
          if (count !== 1) return;
          const policy = parsePolicies(rowDeletePolicyYaml({ batchSize: 500 }), 'pacing.yaml', {}).get(POLICY) as RowDeletePolicy;
          take = admitRows(workerPool, policy, 500, { holdMs: 10_000 });
        },
      });
      assert.ok(take, 'the worker took');
      assert.equal(((await take) as { admitted: boolean }).admitted, true);
      const stored = (await world.bed.pool.query<{ rate: number }>(`SELECT adaptive_rate AS rate FROM cleanup_admission WHERE policy = $1`, [POLICY])).rows[0]!;
      return { ...paced, stored: { rate: stored.rate, inForce: (await admissionAdaptivePaceRead(world.bed.pool, POLICY, 5)).rate } };
    } finally {
      await workerPool.end();
    }
  }

  test("the scheduler's own pace, a real worker alone: its first take ends the wait, full windows follow", async () => {
    await world.bed.pool.query('DELETE FROM cleanup_admission WHERE policy = $1', [POLICY]); // a new policy
    await untilNobodyElse(world.bed.databaseUrl);
    const paced = await withRealFirstTake(20_000);
    assert.equal(paced.outcome, 'published');
    assert.equal(paced.stored.inForce, null, 'alone: no rate in force');
    assert.deepEqual(paced.windows.map((window) => window.batches), [2, 16, 16, 6]);
    assert.ok(paced.windows[1]!.atMs < 10_000, `the second window went at the take, far within the minute's bound: at ${paced.windows[1]!.atMs} ms`);
  });

  test("the scheduler's own pace, a real worker beside an application: its first take puts a rate in force and the run is paced by it", async () => {
    await world.bed.pool.query('DELETE FROM cleanup_admission WHERE policy = $1', [POLICY]);
    // An application in a transaction (not reaper-named): the worker's look sees somebody.
    const application = new pg.Client({ connectionString: world.bed.databaseUrl, application_name: 'seat-app-run-pacing' });
    await application.connect();
    try {
      await application.query('BEGIN');
      await application.query('SELECT 1');
      // 6,000 rows: at the look's rate (2,000 rows/s beside a session in a transaction) the run is out
      // well within the 5 s its one step stays in force.
      const paced = await withRealFirstTake(6_000);
      assert.equal(paced.outcome, 'published');
      assert.ok(paced.stored.inForce !== null && paced.stored.inForce <= ADAPTIVE.startRowsPerSecond / 4, `a gentle rate in force: ${JSON.stringify(paced.stored)}`);
      assert.equal(paced.windows[0]!.batches, 2, "the first window: the floor's two seconds");
      assert.ok(paced.windows.length >= 3, `more than two windows: ${JSON.stringify(paced.windows)}`);
      assert.ok(paced.windows.every((window) => window.batches < 16), `every window paced (less than full): ${JSON.stringify(paced.windows)}`);
      assert.equal((await runRow(world.bed.pool, paced.runId)).candidates, 6_000);
    } finally {
      await application.query('ROLLBACK').catch(() => undefined);
      await application.end();
    }
  });

  test("a worker's real first take of a new policy, alone on the database, does not put a rate in force (it stores the start rate and its time, no step)", async () => {
    // The defect a1b2c4b fixed: the scheduler read this as 20,000 rows/s in force and held two
    // workers alone to it (cost figure: end to end / pg-boss 0.55 instead of 1.11).
    const policy = parsePolicies(rowDeletePolicyYaml({ name: 'first-take', batchSize: 50 }), 'first-take.yaml', {}).get('first-take') as RowDeletePolicy;
    const pool = makePool(world.bed.databaseUrl, 2, 'reaper-worker-first-take');
    try {
      await untilNobodyElse(world.bed.databaseUrl); // alone: an earlier test's application would read as one
      assert.ok((await admitRows(pool, policy, 10, { holdMs: 5_000 })).admitted);
    } finally {
      await pool.end();
    }
    const stored = (await world.bed.pool.query<{ rate: number; fresh: boolean }>(
      `SELECT adaptive_rate AS rate, adapted_at > clock_timestamp() - interval '5 seconds' AS fresh FROM cleanup_admission WHERE policy = 'first-take'`,
    )).rows[0]!;
    assert.deepEqual(stored, { rate: ADAPTIVE.startRowsPerSecond, fresh: true }, 'the first take stored the start rate just now');
    const read = await admissionAdaptivePaceRead(world.bed.pool, 'first-take', 5);
    assert.equal(read.rate, null, 'not a rate in force');
    assert.ok(read.lastTakeAt !== null && read.lastTakeSawOthers === false, `but a take, which saw nobody: ${JSON.stringify(read)}`);

    // A pause and a resume write the row too (updated_at), and are not takes: a run waiting for its
    // workers' first take must not read them as one (before migration 32 the stamp was updated_at,
    // and an operator's pause during the wait ended it as "alone").
    await admissionSetPaused(world.bed.pool, ['first-take'], true, new Map([['first-take', 10]]));
    await admissionSetPaused(world.bed.pool, ['first-take'], false, new Map([['first-take', 10]]));
    const afterPause = await admissionAdaptivePaceRead(world.bed.pool, 'first-take', 5);
    assert.equal(afterPause.lastTakeAt, read.lastTakeAt, 'a pause and a resume leave the last take as it was');
  });
});
