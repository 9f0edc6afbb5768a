import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { makePool } from '../../shared/db/pool';
import { TcpProxy } from '../support/tcp-proxy';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * A checked-out PostgreSQL client whose connection dies between two queries (a transaction open,
 * no query in flight) must not end the process: found by the chaos run, where workers exited 1 on
 * an 'error' event nobody listened to. The next query on that client fails instead, with the
 * message the worker classifies as "database unavailable".
 */
describe('a pooled client losing its connection while checked out', () => {
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
});
