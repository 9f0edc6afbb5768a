import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import amqp, { type Channel, type ChannelModel } from 'amqplib';
import { closeBedAndBroker, insertPartitionRetiredEvent, openBedAndBroker, rowDeletePolicyYaml, startReaperStoppedAfterEach, whileDatabaseRefuses, type BedAndBroker } from '../support/fixtures';
import { eventually } from '../support/eventually';
import type { ReaperProcess } from '../support/processes';

/**
 * `reaper relay` serves what the scheduler and the workers serve on HTTP_PORT (the Kubernetes
 * component's probes and scrape rest on it): /livez from the start, also while the broker cannot be
 * reached; /readyz only while the broker connection is up and the database answers; /metrics with
 * the relay's own series, which move as it publishes, finds an unroutable key, or fails a pass.
 */
describe('relay /livez, /readyz and /metrics', () => {
  const EVENTS = 30;
  let world: BedAndBroker;
  let consumer: ChannelModel;
  let channel: Channel;
  let arrived = 0;
  const startReaper = startReaperStoppedAfterEach();

  before(async () => {
    world = await openBedAndBroker('relay_http', rowDeletePolicyYaml({ events: true }));
    // The database test below terminates every connection to the test database, this pool's too.
    world.bed.pool.on('error', () => undefined);
    consumer = await amqp.connect(world.bed.amqpUrl);
    channel = await consumer.createChannel();
    await channel.assertExchange(world.names.eventsExchange, 'topic', { durable: true });
    // Deletions only: a partition-retired event is unroutable.
    const queue = `${world.bed.prefix}.relay-http`;
    await channel.assertQueue(queue, { exclusive: true });
    await channel.bindQueue(queue, world.names.eventsExchange, '#.expired');
    await channel.consume(queue, (message) => message && (arrived += 1), { noAck: true });
  });

  after(() => closeBedAndBroker(world, () => consumer.close()));

  const status = async (base: string, path: string): Promise<number> => (await fetch(`${base}${path}`)).status;

  /** The relay's HTTP base URL, from its `relay started` line. */
  async function started(relay: ReaperProcess): Promise<string> {
    const line = await relay.waitForLine('relay started', (entry) => entry.msg === 'relay started');
    assert.ok(Number(line.httpPort) > 0, `the relay reports its HTTP port (${String(line.httpPort)})`);
    return `http://127.0.0.1:${String(line.httpPort)}`;
  }

  /** One sample of /metrics; undefined when the series is not exported. */
  async function sample(base: string, name: string, labels = ''): Promise<number | undefined> {
    const text = await (await fetch(`${base}/metrics`)).text();
    const escaped = `${name}${labels ? `{${labels}}` : ''}`.replace(/[{}.]/g, (c) => `\\${c}`);
    const match = new RegExp(`^${escaped} (\\S+)$`, 'm').exec(text);
    return match ? Number(match[1]) : undefined;
  }

  test('/livez answers while the broker cannot be reached; /readyz says not ready', async () => {
    // Nothing listens on port 1: the relay keeps trying to connect.
    const relay = startReaper('relay-no-broker', ['relay'], world.bed.processEnv({ HTTP_PORT: '0', AMQP_URL: 'amqp://guest:guest@127.0.0.1:1' }));
    const listening = await relay.waitForLine('http listening', (line) => line.msg === 'http listening');
    const base = `http://127.0.0.1:${String(listening.httpPort)}`;
    await relay.waitForLine('a failed broker connect', (line) => line.msg === 'amqp connect failed');
    assert.equal(await status(base, '/livez'), 200, 'alive: an orchestrator must not kill it for waiting');
    assert.equal(await status(base, '/readyz'), 503, 'not ready without the broker');
    assert.equal(await sample(base, 'reaper_amqp_connected'), 0);
    assert.equal(relay.lines.filter((line) => line.msg === 'relay started').length, 0);
  });

  test('ready while running; /metrics counts the events it publishes, the unroutable ones, and its last pass', async () => {
    const relay = startReaper('relay-http', ['relay'], world.bed.processEnv({ HTTP_PORT: '0' }));
    const base = await started(relay);
    await eventually('ready', async () => (await status(base, '/readyz')) === 200, { timeoutMs: 10_000 });
    assert.equal(await status(base, '/livez'), 200);
    assert.equal(await sample(base, 'reaper_amqp_connected'), 1);
    assert.equal(await sample(base, 'reaper_relay_events_published_total', 'policy="seat-holds"'), 0, 'each configured policy starts at 0');
    assert.equal(await sample(base, 'reaper_relay_passes_failed_total'), 0);
    await eventually('a first pass (an empty outbox)', async () => ((await sample(base, 'reaper_relay_last_pass_timestamp_seconds')) ?? 0) > 0);

    const before = Date.now() / 1000;
    await insertPartitionRetiredEvent(world.bed.pool, 'reaper_retired.p_http', 3);
    await world.bed.pool.query(
      `INSERT INTO cleanup_outbox (policy, key, observed_expiry, cutoff, run_id, batch_id, policy_version)
       SELECT 'seat-holds', 'http-' || g, now() - interval '1 hour', now(), NULL, NULL, 'v' FROM generate_series(1, $1) g`,
      [EVENTS],
    );
    await eventually(`${EVENTS} events delivered`, () => arrived >= EVENTS, { timeoutMs: 20_000 });
    const published = () => sample(base, 'reaper_relay_events_published_total', 'policy="seat-holds"');
    await eventually(`published counts ${EVENTS}`, async () => (await published()) === EVENTS, { timeoutMs: 10_000, describe: published });
    const unroutable = await eventually('the partition-retired event counted unroutable', async () => sample(base, 'reaper_relay_events_unroutable_total', 'routing_key="seat-holds.partition-retired"'));
    assert.ok(unroutable >= 1, `unroutable ${unroutable}`);
    assert.equal(await sample(base, 'reaper_relay_passes_failed_total'), 0, 'an unroutable key is no failure of the relay');
    const lastPass = (await sample(base, 'reaper_relay_last_pass_timestamp_seconds'))!;
    assert.ok(lastPass >= before - 1, `the last pass (${lastPass}) is after the events were written (${before})`);
    assert.equal(await status(base, '/readyz'), 200);
    const exit = await relay.stop();
    assert.equal(exit.code, 0, 'drains and exits 0');
  });

  test('/readyz answers 503 while the database does not answer; failed passes are counted and the last pass stays put', async () => {
    const relay = startReaper('relay-http-db', ['relay'], world.bed.processEnv({ HTTP_PORT: '0' }));
    const base = await started(relay);
    await eventually('ready', async () => (await status(base, '/readyz')) === 200, { timeoutMs: 10_000 });
    await whileDatabaseRefuses(world.bed.databaseUrl, async () => {
      await eventually('not ready while the database refuses connections', async () => (await status(base, '/readyz')) === 503, { timeoutMs: 10_000 });
      assert.equal(await status(base, '/livez'), 200, 'still alive');
      await eventually('a failed pass counted', async () => ((await sample(base, 'reaper_relay_passes_failed_total')) ?? 0) > 0, { timeoutMs: 10_000 });
      const stuckAt = await sample(base, 'reaper_relay_last_pass_timestamp_seconds');
      const failedAt = (await sample(base, 'reaper_relay_passes_failed_total'))!;
      // Another whole pass, failed too (after the relay's back-off), and no successful one meanwhile.
      await eventually('another failed pass', async () => ((await sample(base, 'reaper_relay_passes_failed_total')) ?? 0) > failedAt, { timeoutMs: 10_000 });
      assert.equal(await sample(base, 'reaper_relay_last_pass_timestamp_seconds'), stuckAt, 'no successful pass while the database refuses');
    });
    await eventually('ready again', async () => (await status(base, '/readyz')) === 200, { timeoutMs: 10_000 });
    const resumed = Date.now() / 1000;
    await eventually('a successful pass again', async () => ((await sample(base, 'reaper_relay_last_pass_timestamp_seconds')) ?? 0) >= resumed - 1, { timeoutMs: 10_000 });
    const exit = await relay.stop();
    assert.equal(exit.code, 0, 'drains and exits 0');
  });
});
