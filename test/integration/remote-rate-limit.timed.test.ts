import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { type MediaApi } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import {
  assertRetention,
  closeRemoteWorld,
  openRemoteWorld,
  allConfirmed,
  callsByKey,
  errorsLogged,
  ledgerRows,
  MEDIA_POLICY,
  seedAssets,
  startRemoteServices,
} from '../support/remote-helpers';
import type { TestBed } from '../support/testbed';

/**
 * docs/design.md invariant 9 with real processes: three workers share ONE token bucket (R calls/s,
 * burst B) and ONE concurrency cap (C), kept in PostgreSQL. With a backlog of 5·R assets the
 * stand-in API never sees more than R + B calls starting in any one-second window nor more than C
 * at once, and while there is backlog the achieved rate is close to R (not a fraction of it).
 */
const R = 40;
const BURST = 5;
const C = 4;
const BACKLOG = 5 * R;
/** Each call takes this long at the stand-in, so the concurrency cap is exercised. */
const SLOW_MS = 50;

describe('remote-delete: global rate and concurrency across three workers', () => {
  let bed: TestBed;
  let api: MediaApi;

  before(async () => {
    ({ bed, api } = await openRemoteWorld('remote_rate', { ratePerSecond: R, burst: BURST, concurrency: C, batchSize: 10, timeoutMs: 2000, leaseMs: 12_000 }, { slowMs: SLOW_MS }));
  });

  after(() => closeRemoteWorld({ bed, api }));

  test(`a backlog of ${BACKLOG} assets drains at ~${R}/s, never above ${R}+${BURST} per second nor ${C} at once`, async () => {
    const ids = await seedAssets(bed.pool, 'rate', BACKLOG);
    const { workers, all } = await startRemoteServices(bed, { scheduler: 'rate-scheduler', workers: ['rate-worker-1', 'rate-worker-2', 'rate-worker-3'] });

    const trigger = await runReaperCli(['trigger', MEDIA_POLICY], bed.processEnv());
    assert.equal(trigger.code, 0, trigger.stdout);

    await allConfirmed({ bed, api }, BACKLOG, 40_000);

    const starts = api.calls.map((call) => call.startedAt).sort((a, b) => a - b);
    const spanMs = starts[starts.length - 1]! - starts[0]!;
    // The first BURST calls ride on the full bucket; the rest arrive at the refill rate.
    const sustainedRate = (starts.length - BURST) / (spanMs / 1000);
    const perWorker = Object.fromEntries(
      workers.map((w) => [w.label, w.lines.filter((l) => l.msg === 'batch settled' || l.msg === 'batch delayed').length]),
    );
    console.log(
      `[remote-rate-limit] calls=${api.calls.length} span=${spanMs} ms sustained=${sustainedRate.toFixed(1)}/s ` +
        `ratio=${(sustainedRate / R).toFixed(2)} maxIn1s=${api.maxCallsInWindow(1000)} (limit ${R + BURST}) ` +
        `maxConcurrent=${api.maxConcurrent()} (limit ${C}) batch-log-lines-per-worker=${JSON.stringify(perWorker)}`,
    );

    let busiest = { fromMs: 0, calls: 0 };
    for (let lo = 0, hi = 0; hi < starts.length; hi++) {
      while (starts[hi]! - starts[lo]! >= 1000) lo++;
      if (hi - lo + 1 > busiest.calls) busiest = { fromMs: starts[lo]! - starts[0]!, calls: hi - lo + 1 };
    }
    console.log(`[remote-rate-limit] busiest 1 s window starts at +${busiest.fromMs} ms with ${busiest.calls} calls`);
    if (process.env.TEST_TIMELINE) {
      // Calls started per 250 ms, and the workers' admission verdicts (with TEST_LOG_LEVEL=debug).
      const slots = new Map<number, number>();
      for (const start of starts) slots.set(Math.floor((start - starts[0]!) / 250), (slots.get(Math.floor((start - starts[0]!) / 250)) ?? 0) + 1);
      console.log([...slots].map(([slot, n]) => `${slot * 250}ms:${n}`).join(' '));
      const verdicts: Record<string, number> = {};
      for (const line of workers.flatMap((w) => w.lines)) if (line.verdict) verdicts[String(line.verdict)] = (verdicts[String(line.verdict)] ?? 0) + 1;
      console.log(`verdicts: ${JSON.stringify(verdicts)}`);
    }
    assert.ok(api.maxCallsInWindow(1000) <= R + BURST, `at most R + burst = ${R + BURST} calls in any 1 s window, saw ${api.maxCallsInWindow(1000)}`);
    assert.ok(api.maxConcurrent() <= C, `at most C = ${C} calls at once, saw ${api.maxConcurrent()}`);
    assert.ok(sustainedRate >= 0.75 * R, `achieved rate ${sustainedRate.toFixed(1)}/s should be close to R = ${R}/s (>= ${0.75 * R})`);

    // Every asset deleted exactly once, with one call each: no failure was injected.
    const executions = api.executionsByKey();
    const rows = await ledgerRows(bed.pool);
    assert.equal(rows.length, BACKLOG, 'one operation per asset');
    assert.deepEqual(rows.map((row) => row.asset_id).sort(), ids);
    for (const row of rows) assert.equal(executions.get(row.operation_key), 1, `${row.operation_key} executed once`);
    const byKey = callsByKey(api);
    assert.equal(byKey.size, BACKLOG, 'every call carried its operation key');
    for (const [key, calls] of byKey) assert.equal(calls.length, 1, `${key}: one call, no retry without a failure`);
    assertRetention(rows);
    for (const row of rows) assert.equal(row.attempt_count, 1, `${row.operation_key}: one cleanup attempt`);

    // All three workers took part: the limits held across processes, not within one.
    for (const worker of workers) assert.ok(perWorker[worker.label]! > 0, `${worker.label} handled batches too: ${JSON.stringify(perWorker)}`);

    const status = (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM media_assets WHERE status = 'deleted'`)).rows[0]!.n;
    assert.equal(status, BACKLOG, 'every asset row marked deleted (markConfirmed)');

    const exits = await Promise.all(all.map((p) => p.stop()));
    for (const [index, exit] of exits.entries()) assert.equal(exit.code, 0, `${all[index]!.label} drains and exits 0`);
    assert.deepEqual(errorsLogged(all), []);
  });
});
