import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { eventually } from '../support/eventually';
import { assertNoLeakedProcesses } from '../support/processes';
import { makeTestBed, type TestBed } from '../support/testbed';
import { rowDeletePolicyYaml, startReaperStoppedAfterEach, whileDatabaseRefuses } from '../support/fixtures';

/**
 * The scheduler's health endpoints (issue 7 item 16): /livez answers from the start, also while
 * the broker cannot be reached (readiness false until then); /readyz also asks the database.
 */
describe('scheduler /livez and /readyz', () => {
  let bed: TestBed;
  const startReaper = startReaperStoppedAfterEach();

  before(async () => {
    bed = await makeTestBed('scheduler_http');
    // The database test below terminates every connection to the test database, this pool's too.
    bed.pool.on('error', () => undefined);
    bed.writePolicies(rowDeletePolicyYaml());
  });
  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await bed?.close();
    }
  });

  const status = async (base: string, path: string): Promise<number> => (await fetch(`${base}${path}`)).status;

  test('/livez answers while the broker cannot be reached; /readyz says not ready', async () => {
    // Nothing listens on port 1: the scheduler keeps trying to connect.
    const scheduler = startReaper('scheduler', ['scheduler'], bed.processEnv({ HTTP_PORT: '0', AMQP_URL: 'amqp://guest:guest@127.0.0.1:1' }));
    const listening = await scheduler.waitForLine('http listening', (line) => line.msg === 'http listening');
    const base = `http://127.0.0.1:${String(listening.httpPort)}`;
    await scheduler.waitForLine('a failed broker connect', (line) => line.msg === 'amqp connect failed');
    assert.equal(await status(base, '/livez'), 200, 'alive: an orchestrator must not kill it for waiting');
    assert.equal(await status(base, '/readyz'), 503, 'not ready without the broker');
    assert.equal(scheduler.lines.filter((line) => line.msg === 'scheduler started').length, 0);
  });

  test('/readyz answers 503 while the database does not answer, and 200 again once it does', async () => {
    const scheduler = startReaper('scheduler', ['scheduler'], bed.processEnv({ HTTP_PORT: '0' }));
    const started = await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started');
    const base = `http://127.0.0.1:${String(started.httpPort)}`;
    await eventually('ready', async () => (await status(base, '/readyz')) === 200);

    await whileDatabaseRefuses(bed.databaseUrl, async () => {
      await eventually('not ready while the database refuses connections', async () => (await status(base, '/readyz')) === 503, { timeoutMs: 10_000 });
      assert.equal(await status(base, '/livez'), 200, 'still alive');
    });
    await eventually('ready again', async () => (await status(base, '/readyz')) === 200, { timeoutMs: 10_000 });
    const exit = await scheduler.stop();
    assert.equal(exit.code, 0, 'drains and exits 0');
  });
});
