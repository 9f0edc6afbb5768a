import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { CLIENT_TIMEOUT_MARGIN_MS } from '../../shared/db/pool';
import { openTestBroker, type TestBroker } from '../support/broker';
import { runUnderFault } from '../support/fault-run';
import { assertNoLeakedProcesses, type ReaperProcess } from '../support/processes';
import { TcpProxy } from '../support/tcp-proxy';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * A stalled link: bytes stop, the socket stays open (a hung middlebox, a frozen NAT entry). The
 * proxy stops every open connection mid-run without closing anything. Nothing tells the services;
 * they must notice by themselves within a documented bound:
 *
 * - broker links: the AMQP heartbeat. amqplib closes a connection that received nothing for two
 *   consecutive heartbeat intervals, so detection takes 2 to 3 heartbeats (REAPER_AMQP_HEARTBEAT_S).
 * - PostgreSQL links: the client-side bound of every query, statement_timeout + 5 s. (The server's
 *   own statement_timeout error cannot cross a stalled link, and TCP keepalive is answered by
 *   whatever still acknowledges in between, here the proxy's kernel.)
 *
 * Serial: the bounds are measured against the clock.
 */
const HEARTBEAT_S = 1;
const STATEMENT_TIMEOUT_MS = 2_000;
/** Scheduling slack on a loaded 2-core machine, on top of each documented bound. */
const SLACK_MS = 2_500;

describe('stalled links are detected within their bounds', () => {
  let bed: TestBed;
  let broker: TestBroker;

  before(async () => {
    bed = await makeTestBed('fault_stall');
    broker = await openTestBroker(bed.amqpUrl);
  });
  after(async () => {
    try {
      await assertNoLeakedProcesses();
    } finally {
      await broker?.close();
      await bed?.close();
    }
  });

  const firstLineAfter = (service: ReaperProcess, since: number, msg: string, extra: (line: Record<string, unknown>) => boolean = () => true) =>
    service.lines.find((line) => line.msg === msg && Date.parse(String(line.time)) >= since && extra(line));

  test(`broker link stalled: each worker notices within 3 heartbeats (${HEARTBEAT_S} s) and reconnects; checker at zero`, async () => {
    const amqp = new URL(bed.amqpUrl);
    const proxy = await TcpProxy.start({ targetHost: amqp.hostname, targetPort: Number(amqp.port || 5672) });
    try {
      const env = { AMQP_URL: proxy.urlFor(bed.amqpUrl), REAPER_AMQP_HEARTBEAT_S: String(HEARTBEAT_S), REAPER_PREFETCH: '2' };
      let detectedMs: number[] = [];
      await runUnderFault({
        bed,
        broker,
        policy: 'stall-amqp',
        expired: 6_000,
        batchSize: 50,
        services: [
          { label: 'scheduler-s', kind: 'scheduler' },
          { label: 'worker-s1', kind: 'worker', env },
          { label: 'worker-s2', kind: 'worker', env },
        ],
        async inject({ afterBatches, group, workers, recovery }) {
          await afterBatches(10);
          const stalled = proxy.stallAll();
          const since = Date.now();
          assert.equal(stalled.length, 2, 'both workers connect through the proxy');
          const seen = await Promise.all(
            workers.map((w) =>
              group.eventuallyAlive(`${w.label} to notice the stalled link`, () => firstLineAfter(w, since, 'amqp connection closed; reconnecting'), {
                timeoutMs: 3 * HEARTBEAT_S * 1000 + SLACK_MS + 5_000,
                intervalMs: 20,
              }),
            ),
          );
          detectedMs = seen.map((line) => Date.parse(String(line.time)) - since);
          // The path is declared dead: the broker sees those connections go and requeues what they held.
          proxy.heal();
          return [await recovery('broker link stalled', Date.now())];
        },
      });
      for (const ms of detectedMs) assert.ok(ms <= 3 * HEARTBEAT_S * 1000 + SLACK_MS, `stalled broker link detected in ${ms} ms (bound ${3 * HEARTBEAT_S} s + slack)`);
    } finally {
      await proxy.close();
    }
  });

  test(`PostgreSQL link stalled: a worker gives the query up within statement_timeout (${STATEMENT_TIMEOUT_MS} ms) + ${CLIENT_TIMEOUT_MARGIN_MS} ms and goes on with a new connection; checker at zero`, async () => {
    await bed.pool.query('TRUNCATE seat_reservations, cleanup_holds, cleanup_batches');
    const database = new URL(bed.databaseUrl);
    const proxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
    const bound = STATEMENT_TIMEOUT_MS + CLIENT_TIMEOUT_MARGIN_MS;
    try {
      const env = { DATABASE_URL: proxy.urlFor(bed.databaseUrl), REAPER_STATEMENT_TIMEOUT_MS: String(STATEMENT_TIMEOUT_MS), REAPER_PREFETCH: '1' };
      let detectedMs = -1;
      await runUnderFault({
        bed,
        broker,
        policy: 'stall-pg',
        expired: 4_000,
        batchSize: 50,
        services: [
          { label: 'scheduler-p', kind: 'scheduler' },
          { label: 'worker-p1', kind: 'worker', env },
        ],
        async inject({ afterBatches, group, workers, recovery }) {
          // Stalled right after a DELETE went out: its answer (and everything else) stops.
          await afterBatches(5);
          // The row-delete DELETE is a named statement: after a connection's first execution only its name travels.
          await proxy.holdRepliesAfter(/DELETE FROM|reaper_row_delete_/);
          proxy.stallAll();
          const since = Date.now();
          const worker = workers[0]!;
          const line = await group.eventuallyAlive(
            'the worker to give the stalled query up',
            // A stalled query's read timeout is an unknown outcome, not an unreachable database: it backs off (settle.ts).
            () => firstLineAfter(worker, since, 'batch outcome unknown; retried after a back-off', (l) => /Query read timeout/.test(String(l.reason))),
            { timeoutMs: bound + SLACK_MS + 10_000, intervalMs: 20, describe: () => worker.output.slice(-5) },
          );
          detectedMs = Date.parse(String(line.time)) - since;
          proxy.heal();
          return [await recovery('postgres link stalled', Date.now())];
        },
      });
      assert.ok(detectedMs >= 0 && detectedMs <= bound + SLACK_MS, `stalled PostgreSQL link detected in ${detectedMs} ms (bound ${bound} ms + slack)`);
    } finally {
      await proxy.close();
    }
  });
});
