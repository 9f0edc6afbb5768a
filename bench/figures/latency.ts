import { OBSERVER_APPLICATION } from '../lib/database';
import { check, checkFinished, reaperEnvironment, type BenchContext } from '../lib/context';
import { LATENCY_POLICY, seatHoldsPolicy, writePolicies } from '../lib/policies';
import { startServices, stopServices, type ReaperService } from '../lib/services';
import { pollUntil } from '../lib/wait';

/**
 * Figure 4: how long after its expiry a row is gone, while the scheduler ticks on a seconds cron.
 * Rows expire one by one over the next few seconds; an AFTER DELETE trigger in the bench database
 * (not in the product) stamps each deletion with clock_timestamp(), so nothing polls the table and
 * every delay is measured on one clock. A statement-level trigger with a transition table adds one
 * INSERT per batch, not per row.
 */

export interface LatencyFigure {
  schedule: string;
  tickSeconds: number;
  rows: number;
  spreadSeconds: number;
  deleted: number;
  p50Ms: number;
  p99Ms: number;
  maxMs: number;
  bounded: boolean;
}

export async function runLatency(
  context: BenchContext,
  options: { rows: number; spreadSeconds: number; schedule: string; tickSeconds: number },
): Promise<LatencyFigure> {
  await context.databases.fresh();
  await context.broker.preparePhase([LATENCY_POLICY]);
  const pool = context.databases.pool(2, OBSERVER_APPLICATION);
  let services: ReaperService[] = [];
  try {
    await pool.query('TRUNCATE seat_reservations');
    await pool.query(`CREATE TABLE bench_deletions (id uuid NOT NULL, expires_at timestamptz NOT NULL, deleted_at timestamptz NOT NULL)`);
    await pool.query(`CREATE FUNCTION bench_record_deletions() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN
        INSERT INTO bench_deletions SELECT reservation_id, expires_at, clock_timestamp() FROM gone;
        RETURN NULL;
      END $$`);
    await pool.query(`CREATE TRIGGER bench_record_deletions AFTER DELETE ON seat_reservations
      REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION bench_record_deletions()`);

    const policiesPath = writePolicies(context.workDir, 'latency', [seatHoldsPolicy(LATENCY_POLICY, 100, options.schedule)]);
    services = await startServices(reaperEnvironment(context, policiesPath), [
      { kind: 'scheduler', id: 'bench-scheduler' },
      { kind: 'worker', id: 'bench-worker-1' },
      { kind: 'worker', id: 'bench-worker-2' },
    ]);
    // Expiring from one second from now over the spread, at random microseconds.
    await pool.query(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
       SELECT gen_random_uuid(), 'held', clock_timestamp() + interval '1 second' + random() * $2 * interval '1 second', 'seat-' || i
       FROM generate_series(1, $1) i`,
      [options.rows, options.spreadSeconds],
    );
    const deadline = Date.now() + Math.min(context.boundMs, (options.spreadSeconds + 3 * options.tickSeconds + 30) * 1000);
    const done = await pollUntil(
      async () => {
        const n = (await pool.query<{ n: number }>('SELECT count(*)::int AS n FROM bench_deletions')).rows[0]!.n;
        return n >= options.rows ? n : undefined;
      },
      { deadline, everyMs: 250 },
    );
    for (const service of services) service.assertRunning();
    await stopServices(services);
    const stats = (
      await pool.query<{ deleted: number; distinct_ids: number; early: number; p50: number | null; p99: number | null; max: number | null; left: number }>(
        `SELECT count(*)::int AS deleted, count(DISTINCT id)::int AS distinct_ids,
                count(*) FILTER (WHERE deleted_at < expires_at)::int AS early,
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM deleted_at - expires_at)::float8) * 1000 AS p50,
                percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM deleted_at - expires_at)::float8) * 1000 AS p99,
                (max(extract(epoch FROM deleted_at - expires_at)) * 1000)::float8 AS max,
                (SELECT count(*)::int FROM seat_reservations) AS left
         FROM bench_deletions`,
      )
    ).rows[0]!;
    const figure = `latency, ${options.rows} rows expiring over ${options.spreadSeconds} s, tick ${options.tickSeconds} s`;
    if (checkFinished(context, figure, done !== undefined)) {
      check(context, figure, 'rows deleted', options.rows, stats.deleted);
      check(context, figure, 'rows deleted once (distinct ids)', options.rows, stats.distinct_ids);
      check(context, figure, 'rows left', 0, stats.left);
    }
    check(context, figure, 'rows deleted before their expiry', 0, stats.early);
    return {
      schedule: options.schedule,
      tickSeconds: options.tickSeconds,
      rows: options.rows,
      spreadSeconds: options.spreadSeconds,
      deleted: stats.deleted,
      p50Ms: stats.p50 ?? 0,
      p99Ms: stats.p99 ?? 0,
      maxMs: stats.max ?? 0,
      bounded: done === undefined,
    };
  } finally {
    await stopServices(services);
    await pool.end();
  }
}
