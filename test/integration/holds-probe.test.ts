import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { parsePolicies } from '../../shared/config/policies';
import { expiringRowsExpiredSql } from '../../shared/db/queries/expiring-rows';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 43 item 3, a promise without a test of its own: "holds are probed only when the policy
 * has any" (noActiveHoldProbedOnlyIfAny, issue 18). The scan's predicate asks once per statement
 * whether the policy has a hold row at all, and only then probes cleanup_holds per row. Read off
 * the real plan with EXPLAIN ANALYZE: the per-row probe (alias `hold`) never runs while the policy
 * has no hold (another policy's holds do not count), and runs once a hold of the policy exists,
 * which then keeps its row out. Without the shortcut the probe runs once per expired row.
 */
let bed: TestBed;
let target: ResolvedTarget;

before(async () => {
  bed = await makeTestBed('holds_probe');
  const yaml = rowDeletePolicyYaml({ batchSize: 10 });
  bed.writePolicies(yaml);
  target = await targetResolve(bed.pool, parsePolicies(yaml, 'test', {}).get('seat-holds')!);
});

after(async () => {
  await bed?.close();
});

interface PlanNode {
  'Relation Name'?: string;
  Alias?: string;
  'Actual Loops'?: number;
  Plans?: PlanNode[];
}

/** The scan's predicate over the table: how many rows pass, and how often the per-row hold probe ran. */
async function scanned(): Promise<{ rows: number; holdProbes: number }> {
  const where = expiringRowsExpiredSql(target, { cutoff: 'clock_timestamp()', policy: '$1', guard: target.guardValues.map((_, index) => `$${index + 2}`) });
  const sql = `SELECT count(*) AS n FROM ${target.table} t WHERE ${where}`;
  const params = ['seat-holds', ...target.guardValues];
  const rows = Number((await bed.pool.query<{ n: string }>(sql, params)).rows[0]!.n);
  const explained = await bed.pool.query<{ 'QUERY PLAN': Array<{ Plan: PlanNode }> }>(`EXPLAIN (ANALYZE, FORMAT JSON) ${sql}`, params);
  let holdProbes = 0;
  const walk = (node: PlanNode): void => {
    if (node['Relation Name'] === 'cleanup_holds' && node.Alias === 'hold') holdProbes += node['Actual Loops'] ?? 0;
    for (const child of node.Plans ?? []) walk(child);
  };
  walk(explained.rows[0]!['QUERY PLAN'][0]!.Plan);
  return { rows, holdProbes };
}

test('the per-row hold probe runs only while the policy has a hold', async () => {
  const { expiredHeld } = await seedHolds(bed.pool, { expiredHeld: 40 });
  assert.deepEqual(await scanned(), { rows: 40, holdProbes: 0 }, 'no hold at all: never probed');

  await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('another-policy', $1, 'theirs', 'test')`, [expiredHeld[0]]);
  assert.deepEqual(await scanned(), { rows: 40, holdProbes: 0 }, "another policy's hold: still never probed");

  await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('seat-holds', $1, 'litigation', 'test')`, [expiredHeld[1]]);
  const held = await scanned();
  assert.equal(held.rows, 39, 'the held row is kept out');
  assert.ok(held.holdProbes >= 1, `a hold of the policy: probed per row (${held.holdProbes} probes)`);
});
