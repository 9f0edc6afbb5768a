import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { createServer, connect, type AddressInfo, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { partitionedPolicyYaml, partitionedSuite, partitionOwnerRole } from '../support/partitioned';
import { brokerPermissions, brokerUserName } from '../../shared/amqp/permissions';
import { runReaperCli } from '../support/processes';
import { brokerAdmin, makeBrokerUsers } from '../support/broker-admin';
import { mediaPolicyYaml } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * `reaper doctor` (issue 40 item 9): checks, as the deployment's roles, that each service can do
 * what its policies need, and prints each finding with the fix; exit 1 on any. Run here as the
 * operator of an as-deployed bed, against the printed roles, then with two grants taken away the
 * way the roles of older releases lacked them.
 */
let bed: TestBed;

let removeBrokerUsers: (() => Promise<void>) | undefined;

before(async () => {
  bed = await makeTestBed('doctor');
  removeBrokerUsers = await makeBrokerUsers(bed.prefix);
  bed.writePolicies(
    combinedPoliciesYaml(
      rowDeletePolicyYaml({ batchSize: 20, events: true }),
      mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 5, burst: 5, concurrency: 1 }),
    ),
  );
});

after(async () => {
  await removeBrokerUsers?.();
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
  assert.match(checked.stdout, /ok +policies: .*2 valid policies/);
  assert.match(checked.stdout, /ok +broker permissions: the 4 service user\(s\) found hold the permissions of `reaper topology --definitions` on vhost "\/"/);
  assert.match(checked.stdout, /all checks passed/);
});

type Report = { ok: boolean; findings: Array<{ check: string; ok: boolean; detail: string; fix: string | null; skipped?: true }> };
const skippedOf = (stdout: string) => (JSON.parse(stdout) as Report).findings.filter((finding) => finding.skipped);
const failedOf = (stdout: string) => (JSON.parse(stdout) as Report).findings.filter((finding) => !finding.ok);

test('broker permissions: a user with other patterns is a finding with the set_permissions that fixes it; a user that has none is reported not checked (a deployment may name its users otherwise)', async () => {
  const worker = brokerUserName(bed.prefix, 'worker');
  const autoscaler = brokerUserName(bed.prefix, 'autoscaler');
  const want = brokerPermissions(bed.prefix);
  const admin = await brokerAdmin();
  // The worker as an older definitions file had it: no write on amq.default (dead letters refused).
  await admin.setPermissions('/', worker, { ...want.worker, write: `^${bed.prefix}\\.` });
  await admin.clearPermissions('/', autoscaler);
  try {
    const checked = await doctor(['--json']);
    assert.equal(checked.code, 1, checked.stdout);
    const failed = failedOf(checked.stdout);
    assert.deepEqual(failed.map((finding) => finding.check), [`broker user ${worker}`]);
    const wrong = failed.find((finding) => finding.check === `broker user ${worker}`)!;
    assert.match(wrong.detail, /write "\^test-.*\\\." \(expected "\^\(test-.*\|amq\\\.default\)\$"\)/);
    assert.equal(wrong.fix, `rabbitmqctl set_permissions -p '/' '${worker}' '${want.worker.configure}' '${want.worker.write}' '${want.worker.read}'`);
    const absent = skippedOf(checked.stdout).find((finding) => finding.check === `broker user ${autoscaler}`)!;
    assert.match(absent.detail, /^not checked: no user ".*" \(autoscaler\) holds permissions on vhost "\/"/);
    assert.match(absent.fix!, /set_permissions/);
  } finally {
    await admin.setPermissions('/', worker, want.worker);
    await admin.setPermissions('/', autoscaler, want.autoscaler);
  }
});

test('broker permissions: a broker that cannot be asked is reported not checked, not a failure and not a crash', async () => {
  // As deployed: doctor logs in to the broker as a user without the management tag (the operator's
  // has none), so the management API refuses it (401), and reaches it through a relay on 127.0.0.2,
  // so rabbitmqctl is not asked either (only about a broker on this machine's loopback names).
  const user = `${bed.prefix}-doctor-untagged`;
  const password = randomBytes(12).toString('hex');
  const admin = await brokerAdmin();
  await admin.addUser(user, password); // no tags: the management API refuses it
  await admin.setPermissions('/', user, { configure: '', write: '', read: '' });
  const url = new URL(bed.amqpUrl);
  const target = { port: Number(url.port || 5672), host: url.hostname };
  const sockets = new Set<Socket>();
  const relay = createServer((client) => {
    const upstream = connect(target.port, target.host);
    for (const socket of [client, upstream]) {
      sockets.add(socket);
      socket.on('error', () => undefined); // the other side is destroyed with it on close
      socket.on('close', () => (client.destroy(), upstream.destroy()));
    }
    client.pipe(upstream).pipe(client);
  });
  await new Promise<void>((resolve, reject) => relay.once('error', reject).listen(0, '127.0.0.2', resolve));
  url.hostname = '127.0.0.2';
  url.port = String((relay.address() as AddressInfo).port);
  url.username = encodeURIComponent(user);
  url.password = password;
  let checked: Awaited<ReturnType<typeof runReaperCli>>;
  try {
    checked = await runReaperCli(['doctor', '--json', '--scheduler', bed.roles!.scheduler, '--worker', bed.roles!.worker, '--operator', bed.roles!.operator], bed.processEnv({ AMQP_URL: url.toString() }));
  } finally {
    for (const socket of sockets) socket.destroy();
    await new Promise((resolve) => relay.close(resolve));
    await admin.deleteUser(user);
  }
  // A correct deployment whose operator cannot list permissions (no management tag, the API fenced off) passes.
  assert.equal(checked.code, 0, checked.stdout);
  assert.deepEqual(failedOf(checked.stdout), [], checked.stdout);
  const skipped = skippedOf(checked.stdout);
  assert.deepEqual(skipped.map((finding) => finding.check), ['broker permissions'], checked.stdout);
  assert.match(skipped[0]!.detail, /^not checked: cannot ask the broker for its users' permissions \(management API at 127\.0\.0\.2:15672.*; rabbitmqctl: the broker \(127\.0\.0\.2\) is not on this machine\)/);
  assert.match(skipped[0]!.fix!, /against `reaper topology --definitions`/);
});

test('a broker that does not answer is a finding; the database checks still run', async () => {
  const checked = await runReaperCli(['doctor', '--json', '--scheduler', bed.roles!.scheduler, '--worker', bed.roles!.worker, '--operator', bed.roles!.operator], bed.processEnv({ AMQP_URL: 'amqp://guest:guest@127.0.0.1:9/' }));
  assert.equal(checked.code, 1, checked.stdout);
  const report = JSON.parse(checked.stdout) as Report;
  assert.deepEqual(report.findings.filter((finding) => !finding.ok).map((finding) => finding.check), ['broker']);
  assert.match(report.findings.find((finding) => finding.check === 'broker')!.detail, /cannot connect to RabbitMQ at .*127\.0\.0\.1:9/);
  assert.ok(report.findings.some((finding) => finding.check === 'schema' && finding.ok), 'the schema was still checked');
});

test('a schema one migration behind is a finding naming the versions, with `reaper migrate` as the fix', async () => {
  const removed = await bed.pool.query('DELETE FROM reaper_schema_migrations WHERE version = (SELECT max(version) FROM reaper_schema_migrations) RETURNING *');
  try {
    const checked = await doctor(['--json']);
    assert.equal(checked.code, 1, checked.stdout);
    const failed = failedOf(checked.stdout);
    assert.deepEqual(failed.map((finding) => finding.check), ['schema']);
    const version = Number(removed.rows[0].version);
    assert.match(failed[0]!.detail, new RegExp(`schema is at version ${version - 1}, this reaper needs ${version}`));
    assert.match(failed[0]!.fix!, /run `reaper migrate`/);
  } finally {
    const row = removed.rows[0] as Record<string, unknown>;
    const columns = Object.keys(row);
    await bed.pool.query(`INSERT INTO reaper_schema_migrations (${columns.map((c) => pg.escapeIdentifier(c)).join(', ')}) VALUES (${columns.map((_, i) => `$${i + 1}`).join(', ')})`, Object.values(row));
  }
});

test('a broken policies file is a finding with the validator\'s message (field and value); the other checks still run', async () => {
  const file = path.join(mkdtempSync(path.join(tmpdir(), 'doctor-')), 'policies.yaml');
  writeFileSync(file, rowDeletePolicyYaml({ batchSize: 20 }).replace(/batchSize: 20/, 'batchSize: 5000'));
  const checked = await runReaperCli(['doctor', '--json', '--scheduler', bed.roles!.scheduler, '--worker', bed.roles!.worker, '--operator', bed.roles!.operator], bed.processEnv({ REAPER_POLICIES: file }));
  assert.equal(checked.code, 1, checked.stdout);
  assert.doesNotMatch(checked.stdout, /\n\s+at /, 'no stack trace');
  const report = JSON.parse(checked.stdout) as Report;
  const failed = report.findings.filter((finding) => !finding.ok);
  assert.deepEqual(failed.map((finding) => finding.check), ['policies']);
  assert.match(failed[0]!.detail, /batchSize/);
  assert.match(failed[0]!.detail, /5000|1000/);
  for (const check of ['database', 'schema', 'broker']) assert.ok(report.findings.some((finding) => finding.check === check && finding.ok), `${check} still checked`);
});

test('windows: a schedule that never fires inside its window, and a window too short for a batch, each with the fix', async () => {
  const file = path.join(mkdtempSync(path.join(tmpdir(), 'doctor-')), 'policies.yaml');
  // Cron is UTC: 12:00 UTC is never inside 01:00-05:00 UTC. The second window is 30 s, the statement timeout 60 s.
  const withWindow = (schedule: string, end: string) => `${rowDeletePolicyYaml({ batchSize: 20, schedule })}    window: { start: "01:00", end: "${end}", timeZone: "UTC" }\n`;
  const never = withWindow('0 12 * * *', '05:00');
  writeFileSync(file, never);
  const checked = await runReaperCli(['doctor', '--json', '--scheduler', bed.roles!.scheduler, '--worker', bed.roles!.worker, '--operator', bed.roles!.operator], bed.processEnv({ REAPER_POLICIES: file }));
  assert.equal(checked.code, 1, checked.stdout);
  let failed = failedOf(checked.stdout);
  assert.equal(failed.length, 1, JSON.stringify(failed));
  assert.match(failed[0]!.check, /^window /);
  assert.match(failed[0]!.detail, /schedule "0 12 \* \* \*" \(UTC\) never fires inside the window 01:00-05:00 UTC/);
  assert.match(failed[0]!.fix!, /move the schedule into the window/);

  writeFileSync(file, withWindow('* * * * *', '01:00:30'));
  const short = await runReaperCli(['doctor', '--json', '--scheduler', bed.roles!.scheduler, '--worker', bed.roles!.worker, '--operator', bed.roles!.operator], bed.processEnv({ REAPER_POLICIES: file }));
  assert.equal(short.code, 1, short.stdout);
  failed = failedOf(short.stdout);
  assert.equal(failed.length, 1, JSON.stringify(failed));
  assert.match(failed[0]!.detail, /is open 30 s, shorter than one batch may take \(REAPER_STATEMENT_TIMEOUT_MS 60000 ms\)/);
  assert.match(failed[0]!.fix!, /widen the window to at least 1 minute/);

  // A monthly schedule on a day more than the week ahead: a week without a tick inside the window
  // proves nothing, so it is not checked (before: a false finding for most of the month).
  const day = new Date(Date.now() + 15 * 86_400_000).getUTCDate();
  writeFileSync(file, withWindow(`0 3 ${day} * *`, '05:00'));
  const monthly = await runReaperCli(['doctor', '--json', '--scheduler', bed.roles!.scheduler, '--worker', bed.roles!.worker, '--operator', bed.roles!.operator], bed.processEnv({ REAPER_POLICIES: file }));
  assert.equal(monthly.code, 0, monthly.stdout);
  assert.match(skippedOf(monthly.stdout).find((finding) => /^window /.test(finding.check))!.detail, /^not checked: schedule "0 3 \d+ \* \*" \(UTC\) does not fire inside the window/);
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
  let removeUsers: (() => Promise<void>) | undefined;
  const world = partitionedSuite('doctor_partitions', async (partitioned) => {
    partitioned.writePolicies(partitionedPolicyYaml());
    removeUsers = await makeBrokerUsers(partitioned.prefix);
  });
  after(async () => {
    await removeUsers?.();
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
