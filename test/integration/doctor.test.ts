import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { partitionedPolicyYaml, partitionedSuite, partitionOwnerRole } from '../support/partitioned';
import { runReaperCli } from '../support/processes';
import { mediaPolicyYaml } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * `reaper doctor` (issue 40 item 9): checks, as the deployment's roles, that each service can do
 * what its policies need, and prints each finding with the fix; exit 1 on any. Run here as the
 * operator of an as-deployed bed, against the printed roles, then with two grants taken away the
 * way the roles of older releases lacked them.
 */
let bed: TestBed;

before(async () => {
  bed = await makeTestBed('doctor');
  bed.writePolicies(
    combinedPoliciesYaml(
      rowDeletePolicyYaml({ batchSize: 20, events: true }),
      mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 5, burst: 5, concurrency: 1 }),
    ),
  );
});

after(async () => {
  await bed?.close();
});

const doctor = (extra: string[] = []) => {
  const roles = bed.roles!;
  return runReaperCli(['doctor', '--scheduler', roles.scheduler, '--worker', roles.worker, '--operator', roles.operator, ...extra], bed.processEnv());
};

test('the printed roles pass every check', async () => {
  const checked = await doctor();
  assert.equal(checked.code, 0, checked.stdout);
  assert.match(checked.stdout, /ok +schema: migrations current/);
  assert.match(checked.stdout, /ok +privileges: (\d+) of \1 privileges the policies need are granted/);
  assert.match(checked.stdout, /all checks passed/);
});

test('a missing grant and a missing statistics role are each found, with the GRANT that fixes them', async () => {
  const roles = bed.roles!;
  await bed.pool.query(`REVOKE UPDATE ON cleanup_outbox FROM ${pg.escapeIdentifier(roles.scheduler)}`);
  await bed.pool.query(`REVOKE pg_read_all_stats FROM ${pg.escapeIdentifier(roles.worker)}`);
  try {
    const checked = await doctor(['--json']);
    assert.equal(checked.code, 1, checked.stdout);
    const report = JSON.parse(checked.stdout) as { ok: boolean; findings: Array<{ check: string; ok: boolean; fix: string | null }> };
    assert.equal(report.ok, false);
    const failed = report.findings.filter((finding) => !finding.ok);
    assert.deepEqual(failed.map((finding) => finding.check).sort(), ['privileges', 'scheduler UPDATE cleanup_outbox', 'worker pg_read_all_stats']);
    assert.match(failed.find((finding) => finding.check.startsWith('scheduler'))!.fix!, new RegExp(`GRANT UPDATE ON cleanup_outbox TO "${roles.scheduler}"`));
    assert.match(failed.find((finding) => finding.check.startsWith('worker'))!.fix!, new RegExp(`GRANT pg_read_all_stats TO "${roles.worker}"`));
  } finally {
    await bed.pool.query(`GRANT UPDATE ON cleanup_outbox TO ${pg.escapeIdentifier(roles.scheduler)}`);
    await bed.pool.query(`GRANT pg_read_all_stats TO ${pg.escapeIdentifier(roles.worker)}`);
  }
});

test('roles that do not exist are named, with how to make them', async () => {
  const checked = await runReaperCli(['doctor', '--worker', 'reaper_worker_nobody_made'], bed.processEnv());
  assert.equal(checked.code, 1, checked.stdout);
  assert.match(checked.stdout, /FAIL +role reaper_worker_nobody_made: role "reaper_worker_nobody_made" does not exist\n\s+fix: apply `reaper roles --print`/);
});

describe('partitions.retire: membership in the table\'s owner role', () => {
  // The scheduler refuses to start without it (DETACH, SET SCHEMA, DROP need the owner), and
  // `reaper restore --partition` (the operator) fails without it: doctor names both, with the GRANT.
  const world = partitionedSuite('doctor_partitions', (partitioned) => {
    partitioned.writePolicies(partitionedPolicyYaml());
  });
  const check = (extra: string[] = []) => {
    const roles = world.bed.roles!;
    return runReaperCli(['doctor', '--scheduler', roles.scheduler, '--worker', roles.worker, '--operator', roles.operator, ...extra], world.bed.processEnv());
  };

  test('the printed roles pass; without the membership the scheduler and the operator are each named with the GRANT', async () => {
    const passed = await check();
    assert.equal(passed.code, 0, passed.stdout);
    const roles = world.bed.roles!;
    const owner = partitionOwnerRole(world.bed);
    await world.bed.pool.query(`REVOKE ${pg.escapeIdentifier(owner)} FROM ${pg.escapeIdentifier(roles.scheduler)}, ${pg.escapeIdentifier(roles.operator)}`);
    try {
      const checked = await check(['--json']);
      assert.equal(checked.code, 1, checked.stdout);
      const failed = (JSON.parse(checked.stdout) as { findings: Array<{ check: string; ok: boolean; detail: string; fix: string | null }> }).findings.filter((finding) => !finding.ok);
      assert.deepEqual(failed.map((finding) => finding.check).sort(), ['operator member of events_by_day\'s owner', 'privileges', 'scheduler member of events_by_day\'s owner']);
      const scheduler = failed.find((finding) => finding.check.startsWith('scheduler'))!;
      assert.match(scheduler.detail, new RegExp(`lacks membership in role "${owner}", the owner of events_by_day: partitions.retire`));
      assert.match(scheduler.fix!, new RegExp(`^GRANT "?${owner}"? TO "${roles.scheduler}";`));
      assert.match(failed.find((finding) => finding.check.startsWith('operator'))!.fix!, new RegExp(`^GRANT "?${owner}"? TO "${roles.operator}";`));
    } finally {
      await world.bed.pool.query(`GRANT ${pg.escapeIdentifier(owner)} TO ${pg.escapeIdentifier(roles.scheduler)}, ${pg.escapeIdentifier(roles.operator)}`);
    }
  });
});
