import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp from 'amqplib';
import { assertTopology, topologyFor } from '../../shared/amqp/topology';
import { rowDeletePolicyYaml, runRow } from '../support/fixtures';
import { assertNoLeakedProcesses, runReaperCli } from '../support/processes';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * `trigger/replay/execute --execute` on a cluster (issue 17 item 5): the services declare the
 * topology with REAPER_QUORUM_GROUP_SIZE, and the CLI must declare the very same arguments (the
 * broker refuses a declare that differs, PRECONDITION_FAILED). Whatever makes the CLI's start
 * fail, the run it claimed is handed back at once, not left `scanning` under the CLI's lease.
 * One node stands in for the cluster: a group size of 1 is an argument like any other.
 */
const GROUP_SIZE = '1';

describe('reaper trigger --execute with a quorum group size', () => {
  let bed: TestBed;

  before(async () => {
    bed = await makeTestBed('cli_execute_cluster');
    bed.writePolicies(rowDeletePolicyYaml({ batchSize: 50 }));
    // What a scheduler or worker of the cluster deployment declared before the operator's command.
    const connection = await amqp.connect(bed.amqpUrl);
    try {
      const channel = await connection.createChannel();
      const settings = bed.env({ REAPER_QUORUM_GROUP_SIZE: GROUP_SIZE });
      await assertTopology(channel, topologyFor(settings, ['seat-holds']));
      const declared = await channel.checkQueue(`${bed.prefix}.cleanup.seat-holds`);
      assert.equal(declared.queue, `${bed.prefix}.cleanup.seat-holds`);
    } finally {
      await connection.close();
    }
  });

  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await bed?.close();
    }
  });

  const latestManualRun = async () =>
    (await bed.pool.query<{ run_id: string }>(`SELECT run_id FROM cleanup_runs WHERE trigger = 'manual' ORDER BY created_at DESC LIMIT 1`)).rows[0]?.run_id;

  test('a start failure (the broker refuses the declare) hands the run back; with the group size, execute publishes it', async () => {
    await seedHolds(bed.pool, { expiredHeld: 120 });
    // Forced start failure: this command's environment lacks the group size the queues carry.
    const refused = await runReaperCli(['trigger', 'seat-holds', '--execute', '--json'], bed.processEnv());
    assert.equal(refused.code, 1, refused.stdout);
    assert.match(refused.stdout, /PRECONDITION_FAILED|refused reaper's topology/);
    const runId = (await latestManualRun())!;
    const left = await bed.pool.query<{ state: string; released: boolean }>(
      `SELECT state, lease_expires_at <= clock_timestamp() AS released FROM cleanup_runs WHERE run_id = $1`,
      [runId],
    );
    assert.deepEqual(left.rows[0], { state: 'scanning', released: true }, 'the run is claimable at once, not held by the failed CLI');

    // The same run, claimed again by a correctly configured CLI (it would say "held by another
    // process" if the lease had been kept), is published in full.
    const executed = await runReaperCli(['execute', runId, '--json'], bed.processEnv({ REAPER_QUORUM_GROUP_SIZE: GROUP_SIZE }), 90_000);
    assert.equal(executed.code, 0, executed.stdout);
    const run = await runRow(bed.pool, runId);
    assert.equal(run.state, 'published');
    assert.equal(run.candidates, 120);
    assert.equal(run.claim_count, 2, 'claimed by the failed CLI, then by this one');
  });

  test('a start failure of another kind (a refused REAPER_BATCH_VERSION) hands the run back too', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 10 });
    const refused = await runReaperCli(['trigger', 'seat-holds', '--execute', '--json'], bed.processEnv({ REAPER_QUORUM_GROUP_SIZE: GROUP_SIZE, REAPER_BATCH_VERSION: '9' }));
    assert.notEqual(refused.code, 0, refused.stdout);
    assert.match(refused.stdout, /REAPER_BATCH_VERSION/);
    const runId = (await latestManualRun())!;
    const left = await bed.pool.query<{ state: string; released: boolean }>(
      `SELECT state, lease_expires_at <= clock_timestamp() AS released FROM cleanup_runs WHERE run_id = $1`,
      [runId],
    );
    assert.deepEqual(left.rows[0], { state: 'scanning', released: true });
    assert.equal((await runReaperCli(['execute', runId, '--json'], bed.processEnv({ REAPER_QUORUM_GROUP_SIZE: GROUP_SIZE }), 90_000)).code, 0);
    assert.equal((await runRow(bed.pool, runId)).state, 'published');
  });

  test('trigger --execute with the deployment group size declares the same topology and publishes', async () => {
    await bed.pool.query('TRUNCATE seat_reservations');
    await seedHolds(bed.pool, { expiredHeld: 80 });
    const triggered = await runReaperCli(['trigger', 'seat-holds', '--execute', '--json'], bed.processEnv({ REAPER_QUORUM_GROUP_SIZE: GROUP_SIZE }), 90_000);
    assert.equal(triggered.code, 0, triggered.stdout);
    const run = await runRow(bed.pool, (await latestManualRun())!);
    assert.deepEqual({ state: run.state, candidates: run.candidates, batches: run.batches_confirmed }, { state: 'published', candidates: 80, batches: 2 });
  });
});
