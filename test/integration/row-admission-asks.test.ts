import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type pg from 'pg';
import { admitRows } from '../../shared/admission/rows';
import { parsePolicies, type RowDeletePolicy } from '../../shared/config/policies';
import { makePool } from '../../shared/db/pool';
import { rowDeletePolicyYaml } from '../support/fixtures';
import { makeTestBed, type TestBed } from '../support/testbed';

/** Rows per second of the test's policy, and rows per take: a take that finds the bucket empty waits one second for its tokens. */
const RATE = 20;

/**
 * A throttled row-delete group asks the shared bucket again when its missing tokens are due at the
 * rate, not every 250 ms: every ask is an UPDATE of the policy's cleanup_admission row and a commit
 * on the database the application uses (bench figure 7 at the adaptive floor: 15-45 of them a
 * second for one admitted statement). Counted on the real server by a trigger on that row.
 */
describe('row-delete admission: a throttled group asks again when its tokens are due, in turn', () => {
  let bed: TestBed;
  let pool: pg.Pool;

  before(async () => {
    bed = await makeTestBed('row_admission_asks');
    pool = makePool(bed.databaseUrl, 2, 'reaper-asks-test');
    await bed.pool.query(`
      CREATE TABLE test_admission_asks (at timestamptz NOT NULL DEFAULT clock_timestamp(), refilled_at timestamptz, tokens float8);
      CREATE FUNCTION test_admission_ask() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
        BEGIN INSERT INTO test_admission_asks (refilled_at, tokens) VALUES (NEW.refilled_at, NEW.tokens); RETURN NEW; END $$;
      CREATE TRIGGER test_admission_ask AFTER UPDATE ON cleanup_admission FOR EACH ROW EXECUTE FUNCTION test_admission_ask();`);
  });

  after(async () => {
    await pool?.end();
    await bed?.close();
  });

  test('a take that must wait a second for its tokens asks at most three times, not five', async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'asks', batchSize: RATE }), 'test', {}).get('asks') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    // Nothing between the take that empties the bucket and the next (the log is emptied before and
    // the first take's ask subtracted): on a slow machine no tokens come in while the test works.
    await bed.pool.query('TRUNCATE test_admission_asks');
    // The bucket starts full: the first take empties it.
    assert.ok((await admitRows(pool, policy, RATE, { holdMs: 5_000 })).admitted, 'the first take finds a full bucket');
    const second = await admitRows(pool, policy, RATE, { holdMs: 5_000 });
    assert.ok(second.admitted, 'the second take is admitted once its tokens have come in');
    const asks = (await bed.pool.query<{ refilled: Date }>('SELECT refilled_at AS refilled FROM test_admission_asks ORDER BY at')).rows.map((row) => row.refilled.getTime());
    // Refused at once (an empty bucket), asked again when RATE tokens are due (1 s), admitted then
    // (or a few ms later when the clock read a hair early). Asking every 250 ms makes it five.
    const secondAsks = asks.length - 1;
    assert.ok(secondAsks >= 2 && secondAsks <= 3, `asks while waiting for one second of tokens: ${secondAsks}`);
    // It did wait for its tokens (so the asks above are the asks of a wait), by the database clock:
    // admitted a second of tokens after the first take emptied the bucket.
    const waitedMs = asks[asks.length - 1]! - asks[0]!;
    assert.ok(waitedMs >= 999, `the take was admitted ${waitedMs} ms (database clock) after the bucket was emptied`);
  });

  test("one worker's groups ask in turn, oldest first, not side by side for the same tokens", async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'turns', batchSize: RATE }), 'test', {}).get('turns') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    // Emptied before the first take, whose ask is subtracted: nothing between it and the groups.
    await bed.pool.query('TRUNCATE test_admission_asks');
    assert.ok((await admitRows(pool, policy, RATE, { holdMs: 5_000 })).admitted, 'the first take finds a full bucket');
    // Four groups of one worker (one pool), each a second of tokens: admitted about 1, 2, 3 and 4 s later.
    const admittedOrder: number[] = [];
    const groups = [0, 1, 2, 3].map(async (group) => {
      const outcome = await admitRows(pool, policy, RATE, { holdMs: 8_000 });
      if (outcome.admitted) admittedOrder.push(group);
      return outcome.admitted;
    });
    assert.deepEqual(await Promise.all(groups), [true, true, true, true], 'every group is admitted within its hold');
    assert.deepEqual(admittedOrder, [0, 1, 2, 3], 'oldest first');
    const asks = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM test_admission_asks')).rows[0]!.n - 1;
    // In turn: each asks when its turn comes (refused: the one before just took the tokens) and once
    // more when its tokens are due: 8, a few more when a clock reads a hair early. Side by side, the
    // waiting groups all ask each time tokens seem due: 4 + 4 + 3 + 2 + 1.
    assert.ok(asks >= 8 && asks <= 11, `asks of four groups waiting in one worker: ${asks}`);
  });

  test('a group that cannot get its turn within its hold is refused without asking', async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'queued', batchSize: RATE }), 'test', {}).get('queued') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    // Emptied before the take that empties the bucket: nothing between it and the first in line.
    await bed.pool.query('TRUNCATE test_admission_asks');
    assert.ok((await admitRows(pool, policy, RATE, { holdMs: 5_000 })).admitted, 'the first take finds a full bucket');
    // The first in line asks, is refused (its tokens are due in about a second) and says so through
    // `stopping`, which a group consults after each refused ask: the second starts only then, not
    // after a time that a slow machine might overrun.
    let firstRefused!: () => void;
    const refusedOnce = new Promise<void>((resolve) => (firstRefused = resolve));
    const first = admitRows(pool, policy, RATE, { holdMs: 5_000, stopping: () => (firstRefused(), false) });
    await refusedOnce;
    const second = await admitRows(pool, policy, RATE, { holdMs: 200 });
    assert.equal(second.admitted, false);
    assert.equal((second as { reason: string }).reason, 'throttled');
    // The first asked once (refused) and asks again when its tokens are due, a second after the
    // take that emptied the bucket (its timer cannot fire early, however slow the machine); the
    // second never asked. Read by the database clock, within 900 ms of the emptying take: a second
    // group asking side by side would have asked there.
    const asks = (await bed.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM test_admission_asks WHERE at < (SELECT min(at) FROM test_admission_asks) + interval '900 milliseconds'`,
    )).rows[0]!.n;
    assert.equal(asks - 1, 1, 'only the group in turn asked (besides the take that emptied the bucket)');
    assert.ok((await first).admitted, 'the one in turn is admitted');
  });

  test('a group that gives up waiting for its turn says why the one in turn is still waiting', async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'held-back', batchSize: RATE }), 'test', {}).get('held-back') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    assert.ok((await admitRows(pool, policy, 1, { holdMs: 5_000 })).admitted, 'the bucket row is there');
    await bed.pool.query('UPDATE cleanup_admission SET paused = true WHERE policy = $1', [policy.name]);
    // The one in turn waits (paused) until the test lets it give up; the second starts once the
    // first was refused at least once (`stopping` is consulted after each refused ask), not after a time.
    let firstRefused!: () => void;
    const refusedOnce = new Promise<void>((resolve) => (firstRefused = resolve));
    let giveUp = false;
    const first = admitRows(pool, policy, 1, { holdMs: 30_000, stopping: () => (firstRefused(), giveUp) });
    await refusedOnce;
    const second = await admitRows(pool, policy, 1, { holdMs: 300 });
    giveUp = true;
    assert.deepEqual({ admitted: second.admitted, reason: (second as { reason?: string }).reason }, { admitted: false, reason: 'paused' });
    const firstOutcome = await first;
    assert.deepEqual({ admitted: firstOutcome.admitted, reason: (firstOutcome as { reason?: string }).reason }, { admitted: false, reason: 'paused' });
  });
});
