/**
 * CLI details found while deploying (issue 11): `--version`; "not found" exits 1 (a lookup that
 * found nothing), not 2 (a usage error); `status` says why the broker could not be reached (and
 * exits 1: issue 42) and counts the messages waiting in delay tiers; a database without reaper's
 * schema suggests `reaper migrate`, naming the database; `migrate` says what it applies as it goes.
 */
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import amqp from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { runReaperCli } from '../support/processes';
import { findServers } from '../support/servers';
import { makeTestBed, type TestBed } from '../support/testbed';
import { started, startWorkerProcess, stopStarted } from '../support/remote-helpers';

let bed: TestBed;

before(async () => {
  bed = await makeTestBed('cli_polish');
});

after(async () => {
  await stopStarted();
  await bed?.close();
});

test('--version prints the package version', async () => {
  const { version } = JSON.parse(readFileSync(path.resolve(__dirname, '..', '..', '..', 'package.json'), 'utf8')) as { version: string };
  for (const flag of ['--version', '-V']) {
    const result = await runReaperCli([flag], bed.processEnv());
    assert.equal(result.code, 0);
    assert.equal(result.stdout.trim(), version);
  }
});

test('a run that does not exist exits 1 (not found), a malformed id 2 (usage)', async () => {
  const missing = await runReaperCli(['run', '00000000-0000-4000-8000-000000000000'], bed.processEnv());
  assert.equal(missing.code, 1, missing.stdout);
  assert.match(missing.stdout, /no run 00000000-0000-4000-8000-000000000000/);
  const replay = await runReaperCli(['replay', '--run', '00000000-0000-4000-8000-000000000000'], bed.processEnv());
  assert.equal(replay.code, 1, replay.stdout);
  const malformed = await runReaperCli(['run', 'nope'], bed.processEnv());
  assert.equal(malformed.code, 2);
});

test('status names the reason the broker could not be reached, still shows the database side, and exits 1', async () => {
  const result = await runReaperCli(['status'], bed.processEnv({ AMQP_URL: 'amqp://guest:guest@127.0.0.1:1' }));
  assert.equal(result.code, 1, result.stdout);
  assert.match(result.stdout, /queue counts unknown: cannot connect to RabbitMQ at 127\.0\.0\.1:1 \(vhost \/, from AMQP_URL\): [\s\S]*ECONNREFUSED/);
  assert.match(result.stdout, /seat-holds/, 'the policies are listed from the database');
  const json = JSON.parse((await runReaperCli(['status', '--json'], bed.processEnv({ AMQP_URL: 'amqp://guest:guest@127.0.0.1:1' }))).stdout) as { brokerError: string | null };
  assert.match(json.brokerError ?? '', /ECONNREFUSED/);
});

test('status counts the messages waiting in delay tiers', async () => {
  // A worker declares the topology; then two messages wait in delay tiers (their TTLs far away,
  // so they stay put; the test bed deletes the queues afterwards).
  const worker = startWorkerProcess(bed, 'polish-worker');
  await started(worker, 'worker');
  await worker.stop();
  const names = brokerNames(bed.prefix);
  const connection = await amqp.connect(bed.amqpUrl);
  try {
    const channel = await connection.createConfirmChannel();
    channel.sendToQueue(names.delayQueue(600_000), Buffer.from('{}'));
    channel.sendToQueue(names.delayQueue(120_000), Buffer.from('{}'));
    await channel.waitForConfirms();
    await channel.close();
  } finally {
    await connection.close();
  }
  const result = await runReaperCli(['status'], bed.processEnv());
  assert.equal(result.code, 0, result.stdout);
  assert.match(result.stdout, /delay tiers \(retries waiting\): 2 message\(s\)/);
});

test('a database without the reaper schema: the command suggests `reaper migrate`, which then says what it applies', async () => {
  const servers = await findServers();
  const admin = new pg.Client({ connectionString: servers.databaseUrl });
  await admin.connect();
  const database = `reaper_polish_${process.pid}_${Date.now()}`;
  await admin.query(`CREATE DATABASE ${pg.escapeIdentifier(database)}`);
  try {
    const url = new URL(servers.databaseUrl);
    url.pathname = `/${database}`;
    // A database this test made, without the printed roles (nor reaper's schema, on purpose).
    const env = bed.processEnv({ DATABASE_URL: url.toString(), REAPER_TEST_SUPERUSER_BECAUSE: 'a database the test made, without the printed roles' });
    // The advice names the database (issue 42: the defaults once pointed `reaper migrate` at `postgres`).
    for (const command of ['runs', 'status']) {
      const result = await runReaperCli([command], env);
      assert.equal(result.code, 1, result.stdout);
      assert.match(result.stdout, new RegExp(`the database at ${url.hostname}:${url.port || 5432} \\(database ${database}, from DATABASE_URL\\) has no reaper schema .*run \`reaper migrate\` with this DATABASE_URL first`));
    }
    const migrated = await runReaperCli(['migrate'], env);
    assert.equal(migrated.code, 0, migrated.stdout);
    assert.match(migrated.stdout, /applying 0001_[^\n]+\.sql \.\.\.\n[\s\S]*applying 0002_/, 'each file is announced as it starts');
    assert.match(migrated.stdout, /applied 0001_/);
  } finally {
    await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(database)} WITH (FORCE)`);
    await admin.end();
  }
});
