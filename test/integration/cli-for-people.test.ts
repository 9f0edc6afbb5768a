/**
 * Issue 42 items 3 and 4, the CLI's output for people, each through the real CLI as the printed
 * operator role: `status` fits 120 columns (`--wide` all columns, `--json` as it was), ages read
 * as `1h00m`; `runs` never cuts a reason and fits 120 columns (ids of 8 hex digits, cutoffs to the
 * second; `--wide` whole), and every command that takes a run id takes a unique prefix; a broker
 * that cannot be reached makes `status` exit 1; a connection failure names DATABASE_URL / AMQP_URL
 * and where they point (no password; a database without the schema is named: cli-polish.test.ts);
 * `trigger --execute` held by the brake prints no JSON log line; `plan`'s sample comes from the
 * count's predicate.
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { loadPolicies } from '../../shared/config/policies';
import { expiringRowsScanPage } from '../../shared/db/queries/expiring-rows';
import { targetResolve } from '../../shared/db/queries/target';
import { ledgerRecordCandidates } from '../../shared/db/queries/ledger';
import { runsGetSummary } from '../../shared/db/queries/runs';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { runReaperCli } from '../support/processes';
import { MEDIA_POLICY, mediaPolicyYaml, seedAssets } from '../support/remote-helpers';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

let bed: TestBed;
let policiesPath: string;

before(async () => {
  bed = await makeTestBed('cli_for_people');
  // seat-holds: a brake that holds any run over a tenth of its guarded rows (a reason longer than
  // the 60 characters `runs` used to keep); media-assets: an API that is never called here.
  policiesPath = bed.writePolicies(
    combinedPoliciesYaml(
      rowDeletePolicyYaml({ batchSize: 10, limits: { maxFractionPerRun: 0.1 } }),
      mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:1', ratePerSecond: 10, burst: 1, concurrency: 1 }),
    ),
  );
  await seedHolds(bed.pool, { expiredHeld: 20, futureHeld: 5 });
});

after(async () => {
  await bed?.close();
});

const cli = (args: string[], overrides: Record<string, string> = {}) => runReaperCli(args, bed.processEnv(overrides));
const lines = (text: string) => text.split('\n');
const longest = (text: string) => Math.max(...lines(text).map((line) => line.length));
/** Lines wrapped for 120 columns (continued with an indent) joined again. */
const unwrapped = (text: string) => text.replace(/\n +/g, ' ');

test('trigger --execute held by the brake: text for people, no JSON log line; runs shows the whole reason', async () => {
  const held = await cli(['trigger', 'seat-holds', '--execute']);
  assert.equal(held.code, 1, held.stdout);
  assert.match(held.stdout, /awaits approval/);
  const jsonLines = lines(held.stdout).filter((line) => line.trimStart().startsWith('{'));
  assert.deepEqual(jsonLines, [], 'no raw JSON log line among what a person reads');
  assert.match(held.stdout, /reaper: warning: run over its allowance/, 'the warning is still there, as text');

  const runId = /run ([0-9a-f-]{36}) is over its policy's limits/.exec(held.stdout)![1]!;
  const reason = (await runsGetSummary(bed.pool, runId))!.error!;
  assert.ok(reason.length > 60, `a reason longer than the old cut: ${reason}`);
  const listed = await cli(['runs']);
  assert.equal(listed.code, 0, listed.stdout);
  const reasonLines = lines(listed.stdout).filter((line) => line.startsWith('    '));
  assert.ok(reasonLines.length > 0 && reasonLines.every((line) => line.length <= 120), `the reason wrapped within 120 columns:\n${listed.stdout}`);
  const reasonText = /\n {4}reason: ([\s\S]*?)(?:\n\S|$)/.exec(listed.stdout)?.[1]?.replace(/\n\s+/g, ' ');
  assert.equal(reasonText?.trim(), reason, `the whole reason under its run:\n${listed.stdout}`);
  assert.ok(!listed.stdout.includes('…'), 'nothing cut');
  const wide = await cli(['runs', '--wide']);
  assert.ok(lines(wide.stdout).some((line) => line.includes(runId) && line.endsWith(reason)), `--wide: the reason whole on its run's line:\n${wide.stdout}`);
});

test('status: 120 columns by default with ages like 1h00m; --wide has every column; --json keeps its fields', async () => {
  const shown = await cli(['status']);
  assert.equal(shown.code, 0, shown.stdout);
  assert.ok(longest(shown.stdout) <= 120, `every line within 120 columns (longest ${longest(shown.stdout)}):\n${shown.stdout}`);
  assert.match(shown.stdout, /^seat-holds\s+row-delete\s+20\s+1h0\dm\s/m, 'waiting rows and the oldest one\'s age, in hours and minutes');
  assert.doesNotMatch(shown.stdout, /\d+\.\d{3}s\b/, 'no ages in thousandths of seconds');
  assert.match(shown.stdout, /seat-holds: last run awaits approval: counted 20/, 'what needs a decision has its own line');

  const wide = await cli(['status', '--wide']);
  assert.equal(wide.code, 0, wide.stdout);
  const header = lines(wide.stdout)[0]!.split(/\s+/);
  for (const column of ['policy', 'kind', 'window', 'paused', 'admission', 'adaptive', 'brake', 'events', 'oldestEligible', 'oldestLeased', 'waiting', 'lastCompleted', 'lag', 'lastRun', 'lastRunState', 'lastRunCounted', 'lastRunApproved', 'lastRunError', 'queued', 'pending', 'inFlight', 'confirmed', 'rejected', 'gaveUp']) {
    assert.ok(header.includes(column), `--wide has ${column}`);
  }

  const json = await cli(['status', '--json']);
  assert.equal(json.code, 0, json.stdout);
  const parsed = JSON.parse(json.stdout) as { policies: Array<Record<string, unknown>>; deadLetters: unknown; delayed: unknown; brokerError: unknown };
  assert.deepEqual(Object.keys(parsed), ['policies', 'deadLetters', 'delayed', 'brokerError']);
  assert.deepEqual(Object.keys(parsed.policies[0]!), [
    'policy', 'kind', 'oldestEligibleAgeSeconds', 'oldestLeasedAgeSeconds', 'waitingRows', 'waitingRowsCapped', 'lastCompletedRun', 'lastCompletedAt',
    'lastCompletedLagSeconds', 'paused', 'window', 'admission', 'adaptive', 'brake', 'lastRun', 'lastRunState', 'lastRunError', 'lastRunCounted',
    'lastRunApproved', 'queued', 'pending', 'inFlight', 'confirmed', 'rejected', 'gaveUp', 'events',
  ]);
  assert.equal(typeof parsed.policies[0]!.oldestEligibleAgeSeconds, 'number', 'JSON keeps seconds as numbers');
});

test('a broker that cannot be reached: status exits 1 with a line naming AMQP_URL, not "unknown"; no password', async () => {
  const unreachable = { AMQP_URL: 'amqp://guest:guest@127.0.0.1:1' };
  const shown = await cli(['status'], unreachable);
  assert.equal(shown.code, 1, shown.stdout);
  assert.ok(longest(shown.stdout) <= 120, shown.stdout);
  assert.match(unwrapped(shown.stdout), /queue counts unknown: cannot connect to RabbitMQ at 127\.0\.0\.1:1 \(vhost \/, from AMQP_URL\): connect ECONNREFUSED/);
  assert.doesNotMatch(shown.stdout, /unknown message/);
  assert.doesNotMatch(shown.stdout, /guest:guest/);
  assert.match(shown.stdout, /^seat-holds\s/m, 'the database side is still shown');
  const json = await cli(['status', '--json'], unreachable);
  assert.equal(json.code, 1, json.stdout);
  assert.match((JSON.parse(json.stdout) as { brokerError: string }).brokerError, /from AMQP_URL\): connect ECONNREFUSED/);
  const dlq = await cli(['dlq', 'list'], unreachable);
  assert.equal(dlq.code, 1, dlq.stdout);
  assert.match(dlq.stdout, /^reaper: cannot connect to RabbitMQ at 127\.0\.0\.1:1 \(vhost \/, from AMQP_URL\): connect ECONNREFUSED/m);
});

test('a database that cannot be reached: the error names DATABASE_URL, host:port and database, not the password', async () => {
  // Another user than the bed's: the URL is used as given (with its password).
  const result = await cli(['runs'], { DATABASE_URL: 'postgres://someone:s3cret-pw@127.0.0.1:1/reaper_nowhere' });
  assert.equal(result.code, 1, result.stdout);
  assert.match(result.stdout, /^reaper: cannot connect to PostgreSQL at 127\.0\.0\.1:1 \(database reaper_nowhere, from DATABASE_URL\): connect ECONNREFUSED 127\.0\.0\.1:1$/m);
  assert.doesNotMatch(result.stdout, /s3cret-pw/);
});

test("plan: the sample comes from the count's predicate (remote-delete leaves out what the ledger carries)", async () => {
  await seedAssets(bed.pool, 'plan-sample', 3);
  const policy = loadPolicies(policiesPath).get(MEDIA_POLICY)!;
  const target = await targetResolve(bed.pool, policy);
  const cutoff = (await bed.pool.query<{ now: string }>('SELECT reaper_iso(now()) AS now')).rows[0]!.now;
  const items = await expiringRowsScanPage(bed.pool, target, { cutoff, after: null, limit: 100 });
  assert.equal(items.length, 3);
  // Their operations are in the ledger (as a worker records a batch): no run publishes them again.
  await ledgerRecordCandidates(bed.pool, target, { policy: MEDIA_POLICY, runId: null, cutoff, items, source: 'scan' });
  const plan = await cli(['plan', MEDIA_POLICY, '--json']);
  assert.equal(plan.code, 0, plan.stdout);
  const parsed = JSON.parse(plan.stdout) as { candidates: number; sample: string[] };
  assert.deepEqual({ candidates: parsed.candidates, sample: parsed.sample }, { candidates: 0, sample: [] });
});

test('runs: 120 columns with ids of 8 hex digits and cutoffs to the second (--wide, --json whole); every run-id argument takes a unique prefix', async () => {
  const held = (await bed.pool.query<{ run_id: string }>(`SELECT run_id FROM cleanup_runs WHERE policy = 'seat-holds' AND state = 'awaiting-approval'`)).rows[0]!.run_id;
  // Two runs whose ids share their first 8 hex digits (then differ), of a policy with a 16-character
  // name, held by the brake with a count, an approval, skipped keys and a reason: the widest
  // ordinary row. The bed's superuser inserts them because no command makes a run with a chosen id
  // (ids are random: two sharing 8 digits is about 1 in 4 billion per pair) and the operator role
  // the CLI logs in as may not insert runs.
  const twins = ['5eed5eed-1000-4000-8000-000000000001', '5eed5eed-2000-4000-8000-000000000002'];
  await bed.pool.query(
    `INSERT INTO cleanup_runs (run_id, policy, trigger, scheduled_for, cutoff, state, candidates, skipped, counted_candidates,
       approved_candidates, approved_policy_version, error)
     SELECT id, 'sixteen-chars-ok', 'catch-up', now() - n * interval '1 minute', now() - interval '1 day', 'awaiting-approval', 1234567, 3, 1234567,
       1000000, '0123456789abcdef', 'run over its allowance: 1234567 candidates is more than limits.maxPerRun (1000000); approve or reject it'
     FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, n)`,
    [twins],
  );

  const listed = await cli(['runs']);
  assert.equal(listed.code, 0, listed.stdout);
  assert.ok(longest(listed.stdout) <= 120, `every line within 120 columns (longest ${longest(listed.stdout)}):\n${listed.stdout}`);
  assert.match(listed.stdout, new RegExp(`^${held.slice(0, 8)}\\s+seat-holds\\s+manual\\s+awaiting-approval\\s+\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d:\\d\\dZ\\s`, 'm'), listed.stdout);
  assert.ok(!listed.stdout.includes(held), 'the whole id only with --wide');
  // Sharing 8 digits, each twin is shown with as many as it takes to tell them apart (git's rule).
  assert.match(listed.stdout, /^5eed5eed-1\s+sixteen-chars-ok\s+catch-up\s+awaiting-approval\s/m, listed.stdout);
  assert.match(listed.stdout, /^5eed5eed-2\s/m, listed.stdout);
  assert.match(listed.stdout, /^ {4}brake: counted 1234567, approved 1000000 \(0123456789abcdef\)$/m, 'the brake\'s counts under the run');
  assert.match(listed.stdout, /^ {4}skipped: 3 /m, 'skipped keys under the run');
  const wide = await cli(['runs', '--wide']);
  assert.match(wide.stdout, new RegExp(`^${twins[0]}\\s.*\\s\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{6}Z\\s`, 'm'), `--wide: whole id and cutoff:\n${wide.stdout}`);
  const json = JSON.parse((await cli(['runs', '--json'])).stdout) as Array<{ runId: string; cutoff: string }>;
  for (const id of [held, ...twins]) assert.ok(json.some((run) => run.runId === id), `--json: the whole id ${id}`);
  assert.ok(json.every((run) => /\.\d{6}Z$/.test(run.cutoff)), '--json: cutoffs to the microsecond');

  // A prefix as `runs` shows it, in `run`, `audit --run` and `approve` (which then names the whole id).
  const one = await cli(['run', held.slice(0, 8)]);
  assert.equal(one.code, 0, one.stdout);
  assert.match(one.stdout, new RegExp(`^run {8}${held}$`, 'm'));
  const audited = await cli(['audit', '--run', held.slice(0, 8).toUpperCase()]);
  assert.equal(audited.code, 1, audited.stdout);
  assert.match(audited.stdout, new RegExp(`run ${held} deleted nothing that was audited`));
  // Ambiguous: a usage error (2) naming the argument and every match, in each command that takes a run id.
  for (const args of [['run'], ['execute'], ['approve'], ['reject'], ['replay', '--run'], ['audit', '--run'], ['restore', '--run']]) {
    const refused = await cli([...args, '5eed5eed']);
    assert.equal(refused.code, 2, `${args.join(' ')}: ${refused.stdout}`);
    const argument = args[1] ?? 'runId';
    assert.match(refused.stdout, new RegExp(`reaper: ${argument}: "5eed5eed" is the start of more than one run id: ${twins[0]}, ${twins[1]}; give more of the id`), refused.stdout);
  }
  assert.equal((await cli(['run', '5eed5eed-2'])).code, 0, 'one more digit tells them apart');
  const short = await cli(['run', '5eed5ee']);
  assert.equal(short.code, 2, short.stdout);
  assert.match(short.stdout, /reaper: runId: "5eed5ee" is not a run id: give the uuid, or at least its first 8 hex digits/);
  const misplaced = await cli(['audit', '--run', '5eed-5eed']);
  assert.equal(misplaced.code, 2, misplaced.stdout);
  assert.match(misplaced.stdout, /reaper: --run: "5eed-5eed" is not a run id/);
  const missing = await cli(['approve', '00000000']);
  assert.equal(missing.code, 1, missing.stdout);
  assert.match(missing.stdout, /reaper: no run 00000000$/m);

  const counted = (await runsGetSummary(bed.pool, held))!;
  const approved = await cli(['approve', held.slice(0, 8), '--expect', `${counted.countedCandidates}@${counted.holdCount}`]);
  assert.equal(approved.code, 0, approved.stdout);
  assert.match(approved.stdout, new RegExp(`^run ${held} approved for ${counted.countedCandidates} candidates`, 'm'));
  assert.equal((await runsGetSummary(bed.pool, held))!.approvedCandidates, counted.countedCandidates);
});
