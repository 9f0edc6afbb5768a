import amqp from 'amqplib';
import type pg from 'pg';
import { brokerNames } from '../../shared/amqp/topology';
import { outboxEventCount, outboxOldestAges } from '../../shared/db/queries/outbox';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { checkFinished, checkSeatRows, check, reaperEnvironment, throughput, type BenchContext, type Throughput } from '../lib/context';
import { countSeatRows, type Seed, OBSERVER_APPLICATION } from '../lib/database';
import type { Mode } from '../lib/modes';
import { ROW_POLICY, seatHoldsPolicy, writePolicies } from '../lib/policies';
import { ReaperService, startServices, stopServices, type ServiceSpec } from '../lib/services';
import { pollUntil, sleep } from '../lib/wait';

/**
 * Issue 19 item 3: what expiry events and the archive cost reaper's row-delete, on the same data in
 * the same run. Each round runs reaper end to end (scheduler + 2 workers, a run inserted as `reaper
 * trigger` does, trigger to completed on the database clock) three times on fresh copies of one
 * seed: the policy as it is, with `events: { enabled: true }` and one `reaper relay` publishing
 * beside it (its CPU competes with the deletion, as it would in production), and with
 * `archive: { enabled: true, retainDays: 30 }`. Each variant reports its fastest round.
 *
 * Then once: the events run again without a relay (the outbox fills with every event), and one
 * relay started on that full outbox: its throughput is events ÷ time from its start until the
 * outbox is empty. The outbox's oldest age (`reaper_outbox_oldest_age_seconds`'s query) is sampled
 * every 250 ms during the events rounds, and until the relay has drained.
 */

export type Variant = 'off' | 'events' | 'archive';

/** Candidates of this figure's own seed per mode (the relay drains every one of them). */
export const EVENTS_ARCHIVE_CANDIDATES: Record<Mode, number> = { smoke: 5_000, quick: 50_000, full: 200_000 };

export interface VariantRun {
  variant: Variant;
  endToEnd: Throughput;
  /** Events rounds: the outbox's oldest age, largest sample from the trigger until the relay drained it. */
  outboxOldestMaxSeconds: number | null;
  /** Events rounds: seconds from the run's completion until the relay had published the last event. */
  relayBehindSeconds: number | null;
}

export interface RelayDrain {
  events: number;
  seconds: number;
  eventsPerSecond: number;
  bounded: boolean;
  /** The run that filled the outbox (events on, no relay): trigger to completed. */
  writeOnly: Throughput;
}

export interface EventsArchiveFigure {
  candidates: number;
  batchSize: number;
  best: Record<Variant, VariantRun>;
  rounds: Record<Variant, number[]>;
  eventsRatio: number;
  archiveRatio: number;
  relay: RelayDrain;
}

const SPECS: ServiceSpec[] = [
  { kind: 'scheduler', id: 'bench-scheduler' },
  { kind: 'worker', id: 'bench-worker-1' },
  { kind: 'worker', id: 'bench-worker-2' },
];

function policyFor(variant: Variant, batchSize: number) {
  const policy = seatHoldsPolicy(ROW_POLICY, batchSize);
  // The limit above any backlog the figure seeds: it measures the outbox writes and the relay, not
  // the back-pressure (with the default 100,000 a 200k backlog waits for the relay, and the run with
  // no relay never completes).
  if (variant === 'events') return { ...policy, events: { enabled: true, maxOutbox: 10_000_000 } };
  if (variant === 'archive') return { ...policy, archive: { enabled: true, retainDays: 30 } };
  return policy;
}

const one = async (pool: pg.Pool, sql: string, params: unknown[]): Promise<number> => Number(Object.values((await pool.query(sql, params)).rows[0] as object)[0] ?? 0);
/** Unpublished events (an outbox row holds a batch's: migration 0031). */
const outboxCount = (pool: pg.Pool) => outboxEventCount(pool);

/** A consumer's queue for the bench policy's events (the relay's `mandatory` publishes need a route), deleted after `work`. */
interface EventsSink {
  purge(): Promise<void>;
  messages(): Promise<number>;
}

async function withEventsSink<T>(context: BenchContext, work: (sink: EventsSink) => Promise<T>): Promise<T> {
  const exchange = brokerNames(context.broker.prefix).eventsExchange;
  const queue = `${context.broker.prefix}.events-sink`;
  const connection = await amqp.connect(context.amqpUrl);
  try {
    const channel = await connection.createChannel();
    await channel.assertExchange(exchange, 'topic', { durable: true });
    await channel.assertQueue(queue, { durable: false });
    await channel.bindQueue(queue, exchange, '*.expired');
    try {
      return await work({ purge: async () => void (await channel.purgeQueue(queue)), messages: async () => (await channel.checkQueue(queue)).messageCount });
    } finally {
      await channel.deleteQueue(queue);
    }
  } finally {
    await connection.close();
  }
}

/** One end-to-end run of `variant` on a fresh copy of the seed; `relay` starts `reaper relay` beside the services. */
async function runVariant(context: BenchContext, seed: Seed, options: { variant: Variant; batchSize: number; relay: boolean; sink: EventsSink }): Promise<{ run: VariantRun; pool: pg.Pool; relay: ReaperService | null; services: ReaperService[]; runId: string }> {
  const { variant, batchSize } = options;
  await context.databases.fresh();
  await context.broker.preparePhase([ROW_POLICY]);
  await options.sink.purge();
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  const environment = reaperEnvironment(context, writePolicies(context.workDir, `row-${batchSize}-${variant}`, [policyFor(variant, batchSize)]));
  const relay = options.relay ? await ReaperService.start(environment, { kind: 'relay', id: 'bench-relay' }) : null;
  const services = await startServices(environment, SPECS);
  let oldest = 0;
  let sampling = variant === 'events';
  const sampler = (async () => {
    while (sampling) {
      const [age] = await outboxOldestAges(pool, [ROW_POLICY]);
      oldest = Math.max(oldest, age?.oldestAgeSeconds ?? 0);
      await sleep(250);
    }
  })();
  const run = (await runsInsertIfAbsent(pool, { policy: ROW_POLICY, trigger: 'manual', scheduledFor: null, cutoff: null }))!;
  const deadline = Date.now() + context.boundMs;
  const completed = await pollUntil(async () => ((await one(pool, `SELECT (state = 'completed')::int FROM cleanup_runs WHERE run_id = $1`, [run.runId])) === 1 ? true : undefined), { deadline, everyMs: 100 });
  for (const service of [...services, ...(relay ? [relay] : [])]) service.assertRunning();
  const deleted = await one(pool, 'SELECT coalesce(sum(deleted), 0)::int FROM cleanup_batches WHERE run_id = $1', [run.runId]);
  const seconds = completed
    ? await one(pool, 'SELECT extract(epoch FROM finished_at - created_at)::float8 FROM cleanup_runs WHERE run_id = $1', [run.runId])
    : await one(pool, 'SELECT extract(epoch FROM clock_timestamp() - created_at)::float8 FROM cleanup_runs WHERE run_id = $1', [run.runId]);
  let relayBehindSeconds: number | null = null;
  if (relay && completed) {
    const drained = await pollUntil(async () => ((await outboxCount(pool)) === 0 ? true : undefined), { deadline: Date.now() + context.boundMs, everyMs: 100 });
    if (drained) relayBehindSeconds = await one(pool, 'SELECT greatest(0, extract(epoch FROM clock_timestamp() - finished_at))::float8 FROM cleanup_runs WHERE run_id = $1', [run.runId]);
  }
  sampling = false;
  await sampler;
  const figure = `reaper end to end, ${variant === 'off' ? 'events and archive off' : `${variant} on`}${variant === 'events' && !options.relay ? ' (no relay)' : ''}, batch ${batchSize}, ${seed.candidates} candidates`;
  if (checkFinished(context, figure, completed === true)) {
    checkSeatRows(context, figure, seed, seed.candidates, await countSeatRows(pool));
    // Events: one per deleted row, in the outbox (no relay) or delivered (the relay drained it); none otherwise.
    // A relay still draining at the time bound is a bounded figure (a failure in smoke mode), like an unfinished run.
    if (options.relay && checkFinished(context, `${figure}: relay drained the outbox`, relayBehindSeconds !== null)) {
      check(context, figure, 'events delivered to a bound queue', seed.candidates, await options.sink.messages());
    }
    else check(context, figure, 'outbox events', variant === 'events' ? seed.candidates : 0, await outboxCount(pool));
    check(context, figure, 'archive rows', variant === 'archive' ? seed.candidates : 0, await one(pool, 'SELECT count(*)::int FROM cleanup_archive WHERE run_id = $1', [run.runId]));
  }
  return {
    run: {
      variant,
      endToEnd: throughput(deleted, seconds, completed !== true),
      outboxOldestMaxSeconds: variant === 'events' ? oldest : null,
      relayBehindSeconds,
    },
    pool,
    relay,
    services,
    runId: run.runId,
  };
}

async function finish(result: { pool: pg.Pool; relay: ReaperService | null; services: ReaperService[] }): Promise<void> {
  await stopServices([...result.services, ...(result.relay ? [result.relay] : [])]);
  await result.pool.end();
}

export async function runEventsArchive(context: BenchContext, seed: Seed, options: { batchSize: number; repeats: number }): Promise<EventsArchiveFigure> {
  return withEventsSink(context, async (sink) => {
    const rounds: Record<Variant, VariantRun[]> = { off: [], events: [], archive: [] };
    for (let round = 1; round <= options.repeats; round++) {
      context.progress(`  events/archive round ${round} of ${options.repeats}`);
      for (const variant of ['off', 'events', 'archive'] as const) {
        const result = await runVariant(context, seed, { variant, batchSize: options.batchSize, relay: variant === 'events', sink });
        await finish(result);
        rounds[variant].push(result.run);
        const r = result.run;
        context.progress(
          `    ${variant}: ${Math.round(r.endToEnd.rowsPerSecond)} rows/s${r.endToEnd.bounded ? ' (bounded)' : ''}` +
            (r.outboxOldestMaxSeconds !== null ? `; outbox oldest max ${r.outboxOldestMaxSeconds.toFixed(1)} s, relay done ${r.relayBehindSeconds?.toFixed(1) ?? '-'} s after the run` : ''),
        );
      }
    }
    // The relay alone on a full outbox: events written by a run without a relay, then one relay started.
    const filled = await runVariant(context, seed, { variant: 'events', batchSize: options.batchSize, relay: false, sink });
    const waiting = await outboxCount(filled.pool);
    const relay = await ReaperService.start(reaperEnvironment(context, writePolicies(context.workDir, `row-${options.batchSize}-events`, [policyFor('events', options.batchSize)])), { kind: 'relay', id: 'bench-relay-alone' });
    const started = performance.now();
    const drained = await pollUntil(async () => ((await outboxCount(filled.pool)) === 0 ? true : undefined), { deadline: Date.now() + context.boundMs, everyMs: 50 });
    const seconds = (performance.now() - started) / 1000;
    const published = waiting - (await outboxCount(filled.pool));
    relay.assertRunning();
    check(context, 'relay alone', 'events delivered to a bound queue', published, await sink.messages());
    await finish({ ...filled, relay });
    const relayDrain: RelayDrain = { events: published, seconds, eventsPerSecond: published / seconds, bounded: !drained, writeOnly: filled.run.endToEnd };
    context.progress(`    relay alone: ${published} events in ${seconds.toFixed(1)} s = ${Math.round(relayDrain.eventsPerSecond)} events/s${drained ? '' : ' (bounded)'}`);

    const fastest = (runs: VariantRun[]) => runs.reduce((best, run) => (run.endToEnd.rowsPerSecond > best.endToEnd.rowsPerSecond ? run : best));
    const best = { off: fastest(rounds.off), events: fastest(rounds.events), archive: fastest(rounds.archive) };
    return {
      candidates: seed.candidates,
      batchSize: options.batchSize,
      best,
      rounds: { off: rounds.off.map((r) => r.endToEnd.rowsPerSecond), events: rounds.events.map((r) => r.endToEnd.rowsPerSecond), archive: rounds.archive.map((r) => r.endToEnd.rowsPerSecond) },
      eventsRatio: best.events.endToEnd.rowsPerSecond / best.off.endToEnd.rowsPerSecond,
      archiveRatio: best.archive.endToEnd.rowsPerSecond / best.off.endToEnd.rowsPerSecond,
      relay: relayDrain,
    };
  });
}

/** The figure's rows of the report table: [figure, measure, value, ratio, target, met]. */
export function eventsArchiveRows(f: EventsArchiveFigure): Array<[string, string, string, string?, string?, string?]> {
  const n = f.candidates >= 1000 ? `${f.candidates / 1000}k` : String(f.candidates);
  const rate = (t: Throughput) => `${Math.round(t.rowsPerSecond).toLocaleString('en-US')} rows/s${t.bounded ? ' (bounded)' : ''}`;
  const oldest = f.best.events.outboxOldestMaxSeconds ?? 0;
  return [
    [`8 (${n})`, 'reaper end to end, events and archive off', rate(f.best.off.endToEnd)],
    [`8 (${n})`, 'events on (relay running) / off', rate(f.best.events.endToEnd), f.eventsRatio.toFixed(2), '>= 0.80', f.eventsRatio >= 0.8 ? 'yes' : 'NO'],
    [`8 (${n})`, '  events on, no relay running (the outbox writes alone, one run) / off', rate(f.relay.writeOnly), (f.relay.writeOnly.rowsPerSecond / f.best.off.endToEnd.rowsPerSecond).toFixed(2), '(diagnostic)'],
    [`8 (${n})`, 'archive on (retainDays 30) / off', rate(f.best.archive.endToEnd), f.archiveRatio.toFixed(2), '>= 0.70', f.archiveRatio >= 0.7 ? 'yes' : 'NO'],
    [`8 (${n})`, `relay throughput: one relay draining ${f.relay.events.toLocaleString('en-US')} events`, `${Math.round(f.relay.eventsPerSecond).toLocaleString('en-US')} events/s${f.relay.bounded ? ' (bounded)' : ''}`],
    [`8 (${n})`, `outbox oldest age during the events run, max (relay done ${f.best.events.relayBehindSeconds?.toFixed(1) ?? '-'} s after the run completed)`, `${oldest.toFixed(1)} s`],
  ];
}
