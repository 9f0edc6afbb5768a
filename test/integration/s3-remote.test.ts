import assert from 'node:assert/strict';
import { after, before, beforeEach, describe, test } from 'node:test';
import { recordRemoteBatch } from '../../services/worker/handlers/remote-delivery';
import { makeS3DeleteHandler } from '../../services/worker/handlers/s3-delete';
import { OUTBOX_FULL_REASON } from '../../services/worker/outbox-limit';
import { outboxEventCount } from '../../shared/db/queries/outbox';
import { admitAndClaimS3, S3_KEY_PACE, S3_SEND_LEAD_MS, S3_SEND_MIN_LEAD_MS, type S3Grant } from '../../shared/admission/s3';
import type { BatchHandler } from '../../services/worker/handlers/types';
import { parsePolicies, type S3DeletePolicy } from '../../shared/config/policies';
import { admissionSetPaused } from '../../shared/db/queries/admission';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { holdsAdd } from '../../shared/db/queries/holds';
import { makeObjectStorageClient } from '../../shared/remote/s3';
import { startS3StandIn, type S3StandIn } from '../../tools/s3-stand-in/server';
import { assetStatuses, ledgerRows, MEDIA_POLICY, seedAssets } from '../support/remote-helpers';
import { auditCounts, batchFor, handlerContext, objectExists, putObjects, s3Environment, s3PolicyYaml } from '../support/s3-helpers';
import { requireTool, type Requirement } from '../support/requirements';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Object storage as a remote (issue 21), against a real S3-protocol server (s3rver, in this
 * process) behind the stand-in's recording proxy, with the object storage handler run in this
 * process: DeleteObjects batching, per-key results mapped to the ledger, a whole-request SlowDown
 * blocking the policy, and the claim's re-check (renewal, legal hold) before a key joins a request.
 */
describe('object storage remote (s3rver)', () => {
  let bed: TestBed;
  let stand: S3StandIn;
  let policy: S3DeletePolicy;
  let target: ResolvedTarget;
  let handle: BatchHandler;
  const saved = { ...process.env };

  before(async () => {
    bed = await makeTestBed('s3_remote');
    stand = await startS3StandIn({ bucket: 'media-bucket' });
    // The SDK's default credential chain reads the environment: the stand-in's development pair.
    Object.assign(process.env, s3Environment(stand));
    const policies = parsePolicies(
      s3PolicyYaml({ endpoint: stand.endpoint, requestsPerSecond: 200, keysPerSecond: 5000, concurrency: 4, maxKeysPerRequest: 10, batchSize: 25, maxAttempts: 3 }),
      'test-policies.yaml',
      {},
    );
    policy = policies.get(MEDIA_POLICY) as S3DeletePolicy;
    target = await targetResolve(bed.pool, policy);
    handle = makeS3DeleteHandler(policy, target, makeObjectStorageClient(policy.remote));
  });

  after(async () => {
    process.env = saved;
    await stand?.close();
    await bed?.close();
  });

  beforeEach(async () => {
    stand.calls.length = 0;
    stand.keyErrors.clear();
    await bed.pool.query(`UPDATE cleanup_admission SET blocked_until = NULL WHERE policy = $1`, [MEDIA_POLICY]);
  });

  test('a batch of 25 keys goes out as DeleteObjects requests of at most maxKeysPerRequest (10, 10, 5); each key confirmed, audited once, its row settled', async () => {
    const ids = await seedAssets(bed.pool, 'batched', 25);
    await putObjects(stand, ids);
    const result = await handle(await batchFor(bed.pool, ids), handlerContext(bed.pool));
    assert.equal(result.kind, 'done', JSON.stringify({ result, ledger: (await bed.pool.query(`SELECT state, last_result, last_error FROM cleanup_ledger WHERE state <> 'done'`)).rows, calls: stand.deleteCalls().map((c) => [c.keys.length, c.status]) }));
    const requests = stand.deleteCalls();
    assert.deepEqual(requests.map((call) => call.keys.length), [10, 10, 5], 'three requests for 25 keys, none over 10');
    assert.deepEqual(requests.flatMap((call) => call.keys).sort(), ids.map((id) => `media/${id}`), 'every key sent exactly once');
    for (const id of ids) assert.equal(await objectExists(stand, id), false, `${id}: the object is gone`);
    const rows = await ledgerRows(bed.pool, ids);
    assert.deepEqual(rows.map((row) => `${row.state}/${row.outcome}/${row.attempt_count}`), ids.map(() => 'done/confirmed/1'));
    // One request id per DeleteObjects: ten, ten and five operations share one each.
    const shared = await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_ledger WHERE asset_id = ANY($1::text[]) GROUP BY claim_request_id ORDER BY 1 DESC`, [ids]);
    assert.deepEqual(shared.rows.map((row) => row.n), [10, 10, 5]);
    const audits = await auditCounts(bed.pool);
    for (const id of ids) assert.equal(audits.get(id), 1, `${id}: one audit row`);
    assert.deepEqual([...(await assetStatuses(bed.pool, ids)).values()], ids.map(() => 'deleted'));
  });

  test('per-key errors: AccessDenied ends rejected (object and row kept, no audit), InternalError is retried with the same operation, the rest confirmed', async () => {
    const ids = await seedAssets(bed.pool, 'per-key', 4);
    await putObjects(stand, ids);
    const [denied, flaky] = [ids[0]!, ids[1]!];
    stand.keyErrors.set(`media/${denied}`, 'AccessDenied');
    stand.keyErrors.set(`media/${flaky}`, 'InternalError');
    const batch = await batchFor(bed.pool, ids);
    const first = await handle(batch, handlerContext(bed.pool));
    assert.notEqual(first.kind, 'unknown', JSON.stringify(first));
    const rows = new Map((await ledgerRows(bed.pool, ids)).map((row) => [row.asset_id, row]));
    assert.equal(rows.get(denied)!.outcome, 'rejected');
    assert.equal(rows.get(denied)!.last_result, 'S3 AccessDenied');
    assert.equal(rows.get(flaky)!.state, 'pending', 'a retryable key error puts the operation back to pending');
    assert.equal(rows.get(flaky)!.last_result, 'S3 InternalError');
    assert.equal(rows.get(flaky)!.attempt_count, 1);
    for (const id of ids.slice(2)) assert.equal(rows.get(id)!.outcome, 'confirmed');
    assert.equal(await objectExists(stand, denied), true, 'the refused object is still there');
    assert.equal((await assetStatuses(bed.pool, [denied])).get(denied), 'active', 'the refused asset row is kept for review');
    assert.equal((await auditCounts(bed.pool)).get(denied), undefined, 'no audit row for a refused key');

    // The store recovers: the same operation (same key, attempt 2) deletes it; the refused one is never sent again.
    stand.keyErrors.clear();
    await bed.pool.query(`UPDATE cleanup_ledger SET not_before = clock_timestamp() WHERE asset_id = $1`, [flaky]);
    const second = await handle(batch, handlerContext(bed.pool));
    assert.equal(second.kind, 'done', JSON.stringify(second));
    const [again] = await ledgerRows(bed.pool, [flaky]);
    assert.equal(`${again!.state}/${again!.outcome}/${again!.attempt_count}`, 'done/confirmed/2');
    assert.equal(again!.operation_key, rows.get(flaky)!.operation_key, 'the same operation');
    const sent = stand.deleteCalls().flatMap((call) => call.keys);
    assert.equal(sent.filter((key) => key === `media/${denied}`).length, 1, 'the rejected key was sent once, never retried');
    assert.equal(sent.filter((key) => key === `media/${flaky}`).length, 2, 'the retryable key was sent twice');
  });

  test('a whole-request 503 SlowDown blocks the policy for every worker (backoff), then the same keys are sent again and confirmed', async () => {
    const ids = await seedAssets(bed.pool, 'slow-down', 5);
    await putObjects(stand, ids);
    stand.slowDown(1);
    const batch = await batchFor(bed.pool, ids);
    const first = await handle(batch, handlerContext(bed.pool));
    assert.notEqual(first.kind, 'unknown', JSON.stringify(first));
    const block = await bed.pool.query<{ blocked_ms: number }>(
      `SELECT extract(epoch FROM blocked_until - clock_timestamp()) * 1000 AS blocked_ms FROM cleanup_admission WHERE policy = $1`,
      [MEDIA_POLICY],
    );
    assert.ok(block.rows[0]!.blocked_ms > 0, `the policy is blocked after SlowDown (${block.rows[0]!.blocked_ms} ms left)`);
    const rows = await ledgerRows(bed.pool, ids);
    assert.deepEqual(rows.map((row) => `${row.state}/${row.last_result}`), ids.map(() => 'pending/rate-limited'));
    for (const id of ids) assert.equal(await objectExists(stand, id), true, 'nothing deleted by the throttled request');
    // While blocked, a delivery sends nothing, even for keys already due. The block the handler set
    // lasts about a second (attempt 1); it is lengthened here, and the keys made due, so that a slow
    // machine cannot let it lapse before the delivery below (the CI run of ad4b826 did): the
    // policy-wide block alone must hold them back.
    await bed.pool.query(`UPDATE cleanup_admission SET blocked_until = clock_timestamp() + interval '1 minute' WHERE policy = $1`, [MEDIA_POLICY]);
    await bed.pool.query(`UPDATE cleanup_ledger SET not_before = clock_timestamp() WHERE asset_id = ANY($1::text[])`, [ids]);
    const blocked = await handle(batch, handlerContext(bed.pool));
    assert.notEqual(blocked.kind, 'unknown');
    assert.equal(stand.deleteCalls().length, 1, 'no request while the policy is blocked');

    await bed.pool.query(`UPDATE cleanup_admission SET blocked_until = clock_timestamp(), tokens = 10, request_tokens = 20 WHERE policy = $1`, [MEDIA_POLICY]);
    await bed.pool.query(`UPDATE cleanup_ledger SET not_before = clock_timestamp() WHERE asset_id = ANY($1::text[])`, [ids]);
    const after = await handle(batch, handlerContext(bed.pool));
    assert.equal(after.kind, 'done', JSON.stringify(after));
    const calls = stand.deleteCalls();
    assert.deepEqual(calls.map((call) => [call.status, call.injected]), [[503, 'slow-down'], [200, null]]);
    assert.deepEqual(calls[1]!.keys.sort(), calls[0]!.keys.sort(), 'the retry carries the same keys');
    assert.deepEqual((await ledgerRows(bed.pool, ids)).map((row) => row.outcome), ids.map(() => 'confirmed'));
  });

  test('renewed or held between record and claim: the claim re-checks each row, neither key joins a request, both objects stay', async () => {
    const ids = await seedAssets(bed.pool, 'recheck', 4);
    await putObjects(stand, ids);
    const [renewed, held] = [ids[0]!, ids[1]!];
    const batch = await batchFor(bed.pool, ids);
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], true, new Map([[MEDIA_POLICY, 10]]));
    const recorded = await handle(batch, handlerContext(bed.pool));
    assert.equal(recorded.kind, 'done', 'paused: recorded and parked');
    assert.deepEqual((await ledgerRows(bed.pool, ids)).map((row) => row.state), ids.map(() => 'pending'));
    assert.equal(stand.deleteCalls().length, 0);

    await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '30 days' WHERE asset_id = $1`, [renewed]);
    await holdsAdd(bed.pool, target, { ids: [held], reason: 'litigation', until: null, createdBy: 'test' });
    await admissionSetPaused(bed.pool, [MEDIA_POLICY], false, new Map([[MEDIA_POLICY, 10]]));
    await bed.pool.query(`UPDATE cleanup_ledger SET not_before = clock_timestamp() WHERE asset_id = ANY($1::text[])`, [ids]);
    const result = await handle(batch, handlerContext(bed.pool));
    assert.equal(result.kind, 'done', JSON.stringify(result));
    const rows = new Map((await ledgerRows(bed.pool, ids)).map((row) => [row.asset_id, row]));
    assert.equal(rows.get(renewed)!.outcome, 'superseded');
    assert.equal(rows.get(held)!.outcome, 'held');
    assert.equal(rows.get(renewed)!.attempt_count, 0);
    assert.equal(rows.get(held)!.attempt_count, 0);
    const sent = stand.deleteCalls().flatMap((call) => call.keys);
    assert.deepEqual(sent.sort(), ids.slice(2).map((id) => `media/${id}`), 'only the still-eligible keys were sent');
    assert.equal(await objectExists(stand, renewed), true);
    assert.equal(await objectExists(stand, held), true);
  });

  test('a lost answer (transport failure) leaves the keys uncertain; the retry sends the same keys and the ledger ends confirmed, one audit row each', async () => {
    const ids = await seedAssets(bed.pool, 'lost-answer', 3);
    await putObjects(stand, ids);
    // The first request's answer is held by the stand-in, so a short timeout ends it as a lost
    // answer whatever the machine's speed. The retry gets the answer, and a timeout a loaded
    // machine cannot miss (issue 43): with the same 300 ms, the retry of a clean-clone CI under two
    // busy loops timed out too and the ledger stayed uncertain (attempt 2, no outcome).
    const withTimeout = (timeoutMs: number, leaseMs: number) => {
      const policy = parsePolicies(
        s3PolicyYaml({ endpoint: stand.endpoint, requestsPerSecond: 200, keysPerSecond: 5000, concurrency: 4, maxKeysPerRequest: 10, batchSize: 25, timeoutMs, leaseMs }),
        'test-policies.yaml',
        {},
      ).get(MEDIA_POLICY) as S3DeletePolicy;
      return makeS3DeleteHandler(policy, target, makeObjectStorageClient(policy.remote));
    };
    const shortHandle = withTimeout(300, 10_300);
    const retryHandle = withTimeout(10_000, 20_000);
    stand.holdAnswers = true;
    const batch = await batchFor(bed.pool, ids);
    const first = await shortHandle(batch, handlerContext(bed.pool));
    stand.holdAnswers = false;
    stand.releaseAnswers();
    assert.notEqual(first.kind, 'unknown', JSON.stringify(first));
    const rows = await ledgerRows(bed.pool, ids);
    assert.deepEqual(rows.map((row) => `${row.state}/${row.last_result}`), ids.map(() => 'pending/uncertain'));
    for (const id of ids) assert.equal(await objectExists(stand, id), false, 'the store did delete them: only the answer was lost');
    await bed.pool.query(`UPDATE cleanup_ledger SET not_before = clock_timestamp() WHERE asset_id = ANY($1::text[])`, [ids]);
    const second = await retryHandle(batch, handlerContext(bed.pool));
    assert.equal(second.kind, 'done', JSON.stringify(second));
    const calls = stand.deleteCalls();
    assert.equal(calls.length, 2);
    assert.deepEqual(calls[1]!.keys.sort(), calls[0]!.keys.sort(), 'retried with the same keys');
    assert.deepEqual((await ledgerRows(bed.pool, ids)).map((row) => `${row.outcome}/${row.attempt_count}`), ids.map(() => 'confirmed/2'));
    const audits = await auditCounts(bed.pool);
    for (const id of ids) assert.equal(audits.get(id), 1, `${id}: one audit row`);
  });

  test('onSend is called once, as the signed DeleteObjects is handed to HTTP, before the store sees it; a throw in it sends nothing (uncertain)', async () => {
    const client = makeObjectStorageClient(policy.remote);
    const sendCalls: number[] = [];
    const outcome = await client.deleteKeys(['media/hook-1', 'media/hook-2'], { onSend: () => void sendCalls.push(Date.now()) });
    assert.equal(outcome.kind, 'answered', JSON.stringify(outcome));
    assert.equal(sendCalls.length, 1, 'once per request');
    const [call] = stand.deleteCalls();
    assert.ok(call && call.arrivedAt >= sendCalls[0]!, 'the store saw the request after onSend');
    const refused = await client.deleteKeys(['media/hook-3'], {
      onSend: () => {
        throw new Error('not now');
      },
    });
    assert.equal(refused.kind, 'uncertain', JSON.stringify(refused));
    assert.equal(stand.deleteCalls().length, 1, 'nothing more reached the store');
  });

  test("sending on the bucket's clock: a grant from a full bucket leaves no sooner than the minimum lead, the next one granted at once a request's keys later, and no more is lent than the lead", async (t) => {
    // 100 keys/s, 10 keys a request: 102 ms of keys per request at the pace, a lead of 30 keys.
    const slow = parsePolicies(
      s3PolicyYaml({ endpoint: stand.endpoint, requestsPerSecond: 100, keysPerSecond: 100, concurrency: 4, maxKeysPerRequest: 10, batchSize: 30 }),
      'test-policies.yaml',
      {},
    ).get(MEDIA_POLICY) as S3DeletePolicy;
    const requestMs = (10 / (100 * S3_KEY_PACE)) * 1000;
    type Asked = { grant: S3Grant; askedAt: number; answeredAt: number };
    /** From a full bucket (the policy's admission row removed): three claims one after another, each timed by this process. */
    const threeClaims = async (attempt: number): Promise<{ asked: number; grants: Asked[] }> => {
      await bed.pool.query(`DELETE FROM cleanup_admission WHERE policy = $1`, [MEDIA_POLICY]);
      const ids = await seedAssets(bed.pool, `send-clock-${attempt}`, 30);
      const batch = await batchFor(bed.pool, ids);
      const recorded = await recordRemoteBatch(slow.name, target, batch, handlerContext(bed.pool));
      const claim = () => admitAndClaimS3(bed.pool, slow, target, { keys: recorded.known, owner: 'test-worker', cutoff: batch.cutoff, batchId: batch.batchId });
      const asked = performance.now();
      const grants: Asked[] = [];
      try {
        for (let i = 0; i < 3; i++) {
          const askedAt = performance.now();
          grants.push({ grant: await claim(), askedAt, answeredAt: performance.now() });
        }
      } finally {
        // The claims' requests and keys handed back: the next attempt (and test) starts from nothing in flight.
        await bed.pool.query(`DELETE FROM cleanup_admission WHERE policy = $1`, [MEDIA_POLICY]);
        await bed.pool.query(`UPDATE cleanup_ledger SET state = 'done', outcome = 'superseded' WHERE asset_id = ANY($1::text[])`, [ids]);
      }
      return { asked, grants };
    };
    // Whether two requests are lent ahead and the third waits depends on the bucket refilling less
    // than a request between the first claim and the third, i.e. on how fast three claims answer
    // here. No mode of this machine skips the assertions: every attempt checks what holds at any
    // speed, and the attempts go on (a fresh bucket and fresh keys each) until one was asked in
    // quick succession, which is then checked too (none in 20: see below).
    let quickAttempt: { asked: number; grants: Asked[] } | undefined;
    const spans: number[] = [];
    for (let attempt = 0; attempt < 20 && !quickAttempt; attempt++) {
      const { asked, grants } = await threeClaims(attempt);
      const first = grants[0]!.grant;
      assert.ok(first.sendAt - asked >= S3_SEND_MIN_LEAD_MS - 2, `the first may leave ${(first.sendAt - asked).toFixed(1)} ms after it was asked for (minimum lead ${S3_SEND_MIN_LEAD_MS})`);
      // Whatever the machine's speed: each grant leaves at least one request's keys after the one
      // before, and none is granted further ahead than the lead.
      const granted = grants.filter((entry) => entry.grant.claimed.length > 0);
      assert.deepEqual(granted.map((entry) => entry.grant.claimed.length), granted.map(() => 10), 'whole requests');
      for (let i = 1; i < granted.length; i++) {
        const apart = granted[i]!.grant.sendAt - granted[i - 1]!.grant.sendAt;
        // Slack: each grant's bucket instant is put on this process's clock through its own
        // statement's timing, so a grant's sendAt is late by up to the time its answer took to come
        // back (bounded by its claim's round trip: a few ms on an idle machine, tens under load).
        const slack = 8 + (granted[i - 1]!.answeredAt - granted[i - 1]!.askedAt);
        assert.ok(apart >= requestMs - slack, `request ${i + 1} leaves ${apart.toFixed(1)} ms after the one before (one request's keys: ${requestMs.toFixed(1)} ms, slack ${slack.toFixed(1)} ms)`);
      }
      for (const entry of granted) assert.ok(entry.grant.sendAt - entry.answeredAt <= S3_SEND_LEAD_MS + 5, `granted ${(entry.grant.sendAt - entry.answeredAt).toFixed(1)} ms ahead (lead ${S3_SEND_LEAD_MS})`);
      // Asked in quick succession: the bucket refilled less than half a request meanwhile.
      spans.push(Math.round(grants[2]!.answeredAt - asked));
      if (grants[2]!.answeredAt - asked < requestMs / 2) quickAttempt = { asked, grants };
    }
    // A machine too loaded for three claims to answer within half a request's keys (two busy loops
    // on both cores: 74-367 ms, measured) cannot show lending ahead at all: the test is then skipped
    // visibly (counted in test/run.js's summary; a failure with REAPER_TEST_REQUIRE_ALL=1), after
    // the assertions above ran on every attempt.
    const quickEnough: Requirement = {
      what: `three claims answered within ${(requestMs / 2).toFixed(0)} ms, to show lending ahead`,
      missing: async () => (quickAttempt ? undefined : `no attempt of 20 was that quick (ms: ${spans.join(', ')}); a machine this loaded cannot show it`),
    };
    if (!(await requireTool(t, quickEnough)) || !quickAttempt) return;
    // Asked in quick succession: two requests are lent ahead, one request's keys apart, and the third waits.
    const [first, second, third] = quickAttempt.grants.map((entry) => entry.grant) as [S3Grant, S3Grant, S3Grant];
    assert.deepEqual([first.claimed.length, second.claimed.length, third.claimed.length], [10, 10, 0], 'two requests granted ahead, the third waits');
    assert.equal(third.verdict, 'no-token');
    assert.ok(second.sendAt - first.sendAt <= requestMs + 20, `the second leaves ${(second.sendAt - first.sendAt).toFixed(1)} ms after the first (one request's keys: ${requestMs.toFixed(1)} ms)`);
  });

  test('a request that leaves late charges its lateness to the keys bucket, so the next grant moves back as far', async () => {
    const ids = await seedAssets(bed.pool, 'late-send', 3);
    const real = makeObjectStorageClient(policy.remote);
    const late = makeS3DeleteHandler(policy, target, {
      warmUp: () => real.warmUp(),
      async deleteKeys(keys, options) {
        // The worker is slow to send (a loaded machine, a long pause): 400 ms between grant and send.
        await new Promise((resolve) => setTimeout(resolve, 400));
        return real.deleteKeys(keys, options);
      },
    });
    const result = await late(await batchFor(bed.pool, ids), handlerContext(bed.pool));
    assert.equal(result.kind, 'done', JSON.stringify(result));
    // 5,000 keys/s (paced at 0.98) for >= 400 ms late: about 1,960 keys charged against a bucket of
    // 10; without the charge the bucket would be back near full by now.
    const { tokens } = (await bed.pool.query<{ tokens: number }>(`SELECT tokens::float8 AS tokens FROM cleanup_admission WHERE policy = $1`, [MEDIA_POLICY])).rows[0]!;
    assert.ok(tokens < -1000, `keys bucket after a 400 ms late send: ${tokens} (expected a debt of about 1,960 keys)`);
    await bed.pool.query(`UPDATE cleanup_admission SET tokens = 0 WHERE policy = $1`, [MEDIA_POLICY]);
  });

  test('held or renewed while the request is in flight: the object is gone (confirmed, audited), the held row is kept (outcome held), the renewed row untouched, the rest settled', async () => {
    const ids = await seedAssets(bed.pool, 'in-flight', 3);
    await putObjects(stand, ids);
    const [held, renewed, plain] = [ids[0]!, ids[1]!, ids[2]!];
    const real = makeObjectStorageClient(policy.remote);
    const meanwhile = makeS3DeleteHandler(policy, target, {
      warmUp: () => real.warmUp(),
      async deleteKeys(keys, options) {
        const outcome = await real.deleteKeys(keys, options);
        // While the answer travels back: a legal hold on one asset, a renewal of another.
        await holdsAdd(bed.pool, target, { ids: [held], reason: 'litigation', until: null, createdBy: 'test' });
        await bed.pool.query(`UPDATE media_assets SET retention_expires_at = now() + interval '30 days' WHERE asset_id = $1`, [renewed]);
        return outcome;
      },
    });
    const result = await meanwhile(await batchFor(bed.pool, ids), handlerContext(bed.pool));
    assert.equal(result.kind, 'done', JSON.stringify(result));
    const rows = new Map((await ledgerRows(bed.pool, ids)).map((row) => [row.asset_id, row]));
    assert.equal(rows.get(held)!.outcome, 'held', 'the store deleted it, the row is kept under its hold');
    assert.equal(rows.get(renewed)!.outcome, 'confirmed');
    assert.equal(rows.get(plain)!.outcome, 'confirmed');
    const statuses = await assetStatuses(bed.pool, ids);
    assert.deepEqual([statuses.get(held), statuses.get(renewed), statuses.get(plain)], ['active', 'active', 'deleted']);
    for (const id of ids) assert.equal(await objectExists(stand, id), false);
    const audits = await auditCounts(bed.pool);
    assert.deepEqual(ids.map((id) => audits.get(id)), [1, 1, 1], 'every deleted object audited once');
  });
  test('events.maxOutbox: a worker counts its own confirmed keys against the limit between two readings of the outbox, so it pauses without waiting for the next reading', async () => {
    const limited = parsePolicies(
      s3PolicyYaml({ endpoint: stand.endpoint, requestsPerSecond: 200, keysPerSecond: 5000, concurrency: 4, maxKeysPerRequest: 10, batchSize: 25, maxAttempts: 3, events: { maxOutbox: 3 } }),
      'test-policies.yaml',
      {},
    ).get(MEDIA_POLICY) as S3DeletePolicy;
    const limitedHandle = makeS3DeleteHandler(limited, target, makeObjectStorageClient(limited.remote));
    await bed.pool.query(`DELETE FROM cleanup_outbox WHERE policy = $1`, [MEDIA_POLICY]);
    const ids = await seedAssets(bed.pool, 'outbox-limit', 6);
    await putObjects(stand, ids);
    // Three deliveries of two keys, back to back: the first reads the outbox (empty) and the
    // reading is trusted for OUTBOX_CHECK_TTL_MS (2 s) unless the worker's own deletions since
    // would reach the limit. After two deliveries the worker has added 4 events >= 3: the third
    // must read the outbox again and pause. Without counting its own deletions it would go on
    // deleting for the rest of the 2 s.
    const results = [];
    for (const pair of [ids.slice(0, 2), ids.slice(2, 4), ids.slice(4, 6)]) results.push(await limitedHandle(await batchFor(bed.pool, pair), handlerContext(bed.pool)));
    assert.deepEqual(results.map((result) => result.kind), ['done', 'done', 'retry'], JSON.stringify(results));
    assert.equal((results[2] as { reason?: string }).reason, OUTBOX_FULL_REASON);
    assert.equal(await outboxEventCount(bed.pool, MEDIA_POLICY), 4, 'two deliveries\' events, none of the third');
    assert.deepEqual([...(await assetStatuses(bed.pool, ids.slice(4))).values()], ['active', 'active'], 'the paused delivery deleted nothing');
    await bed.pool.query(`DELETE FROM cleanup_outbox WHERE policy = $1`, [MEDIA_POLICY]);
  });
});
