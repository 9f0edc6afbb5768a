import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { DEFAULT_SESSION_TIMEOUTS, makePool, warmPool } from '../../shared/db/pool';
import { eventually } from '../support/eventually';
import { TcpProxy } from '../support/tcp-proxy';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * A checked-out PostgreSQL client whose connection dies between two queries (a transaction open,
 * no query in flight) must not end the process: found by the chaos run, where workers exited 1 on
 * an 'error' event nobody listened to. The next query on that client fails instead, with the
 * message the worker classifies as "database unavailable".
 */
describe('a pooled client losing its connection while checked out; a service pool keeping its connections', () => {
  let bed: TestBed;
  let proxy: TcpProxy;
  before(async () => {
    bed = await makeTestBed('pool_connection_lost');
    const database = new URL(bed.databaseUrl);
    proxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
  });
  after(async () => {
    await proxy?.close();
    await bed?.close();
  });

  test('the link is reset inside an open transaction: no crash, the next query fails, the pool goes on', async () => {
    const pool = makePool(proxy.urlFor(bed.databaseUrl), 2, 'test-pool');
    try {
      const client = await pool.connect();
      await client.query('BEGIN');
      const ended = new Promise((resolve) => client.once('end', resolve));
      assert.equal(proxy.resetAll(), 1);
      await ended;
      await assert.rejects(client.query('SELECT 1'), /connection error|not queryable|terminated/i);
      client.release(true);
      assert.equal((await pool.query<{ one: number }>('SELECT 1 AS one')).rows[0]!.one, 1, 'a fresh connection works');
    } finally {
      await pool.end();
    }
  });

  /** Backend pids of `application`'s connections to the test database. */
  async function backends(application: string): Promise<number[]> {
    const result = await bed.pool.query<{ pid: number }>(
      'SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1 ORDER BY pid',
      [application],
    );
    return result.rows.map((row) => row.pid);
  }

  test("a service pool ('keep') opens every connection at start and keeps them idle, where a 'close-idle' pool closes its own; a lost one is opened again", async () => {
    const idleTimeoutMs = 300;
    const kept = makePool(proxy.urlFor(bed.databaseUrl), 3, 'test-pool-keep', DEFAULT_SESSION_TIMEOUTS, 'keep', idleTimeoutMs);
    const closing = makePool(bed.databaseUrl, 3, 'test-pool-close-idle', DEFAULT_SESSION_TIMEOUTS, 'close-idle', idleTimeoutMs);
    try {
      assert.equal(await warmPool(kept), 3, 'every connection of the keep pool opened');
      assert.equal(await warmPool(closing), 3);
      const warm = await eventually('the keep pool\'s three backends', async () => {
        const pids = await backends('test-pool-keep');
        return pids.length === 3 ? pids : undefined;
      });
      // The close-idle pool, warmed at the same moment with the same idle timeout, closing all of
      // its connections is the proof that the timeout has passed for the keep pool's too.
      await eventually('the close-idle pool to close its idle connections', async () => (await backends('test-pool-close-idle')).length === 0, { timeoutMs: 10_000, intervalMs: 50 });
      assert.deepEqual(await backends('test-pool-keep'), warm, 'the same three backends, still open');
      assert.equal(kept.idleCount, 3);
      // Lost while idle (the server restarted, a link reset): dropped, and opened again on use.
      assert.equal(proxy.resetAll(), 3);
      await eventually('the pool to drop the lost connections', () => kept.totalCount === 0, { timeoutMs: 5_000, intervalMs: 20 });
      assert.equal((await kept.query<{ one: number }>('SELECT 1 AS one')).rows[0]!.one, 1, 'a fresh connection works');
    } finally {
      await kept.end();
      await closing.end();
    }
  });
});
