import { writeFileSync } from 'node:fs';
import { test } from 'node:test';
import amqp from 'amqplib';
import { atTestProcessExit, startReaper } from './processes';
import { removeStandbyNow, standbyPlace } from './standby';
import { makeTestBed } from './testbed';

/**
 * Not a test of reaper: a test file the killed-file test (test/integration/killed-file.test.ts)
 * starts with `node --test` and then kills mid-run. It makes what a real file makes — a test bed
 * (database, broker prefix, temp folder), a queue of its own under the prefix, a worker, frozen
 * (SIGSTOP) as the frozen-worker tests do, a standby's slot and folder — reports it in REAPER_FIXTURE_REPORT, and waits.
 */
test('a test file that is killed mid-run (fixture)', async () => {
  const bed = await makeTestBed(process.env.REAPER_FIXTURE_LABEL!);
  const connection = await amqp.connect(bed.amqpUrl);
  const channel = await connection.createChannel();
  await channel.assertQueue(`${bed.prefix}.settle-probe`, { durable: false });
  await connection.close();
  const worker = startReaper('frozen-worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'frozen-worker' }));
  await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 60_000);
  worker.signal('SIGSTOP');
  // A standby's slot and folder, with the standby helper's exit clean-up (no standby server: that
  // needs a replication entry in pg_hba.conf, which a fresh machine lacks).
  const standby = standbyPlace(process.env.REAPER_FIXTURE_LABEL!);
  await bed.pool.query('SELECT pg_create_physical_replication_slot($1)', [standby.name]);
  atTestProcessExit(() => removeStandbyNow(bed.databaseUrl, standby.name, standby.dir));
  const database = new URL(bed.databaseUrl).pathname.slice(1);
  writeFileSync(process.env.REAPER_FIXTURE_REPORT!, JSON.stringify({ pid: process.pid, workerPid: worker.pid, database, prefix: bed.prefix, slot: standby.name, standbyDir: standby.dir }));
  await new Promise(() => setInterval(() => undefined, 1_000)); // killed here
});
