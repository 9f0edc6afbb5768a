import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { parsePolicies } from '../../shared/config/policies';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { holdsAdd } from '../../shared/db/queries/holds';
import { BRAKE_COUNT_CAP, planBrakeCount } from '../../shared/db/queries/plan';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { databaseNowIso, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * The brake's count is bounded (issue 17 item 4): it walks the scan's order and stops at the cap
 * (it only needs "over the limit or not" and a count to approve), counts from the run's cursor
 * (what is still to publish), leaves held rows out like the scan, and takes the base of
 * maxFractionPerRun from the planner's estimate once the guarded rows pass the cap.
 */
describe('the brake count, bounded', () => {
  let bed: TestBed;
  let target: ResolvedTarget;

  before(async () => {
    bed = await makeTestBed('brake_count');
    const policy = parsePolicies(rowDeletePolicyYaml({ limits: { maxPerRun: 10 } }), 'brake-count.yaml', {}).get('seat-holds')!;
    target = await targetResolve(bed.pool, policy);
  });
  after(async () => {
    await bed?.close();
  });

  test('candidates stop at the cap; the guarded base becomes an estimate past it; holds and the cursor narrow the count', async () => {
    const seeded = await seedHolds(bed.pool, { expiredHeld: 50, futureHeld: 30, expiredConfirmed: 5 });
    await bed.pool.query('ANALYZE seat_reservations');
    const cutoff = await databaseNowIso(bed.pool);
    const exact = await planBrakeCount(bed.pool, target, { cutoff, after: null, guarded: true });
    assert.deepEqual(exact, { candidates: 50, candidatesCapped: false, guarded: 80, guardedEstimated: false });
    assert.ok(BRAKE_COUNT_CAP >= 100_000, 'the production cap leaves room for real limits');

    const capped = await planBrakeCount(bed.pool, target, { cutoff, after: null, guarded: true, cap: 20 });
    assert.equal(capped.candidates, 20);
    assert.equal(capped.candidatesCapped, true, 'says "at least"');
    assert.equal(capped.guardedEstimated, true);
    assert.ok(capped.guarded! >= 20, `the estimate is never below the cap (${capped.guarded})`);

    await holdsAdd(bed.pool, target, { ids: [seeded.expiredHeld[0]!], reason: 'legal', until: null, createdBy: 'test' });
    const afterHold = await planBrakeCount(bed.pool, target, { cutoff, after: null, guarded: false });
    assert.deepEqual(afterHold, { candidates: 49, candidatesCapped: false, guarded: null, guardedEstimated: false }, 'a held row is not a candidate');
    const page = await bed.pool.query<{ expiry: string; key: string }>(
      `SELECT reaper_iso(expires_at) AS expiry, reservation_id::text AS key FROM seat_reservations WHERE status = 'held' AND expires_at <= $1
       ORDER BY expires_at, reservation_id OFFSET 9 LIMIT 1`,
      [cutoff],
    );
    const rest = await planBrakeCount(bed.pool, target, { cutoff, after: page.rows[0]!, guarded: false });
    assert.equal(rest.candidates, 40, 'what is still to publish after the cursor (the held row is the first, before it)');
  });
});
