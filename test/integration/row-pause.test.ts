import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { rowDeletePolicyYaml, stopAllCleanly } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli, startReaper, stopLeftovers, type ReaperProcess } from '../support/processes';
import { countReservations, seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';
import { eventually } from '../support/eventually';

/**
 * Issue 40 (smaller items): an operator could not stop a row-delete policy in an incident (`reaper
 * pause seat-holds` answered "pause applies to remote-delete policies"), where CockroachDB and
 * TiDB pause any TTL job. Now `reaper pause <policy>` stops a row-delete policy's statements too:
 * its batches go to a delay tier (reason "paused") and nothing is deleted until `reaper resume`.
 * The policy here is adaptive (the default) on a database nobody else uses, so its worker would
 * admit without taking a token ("alone"): the pause must hold there too.
 */
let bed: TestBed;
const started: ReaperProcess[] = [];

before(async () => {
  bed = await makeTestBed('row_pause');
  bed.writePolicies(rowDeletePolicyYaml({ batchSize: 10 }));
});

after(async () => {
  await stopLeftovers(started.splice(0), 5_000);
  await assertNoLeakedProcesses();
  await bed?.close();
});

test('reaper pause stops a row-delete policy, resume deletes what waited', async () => {
  const holds = await seedHolds(bed.pool, { expiredHeld: 40 });
  const cli = (args: string[]) => runReaperCli(args, bed.processEnv());
  const paused = await cli(['pause', 'seat-holds', '--json']);
  assert.equal(paused.code, 0, paused.stdout);
  assert.deepEqual(JSON.parse(paused.stdout), { paused: true, policies: ['seat-holds'], changed: ['seat-holds'] });

  const scheduler = startReaper('row-pause-scheduler', ['scheduler'], bed.processEnv({ REAPER_WORKER_ID: 'row-pause-scheduler' }));
  const worker = startReaper('row-pause-worker', ['worker'], bed.processEnv({ REAPER_WORKER_ID: 'row-pause-worker' }));
  started.push(scheduler, worker);
  await worker.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000);
  assert.equal((await cli(['trigger', 'seat-holds'])).code, 0);
  // Every batch of the run came to the worker and went to a delay tier, paused: nothing deleted.
  await worker.waitForLine('a batch delayed because the policy is paused', (line) => line.msg === 'batch delayed' && line.reason === 'paused', 30_000);
  assert.equal(await countReservations(bed.pool, holds.expiredHeld), 40, 'nothing deleted while paused');

  const resumed = await cli(['resume', 'seat-holds']);
  assert.equal(resumed.code, 0, resumed.stdout);
  assert.match(resumed.stdout, /resumed: seat-holds/);
  await eventually('every expired hold deleted after the resume', async () => (await countReservations(bed.pool, holds.expiredHeld)) === 0, { timeoutMs: 40_000 });
  await stopAllCleanly([scheduler, worker]);
});
