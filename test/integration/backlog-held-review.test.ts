/**
 * Issue 40, item 4: "a legal hold pages forever". The backlog gauges counted expired rows that
 * satisfy the guard whether a hold kept them or not, and remote assets whose operation ended
 * rejected: with one held expired row reaper_eligible_rows stayed 1 and the oldest-eligible age
 * climbed until BacklogAgeHigh fired and never cleared. Eligible now means what the scan may
 * delete; held rows and rows in review are counted apart (reaper_held_rows, reaper_review_rows).
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { parsePolicies, type Policy } from '../../shared/config/policies';
import { targetBacklogRead } from '../../shared/db/queries/backlog';
import { targetResolve } from '../../shared/db/queries/target';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { currentKeyOf, MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

let bed: TestBed;
let policies: ReadonlyMap<string, Policy>;

before(async () => {
  bed = await makeTestBed('backlog_held_review');
  const yaml = combinedPoliciesYaml(
    rowDeletePolicyYaml({ batchSize: 20 }),
    mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 10, burst: 5, concurrency: 2 }),
  );
  bed.writePolicies(yaml);
  policies = parsePolicies(yaml, 'test-policies.yaml', {});
});

after(async () => {
  await bed?.close();
});

test('row-delete: a row under a legal hold is held, not eligible; the age is the oldest deletable row', async () => {
  const target = await targetResolve(bed.pool, policies.get('seat-holds')!);
  const { expiredHeld: [heldId, freeId] } = await seedHolds(bed.pool, { expiredHeld: 2 });
  // The held row is the older one: its age must not be the gauge's.
  await bed.pool.query(`UPDATE seat_reservations SET expires_at = now() - interval '2 hours' WHERE reservation_id = $1`, [heldId]);
  await bed.pool.query(`UPDATE seat_reservations SET expires_at = now() - interval '1 minute' WHERE reservation_id = $1`, [freeId]);
  await bed.pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ('seat-holds', $1, 'litigation', 'test')`, [heldId]);

  const both = await targetBacklogRead(bed.pool, target);
  assert.equal(both.eligibleRows, 1, JSON.stringify(both));
  assert.equal(both.heldRows, 1, JSON.stringify(both));
  assert.equal(both.reviewRows, 0);
  assert.ok(both.oldestEligibleAgeSeconds < 600, `the age is the free row's, about a minute (${both.oldestEligibleAgeSeconds} s)`);

  // Once the free row is gone only the held one remains: nothing to page about.
  await bed.pool.query(`DELETE FROM seat_reservations WHERE reservation_id = $1`, [freeId]);
  const heldOnly = await targetBacklogRead(bed.pool, target);
  assert.deepEqual(heldOnly, { oldestEligibleAgeSeconds: 0, eligibleRows: 0, heldRows: 1, reviewRows: 0 });

  // The hold ends (held_until passed): the row is eligible again.
  await bed.pool.query(`UPDATE cleanup_holds SET held_until = now() - interval '1 second' WHERE key = $1`, [heldId]);
  const released = await targetBacklogRead(bed.pool, target);
  assert.equal(released.eligibleRows, 1);
  assert.equal(released.heldRows, 0);
  assert.ok(released.oldestEligibleAgeSeconds > 7_000, `the released row ages the gauge again (${released.oldestEligibleAgeSeconds} s)`);
});

test('remote-delete: an asset whose operation ended rejected or gave-up is in review, not eligible', async () => {
  const target = await targetResolve(bed.pool, policies.get(MEDIA_POLICY)!);
  const [rejected, gaveUp, waiting] = await seedAssets(bed.pool, 'review', 3);
  for (const [id, outcome] of [[rejected!, 'rejected'], [gaveUp!, 'gave-up']] as const) {
    const key = await currentKeyOf(bed.pool, id);
    await bed.pool.query(
      `INSERT INTO cleanup_ledger (operation_key, policy, asset_id, observed_expiry, state, outcome, completed_at)
       SELECT $1, $2, asset_id, retention_expires_at, 'done', $3, now() FROM media_assets WHERE asset_id = $4`,
      [key, MEDIA_POLICY, outcome, id],
    );
  }
  const read = await targetBacklogRead(bed.pool, target, undefined, { remotePolicy: true });
  assert.equal(read.eligibleRows, 1, `only ${waiting} may be deleted now: ${JSON.stringify(read)}`);
  assert.equal(read.reviewRows, 2, JSON.stringify(read));
  assert.equal(read.heldRows, 0);
});
