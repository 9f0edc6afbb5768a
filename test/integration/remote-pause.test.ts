import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { recordAdmissionEvents } from '../support/admission-events';
import { eventually } from '../support/eventually';
import { maxInSlidingWindow } from '../../tools/media-api/server';
import { runReaperCli } from '../support/processes';
import {
  assertRetention,
  remoteWorldSuite,
  allConfirmed,
  assetStatuses,
  callsByKey,
  ledgerDiagnosis,
  ledgerRows,
  ledgerSummary,
  MEDIA_POLICY,
  seedAssets,
  startRemoteServices,
} from '../support/remote-helpers';
import { stopAllCleanly } from '../support/fixtures';

/**
 * The pause switch (docs/design.md invariant 9, "pausing admission stops calls without deleting ledger
 * rows"), with two worker processes draining a backlog: after `reaper pause <policy>` returns, at
 * most C calls that were already admitted may still start, then none for a while, every open
 * operation is still there (pending, payload kept), and `reaper resume <policy>` drains the
 * backlog to all confirmed, each asset deleted once.
 */
const R = 10;
const BURST = 2;
const C = 3;
const ASSETS = 50;
const SLOW_MS = 150;
/** How long the pause is watched for calls and deliveries after the in-flight ones finished. */
const QUIET_MS = 3_000;

describe('remote-delete: pause and resume', () => {
  const world = remoteWorldSuite('remote_pause', { ratePerSecond: R, burst: BURST, concurrency: C, batchSize: 10, timeoutMs: 15_000, leaseMs: 25_000 }, { slowMs: SLOW_MS });

  test('pause stops calls within one admission interval and loses nothing; resume drains the backlog', async () => {
    const ids = await seedAssets(world.bed.pool, 'paused', ASSETS);
    const admissionEvents = await recordAdmissionEvents(world.bed.pool);
    const { workers, all } = await startRemoteServices(world.bed, { scheduler: 'pause-scheduler', workers: ['pause-worker-1', 'pause-worker-2'] });
    assert.equal((await runReaperCli(['trigger', MEDIA_POLICY], world.bed.processEnv())).code, 0);

    // Mid-backlog: every batch delivered (all operations recorded), some calls made, most still to do.
    await eventually(
      'all operations recorded and some calls made',
      async () => (await ledgerRows(world.bed.pool)).length === ASSETS && world.api.calls.length >= 8,
      { timeoutMs: 20_000, describe: async () => ({ ...(await ledgerDiagnosis(world.bed.pool)), calls: world.api.calls.length }) },
    );

    // Hold the answers while the pause is made: the calls in flight stay in progress (their slots
    // busy), so the backlog left does not depend on how long the CLI takes to start here. (The
    // client's timeout, 15 s, is far longer than the CLI takes even on a loaded machine.)
    world.api.configure({ hold: true });
    const paused = await runReaperCli(['pause', MEDIA_POLICY, '--json'], world.bed.processEnv());
    assert.equal(paused.code, 0, paused.stdout);
    const pausedAt = Date.now();
    const callsAtPause = world.api.calls.length;
    world.api.configure({ hold: false });
    world.api.release();
    const linesAtPause = workers.map((w) => w.lines.length);

    // Calls admitted before the pause may still start (at most C, right away); then none.
    await eventually('the calls in flight at the pause to finish', async () => {
      const inFlight = (await ledgerSummary(world.bed.pool)).in_flight ?? 0;
      return inFlight === 0 && world.api.calls.every((call) => call.finishedAt > 0);
    });
    // While paused the work waits in the ledger (issue 7, item 10): a batch that comes back is
    // parked (acked, its operations pending), and nothing cycles through the broker meanwhile.
    await eventually('the pause to be held for a while', () => Date.now() - pausedAt >= QUIET_MS, { timeoutMs: QUIET_MS + 10_000, intervalMs: 50 });
    const deliveriesAfterPause = workers.flatMap((w, index) =>
      w.lines.slice(linesAtPause[index]).filter((line) => line.msg === 'batch settled' || line.msg === 'batch delayed'),
    );
    const perBatch = new Map<string, number>();
    for (const line of deliveriesAfterPause) perBatch.set(String(line.batchId), (perBatch.get(String(line.batchId)) ?? 0) + 1);

    const lateCalls = world.api.calls.slice(callsAtPause);
    console.log(
      `[remote-pause] calls before pause returned=${callsAtPause} after=${lateCalls.length} ` +
        `(at +${lateCalls.map((call) => call.startedAt - pausedAt).join(', ')} ms) deliveries after the pause=${JSON.stringify([...perBatch])}`,
    );
    assert.ok(lateCalls.length <= C, `at most C = ${C} already-admitted calls after pause returned, saw ${lateCalls.length}`);
    // Exact, from the database's own stamps: every call after the pause was granted before it;
    // no grant after the pause was recorded (grants and the switch serialise on the admission row).
    const events = await admissionEvents.read();
    const pauseEvent = events.find((event) => event.kind === 'pause' && event.detail === 'true');
    assert.ok(pauseEvent, 'the pause was recorded');
    const claimsAfterPause = events.filter((event) => event.kind === 'claim' && event.ms > pauseEvent.ms);
    assert.deepEqual(claimsAfterPause, [], 'no grant after the pause was recorded');
    for (const [batchId, deliveries] of perBatch) {
      assert.ok(deliveries <= 2, `${batchId} delivered ${deliveries} times in ${QUIET_MS} ms of pause: batches must not cycle while paused`);
    }
    assert.deepEqual(
      deliveriesAfterPause.filter((line) => line.msg === 'batch delayed' && /paused/.test(String(line.reason))),
      [],
      'a paused batch waits in the ledger, not in a delay tier',
    );

    // Nothing lost: every operation is still there, open ones pending with their payload, rows untouched.
    const during = await ledgerRows(world.bed.pool);
    assert.deepEqual(during.map((row) => row.asset_id).sort(), ids, 'every operation still in the ledger');
    const pending = during.filter((row) => row.state === 'pending');
    const confirmed = during.filter((row) => row.outcome === 'confirmed');
    assert.equal(pending.length + confirmed.length, ASSETS, `only pending and confirmed operations: ${JSON.stringify(await ledgerSummary(world.bed.pool))}`);
    assert.ok(pending.length >= 10, `a backlog is left to drain (${pending.length} pending)`);
    assert.equal(confirmed.length, world.api.calls.length, 'each call so far confirmed one operation');
    for (const row of pending) {
      assert.equal(row.attempt_count, 0, `${row.operation_key}: not attempted`);
      assert.notEqual(row.payload, null, `${row.operation_key}: payload kept while pending`);
      assert.equal(row.lease_owner, null);
    }
    const statuses = await assetStatuses(world.bed.pool, ids);
    for (const row of pending) assert.equal(statuses.get(row.asset_id), 'active', `${row.asset_id} still active`);
    const admission = await world.bed.pool.query<{ paused: boolean }>('SELECT paused FROM cleanup_admission WHERE policy = $1', [MEDIA_POLICY]);
    assert.equal(admission.rows[0]?.paused, true);

    const resumed = await runReaperCli(['resume', MEDIA_POLICY], world.bed.processEnv());
    assert.equal(resumed.code, 0, resumed.stdout);
    const resumedAt = Date.now();
    await allConfirmed(world, ASSETS, 30_000, `all ${ASSETS} operations confirmed after resume`);
    const firstAfterResume = world.api.calls.find((call) => call.startedAt >= resumedAt);
    console.log(`[remote-pause] first call ${firstAfterResume ? firstAfterResume.startedAt - resumedAt : '-'} ms after resume returned; drained in ${Date.now() - resumedAt} ms`);

    const rows = await ledgerRows(world.bed.pool);
    assertRetention(rows);
    const byKey = callsByKey(world.api);
    const executions = world.api.executionsByKey();
    for (const row of rows) {
      assert.equal(byKey.get(row.operation_key)?.length, 1, `${row.operation_key}: one call`);
      assert.equal(executions.get(row.operation_key), 1, `${row.operation_key}: deleted once`);
      assert.equal(row.attempt_count, 1);
    }
    assert.equal(world.api.calls.length, ASSETS);
    assert.ok(world.api.maxConcurrent() <= C, `at most ${C} at once, saw ${world.api.maxConcurrent()}`);
    // The rate, exactly, on the database clock: the instants the grants were decided at (the
    // stand-in's arrival times would bunch whenever a loaded worker sends late).
    const claims = (await admissionEvents.read()).filter((event) => event.kind === 'claim');
    assert.deepEqual(
      claims.filter((claim) => !(claim.decidedMs !== null && claim.decidedMs >= claim.statementMs && claim.decidedMs <= claim.ms)),
      [],
      'each grant decided inside its own statement',
    );
    const busiestSecond = maxInSlidingWindow(claims.map((claim) => claim.decidedMs!), 1000);
    assert.ok(busiestSecond <= R + BURST, `at most ${R + BURST} grants decided in any second, saw ${busiestSecond}`);
    assert.deepEqual([...(await assetStatuses(world.bed.pool, ids)).values()].filter((s) => s !== 'deleted'), [], 'every asset marked deleted');

    await admissionEvents.remove();
    await stopAllCleanly(all);
  });
});
