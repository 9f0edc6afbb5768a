/**
 * Issue 42 items 3 and 4, the CLI's output for people, each through the real CLI as the printed
 * operator role: `status` fits 120 columns (`--wide` all columns, `--json` as it was), ages read
 * as `1h00m`; `runs` never cuts a reason; a broker that cannot be reached makes `status` exit 1;
 * a connection failure names DATABASE_URL / AMQP_URL and where they point (no password; a database
 * without the schema is named: cli-polish.test.ts); `trigger --execute` held by the brake prints no
 * JSON log line; `plan`'s sample comes from the count's predicate.
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
