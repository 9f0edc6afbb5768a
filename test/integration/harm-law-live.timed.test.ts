import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type pg from 'pg';
import { ADAPTIVE, HARM } from '../../shared/admission/adaptive';
import { admitRows } from '../../shared/admission/rows';
import { parsePolicies, type RowDeletePolicy } from '../../shared/config/policies';
import { makePool } from '../../shared/db/pool';
import { eventually } from '../support/eventually';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The opt-in harm law (admission: { law: harm }, docs/design.md "The harm law") stepping on a real
 * database. A file of its own, timed (test/run.js: two at once on an idle machine, one on a busy
 * one): the law reads the others' statement durations, and with five files at once on two cores
 * an application's 5 ms pg_sleep stretches by the machine's scheduling, which the law reads as
 * harm and holds on. In adaptive-admission.test.ts it took 5.6 s alone and timed out at 20 s in
 * the parallel group (npm test, 2026-12-07: the rate at 1,427 of the 2,000 asked, pressure 0.99).
 */
describe('the harm law on a real database', () => {
  let bed: TestBed;
  const pools: pg.Pool[] = [];
  const workerPool = (name: string): pg.Pool => {
    // "reaper-..." like a worker's pool: the law leaves reaper's own backends out of the others.
    const pool = makePool(bed.databaseUrl, 2, `reaper-adaptive-${name}`);
    pools.push(pool);
    return pool;
  };

  before(async () => {
    bed = await makeTestBed('harm_law_live');
  });

  after(async () => {
    await Promise.all(pools.map((pool) => pool.end()));
    await bed?.close();
  });

  test('the harm law on a real database: beside an application whose statements keep their duration the rate climbs from the floor; when they take four times longer it backs off and stores that harm', async () => {
    const policy = parsePolicies(`${rowDeletePolicyYaml({ name: 'harm-steps', batchSize: 50 })}    admission: { law: harm }\n`, 'test', {}).get('harm-steps') as RowDeletePolicy;
    // The test's own polls run as "reaper-..." so the law does not count them among the application's statements.
    const observer = workerPool('harm-steps-observer');
    const stored = async (): Promise<{ rate: number; pressure: number | null }> =>
      (await observer.query<{ rate: number; pressure: number | null }>('SELECT adaptive_rate AS rate, adaptive_pressure AS pressure FROM cleanup_admission WHERE policy = $1', [policy.name])).rows[0]!;
    const applicationPool = makePool(bed.databaseUrl, 2, 'application-harm-steps');
    pools.push(applicationPool);
    // The application: two sessions, each running statements of `sleep` seconds one after another.
    let sleep = 0.005;
    let running = true;
    const loops = [0, 1].map(async () => {
      const client = await applicationPool.connect();
      try {
        while (running) await client.query('SELECT pg_sleep($1)', [sleep]);
      } finally {
        client.release();
      }
    });
    const worker = workerPool('harm-steps');
    // The worker asks as a run would, one group of 50 rows after another.
    let asking = true;
    const asks = (async () => {
      while (asking) await admitRows(worker, policy, 50, { holdMs: 2_000 });
    })();
    try {
      await eventually('the first take at the floor', async () => (await observer.query('SELECT 1 FROM cleanup_admission WHERE policy = $1 AND adaptive_rate IS NOT NULL', [policy.name])).rowCount === 1, { timeoutMs: 10_000, intervalMs: 20 });
      assert.equal((await stored()).rate, ADAPTIVE.floorRowsPerSecond, 'beside the application: the floor');
      const peak = await eventually(
        'the rate to climb while the durations stay',
        async () => {
          const now = await stored();
          return now.rate >= 4 * ADAPTIVE.floorRowsPerSecond ? now.rate : undefined;
        },
        { timeoutMs: 20_000, intervalMs: 50, describe: stored },
      );
      sleep = 0.02;
      const harmed = await eventually(
        'the rate to back off while the statements take four times longer',
        async () => {
          const now = await stored();
          return now.rate < peak && now.pressure !== null && now.pressure > HARM.target ? now : undefined;
        },
        { timeoutMs: 20_000, intervalMs: 50, describe: stored },
      );
      assert.ok(harmed.pressure! > 2, `the stored pressure is the harm, about 4: ${harmed.pressure}`);
    } finally {
      asking = false;
      running = false;
      await asks;
      await Promise.all(loops);
    }
  });
});
