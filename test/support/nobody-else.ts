import { lookSawSomebody } from '../../shared/admission/adaptive';
import { admissionOthersSample } from '../../shared/db/queries/admission';
import { makePool } from '../../shared/db/pool';
import { eventually } from './eventually';

/**
 * Waits (a poll with a deadline) until a worker's start look would see nobody else on the test's
 * database: no other client (as the look counts them: not reaper's own) in a statement or a
 * transaction, and none that started or ended one within ADAPTIVE.lookRecentSeconds. The test bed's
 * own pool is reaper-named (test/support/testbed.ts), but the applications a test or the tests before
 * it made count, so a test of "alone on the database" calls this after its set-up and before the
 * worker's first take. Reads through a "reaper-" connection, which the look leaves out.
 */
export async function untilNobodyElse(databaseUrl: string, timeoutMs = 10_000): Promise<void> {
  const pool = makePool(databaseUrl, 1, 'reaper-test-until-nobody-else');
  try {
    await eventually(
      'no other client on the database within the start look\'s horizon',
      async () => !lookSawSomebody(await admissionOthersSample(pool)),
      { timeoutMs, intervalMs: 100 },
    );
  } finally {
    await pool.end();
  }
}
