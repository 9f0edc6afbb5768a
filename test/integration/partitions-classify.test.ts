import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import pg from 'pg';
import { loadPolicies, parsePolicies } from '../../shared/config/policies';
import { startScheduler } from '../../services/scheduler/scheduler';
import { testLog } from '../support/fixtures';
import { targetResolve } from '../../shared/db/queries/target';
import { runReaperCli } from '../support/processes';
import { HELD_ID, partitionedPolicyYaml, partitionedSuite, partitionOwnerRole, ROWS_PER_PARTITION } from '../support/partitioned';

/**
 * Issue 44 steps 1 and 2: `partitions.retire` is validated against the catalog once (the table is
 * range-partitioned by expiresAt alone; a key unique only with expiresAt is accepted there), and
 * `reaper partitions` / `reaper plan` classify every partition under one cutoff with its reason.
 */
describe('partitions: validation and classification', () => {
  const world = partitionedSuite('partitions_classify', (bed) => void bed.writePolicies(partitionedPolicyYaml()));

  const resolve = (yaml: string) => targetResolve(world.bed.pool, parsePolicies(yaml, 'test', {}).values().next().value!);

  test('a key unique only together with expiresAt is accepted on the partitioned table', async () => {
    const target = await resolve(partitionedPolicyYaml());
    assert.equal(target.partitioned, true);
  });

  test('partitions.retire on a table that is not partitioned, or partitioned by something else, is refused naming the field and the value', async () => {
    const seat = partitionedPolicyYaml().replace('table: events_by_day', 'table: seat_reservations').replace('key: id', 'key: reservation_id').replace('{ status: open }', '{ status: held }');
    await assert.rejects(resolve(seat), /partitions\.retire: true, but table "seat_reservations" is not a partitioned table .*single column expiresAt \("expires_at"\)/);
    await world.bed.pool.query(`CREATE TABLE by_status (id bigint, status text, expires_at timestamptz, PRIMARY KEY (id, status)) PARTITION BY LIST (status)`);
    const list = partitionedPolicyYaml().replace('table: events_by_day', 'table: by_status');
    await assert.rejects(resolve(list), /partitions\.retire: true, but table "by_status" is partitioned by LIST \("status"\), which does not bound expiresAt/);
    // Without partitions.retire the list-partitioned table is still refused for its key (unique only with status).
    await assert.rejects(resolve(list.replace(/ *partitions:.*\n/, '')), /key column "id" of table "by_status" is not unique.*exactly \("id", "expires_at"\)/);
  });

  test('reaper partitions classifies each partition with its reason; plan includes it and counts the retirable rows among its candidates', async () => {
    const hold = await runReaperCli(['hold', 'add', 'day-events', HELD_ID, '--reason', 'litigation 44'], world.bed.processEnv());
    assert.equal(hold.code, 0, hold.stdout);
    const shown = await runReaperCli(['partitions', 'day-events', '--json'], world.bed.processEnv());
    assert.equal(shown.code, 0, shown.stdout);
    const report = JSON.parse(shown.stdout) as { retire: boolean; retirableRows: number; partitions: Array<{ partition: string; class: string; reason: string; rows: number | null }> };
    const byName = Object.fromEntries(report.partitions.map((entry) => [entry.partition.replace(/^public\./, ''), entry]));
    assert.deepEqual(
      Object.fromEntries(Object.entries(byName).map(([name, entry]) => [name, entry.class])),
      { p_fk: 'blocked', p_old_a: 'retirable', p_old_b: 'retirable', p_held: 'mixed', p_guard: 'mixed', p_today: 'mixed', p_future: 'unexpired', p_default: 'blocked' },
    );
    assert.match(byName.p_fk!.reason, /referenced by foreign key event_notes_id_expires_at_fkey on event_notes/);
    assert.match(byName.p_default!.reason, /the default partition/);
    assert.match(byName.p_held!.reason, /1 of 6 row\(s\) held, outside the guard or not expired/);
    assert.match(byName.p_guard!.reason, /1 of 6 row\(s\)/);
    assert.match(byName.p_today!.reason, /upper bound .* after the cutoff/);
    assert.equal(report.retirableRows, 2 * ROWS_PER_PARTITION);
    assert.equal(report.retire, true);

    const human = await runReaperCli(['partitions', 'day-events'], world.bed.processEnv());
    assert.match(human.stdout, /retirable +2 partition\(s\), 12 row\(s\)/);
    assert.match(human.stdout, /public\.p_old_a +retirable +6 /);

    const plan = await runReaperCli(['plan', 'day-events', '--json'], world.bed.processEnv());
    assert.equal(plan.code, 0, plan.stdout);
    const planned = JSON.parse(plan.stdout) as { candidates: number; partitions: { retirableRows: number } | null };
    assert.equal(planned.partitions?.retirableRows, 12);
    // Every expired open row that is not held: 6 (p_fk) + 12 + 5 (p_held) + 5 (p_guard) + p_today's expired ones (by the
    // time of day: its rows are 8 hours apart) + 1 (default).
    const today = (await world.bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM p_today WHERE expires_at <= now()')).rows[0]!.n;
    assert.equal(planned.candidates, 6 + 12 + 5 + 5 + today + 1);
  });

  test('a policy that is not row-delete, or a table that is not partitioned, is a usage error', async () => {
    world.bed.writePolicies(partitionedPolicyYaml({ name: 'seats' }).replace('table: events_by_day', 'table: seat_reservations').replace('key: id', 'key: reservation_id').replace(/ *partitions:.*\n/, ''));
    const refused = await runReaperCli(['partitions', 'seats'], world.bed.processEnv());
    assert.equal(refused.code, 2, refused.stdout);
    assert.match(refused.stdout, /table "seat_reservations" is not a partitioned table/);
    world.bed.writePolicies(partitionedPolicyYaml());
  });

  test('a scheduler whose role is not a member of the table owner refuses to start, naming the grant', async () => {
    await world.bed.pool.query(`REVOKE ${pg.escapeIdentifier(partitionOwnerRole(world.bed))} FROM ${pg.escapeIdentifier(world.bed.roles!.scheduler)}`);
    try {
      const env = world.bed.env();
      await assert.rejects(
        startScheduler(world.bed.as(env, 'scheduler'), loadPolicies(env.policiesPath), testLog),
        /policy day-events: partitions\.retire needs GRANT "?app_owner_[a-z0-9_]+"? TO current role \(the owner of "events_by_day"/,
      );
    } finally {
      await world.bed.pool.query(`GRANT ${pg.escapeIdentifier(partitionOwnerRole(world.bed))} TO ${pg.escapeIdentifier(world.bed.roles!.scheduler)}`);
    }
  });
});
