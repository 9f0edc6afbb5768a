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
      CREATE TABLE test_admission_asks (at timestamptz NOT NULL DEFAULT clock_timestamp());
      CREATE FUNCTION test_admission_ask() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
        BEGIN INSERT INTO test_admission_asks DEFAULT VALUES; RETURN NEW; END $$;
      CREATE TRIGGER test_admission_ask AFTER UPDATE ON cleanup_admission FOR EACH ROW EXECUTE FUNCTION test_admission_ask();`);
  });

  after(async () => {
    await pool?.end();
    await bed?.close();
  });

  test('a take that must wait a second for its tokens asks at most three times, not five', async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'asks', batchSize: RATE }), 'test', {}).get('asks') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    // The bucket starts full: the first take empties it.
    assert.ok((await admitRows(pool, policy, RATE, { holdMs: 5_000 })).admitted, 'the first take finds a full bucket');
    await bed.pool.query('TRUNCATE test_admission_asks');
    const started = performance.now();
    const second = await admitRows(pool, policy, RATE, { holdMs: 5_000 });
    const waitedMs = performance.now() - started;
    assert.ok(second.admitted, 'the second take is admitted once its tokens have come in');
    const asks = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM test_admission_asks')).rows[0]!.n;
    // Refused at once (an empty bucket), asked again when RATE tokens are due (1 s), admitted then
    // (or a few ms later when the clock read a hair early). Asking every 250 ms makes it five.
    assert.ok(asks >= 2 && asks <= 3, `asks while waiting ${Math.round(waitedMs)} ms for one second of tokens: ${asks}`);
    // It did wait for tokens (so the asks above are the asks of a wait); the bound leaves room for
    // the tokens that came in while the test emptied its log on a slow machine.
    assert.ok(waitedMs >= 500, `the take waited for its tokens (${Math.round(waitedMs)} ms)`);
  });

  test("one worker's groups ask in turn, oldest first, not side by side for the same tokens", async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'turns', batchSize: RATE }), 'test', {}).get('turns') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    assert.ok((await admitRows(pool, policy, RATE, { holdMs: 5_000 })).admitted, 'the first take finds a full bucket');
    await bed.pool.query('TRUNCATE test_admission_asks');
    // Four groups of one worker (one pool), each a second of tokens: admitted about 1, 2, 3 and 4 s later.
    const admittedOrder: number[] = [];
    const groups = [0, 1, 2, 3].map(async (group) => {
      const outcome = await admitRows(pool, policy, RATE, { holdMs: 8_000 });
      if (outcome.admitted) admittedOrder.push(group);
      return outcome.admitted;
    });
    assert.deepEqual(await Promise.all(groups), [true, true, true, true], 'every group is admitted within its hold');
    assert.deepEqual(admittedOrder, [0, 1, 2, 3], 'oldest first');
    const asks = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM test_admission_asks')).rows[0]!.n;
    // In turn: each asks when its turn comes (refused: the one before just took the tokens) and once
    // more when its tokens are due: 8, a few more when a clock reads a hair early. Side by side, the
    // waiting groups all ask each time tokens seem due: 4 + 4 + 3 + 2 + 1.
    assert.ok(asks >= 8 && asks <= 11, `asks of four groups waiting in one worker: ${asks}`);
  });

  test('a group that cannot get its turn within its hold is refused without asking', async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'queued', batchSize: RATE }), 'test', {}).get('queued') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    assert.ok((await admitRows(pool, policy, RATE, { holdMs: 5_000 })).admitted, 'the first take finds a full bucket');
    await bed.pool.query('TRUNCATE test_admission_asks');
    // The first in line waits about a second for its tokens; the second would have to wait for it.
    const first = admitRows(pool, policy, RATE, { holdMs: 5_000 });
    const second = await admitRows(pool, policy, RATE, { holdMs: 200 });
    assert.equal(second.admitted, false);
    assert.equal((second as { reason: string }).reason, 'throttled');
    // By now the first has asked once (refused: its tokens are due in a second); the second never did.
    const asks = (await bed.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM test_admission_asks')).rows[0]!.n;
    assert.equal(asks, 1, 'only the group in turn asked');
    assert.ok((await first).admitted, 'the one in turn is admitted');
  });

  test('a group that gives up waiting for its turn says why the one in turn is still waiting', async () => {
    const file = parsePolicies(rowDeletePolicyYaml({ name: 'held-back', batchSize: RATE }), 'test', {}).get('held-back') as RowDeletePolicy;
    const policy: RowDeletePolicy = { ...file, admission: { adaptive: false, rowsPerSecond: RATE, burst: RATE } };
    assert.ok((await admitRows(pool, policy, 1, { holdMs: 5_000 })).admitted, 'the bucket row is there');
    await bed.pool.query('UPDATE cleanup_admission SET paused = true WHERE policy = $1', [policy.name]);
    const first = admitRows(pool, policy, 1, { holdMs: 1_000 });
    const second = await admitRows(pool, policy, 1, { holdMs: 300 });
    assert.deepEqual({ admitted: second.admitted, reason: (second as { reason?: string }).reason }, { admitted: false, reason: 'paused' });
    const firstOutcome = await first;
    assert.deepEqual({ admitted: firstOutcome.admitted, reason: (firstOutcome as { reason?: string }).reason }, { admitted: false, reason: 'paused' });
  });
});
