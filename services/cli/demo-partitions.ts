import { appendFileSync } from 'node:fs';
import pg from 'pg';
import type { RunSummary } from '../../shared/db/queries/runs';

/**
 * The partitioned part of `reaper demo` (issue 44; docs/guardrails.md "Retiring partitions"): a
 * policy `day-events` over a small table range-partitioned by day, owned by a role of its own (the
 * printed roles make the scheduler and the operator members of it), with `partitions: { retire: true }`:
 *   d5, d4, d3   days 5-2 ago, every row expired       -> retired whole (moved to reaper_retired)
 *   held         2-1 days ago, one row under a hold    -> the row path deletes the rest, keeps that row
 *   now          1 day ago to 2 days ahead, half expired -> the row path deletes the expired half
 *   future       2-3 days ahead                        -> untouched
 * Kept apart from demo.ts so the demo reads as before.
 */

export const PARTITION_POLICY = 'day-events';
export const PARTITION_TABLE = 'day_events';
const ROWS = 200; // per partition; "now" has half expired, half not
const RETIRABLE = ['day_events_d5', 'day_events_d4', 'day_events_d3'];
const KEPT = ['day_events_held', 'day_events_now', 'day_events_future'];
/** The row under a legal hold (in day_events_held, whose ids start at 4001). */
const HELD_ID = '4001';

const say = (text: string): void => void process.stdout.write(`${text}\n`);

/** The policy, appended to the demo's kept policies file. */
export function appendPartitionPolicy(policiesPath: string): void {
  appendFileSync(
    policiesPath,
    `  - name: ${PARTITION_POLICY}
    kind: row-delete
    schedule: "0 3 * * *"
    table: ${PARTITION_TABLE}         # range-partitioned by expires_at, one partition a day
    key: id                           # primary key (id, expires_at): PostgreSQL puts the partition key in it
    expiresAt: expires_at
    guard: { status: open }
    batchSize: 100
    limits: { maxPerRun: 5000, maxFractionPerRun: 0.9 }
    audit: { enabled: true, retainDays: 90 }
    partitions: { retire: true, quarantineDays: 7 }   # whole expired partitions detached, kept 7 days in reaper_retired
`,
  );
}

/**
 * The table, its partitions and rows, owned by `owner` (created here, NOLOGIN; the DETACH needs the
 * table's owner and reaper refuses a superuser owner). Where the demo's DATABASE_URL may not create
 * roles, the table stays its user's and the demo says so (the services then run as that user too).
 */
export async function createPartitionedDemoTable(pool: pg.Pool, owner: string): Promise<void> {
  const day = (offset: number) => `date_trunc('day', now()) + interval '${offset} days'`;
  await pool.query(`CREATE TABLE ${PARTITION_TABLE} (id bigint NOT NULL, status text NOT NULL, expires_at timestamptz NOT NULL, payload text,
                    PRIMARY KEY (id, expires_at)) PARTITION BY RANGE (expires_at)`);
  // The (expiresAt, key) index every policy's table needs (docs/configuration.md), on each partition.
  await pool.query(`CREATE INDEX ${PARTITION_TABLE}_by_expiry ON ${PARTITION_TABLE} (expires_at, id)`);
  const parts: Array<[string, number, number]> = [
    [RETIRABLE[0]!, -5, -4],
    [RETIRABLE[1]!, -4, -3],
    [RETIRABLE[2]!, -3, -2],
    [KEPT[0]!, -2, -1],
    [KEPT[1]!, -1, 2],
    [KEPT[2]!, 2, 3],
  ];
  for (const [index, [name, from, to]] of parts.entries()) {
    const bounds = (await pool.query<{ lo: string; hi: string }>(`SELECT (${day(from)})::text AS lo, (${day(to)})::text AS hi`)).rows[0]!;
    await pool.query(`CREATE TABLE ${name} PARTITION OF ${PARTITION_TABLE} FOR VALUES FROM ('${bounds.lo}') TO ('${bounds.hi}')`);
    // Rows spread over the partition's range; in "now", half an hour to 2 hours ago and just under a
    // day ahead. Not "a day ahead plus": the partition ends at midnight two days on, which is less
    // than a day plus 200 minutes away after 20:40 UTC (the demo failed every evening then).
    const expiry =
      name === KEPT[1]
        ? `CASE WHEN g <= ${ROWS / 2} THEN now() - interval '30 minutes' - g * interval '1 minute' ELSE now() + interval '1 day' - g * interval '1 minute' END`
        : `${day(from)} + (g - 0.5) * ((${day(to)}) - (${day(from)})) / ${ROWS}`;
    await pool.query(`INSERT INTO ${PARTITION_TABLE} (id, status, expires_at, payload)
                      SELECT ${(index + 1) * 1000} + g, 'open', ${expiry}, 'event ' || g FROM generate_series(1, ${ROWS}) g`);
  }
  await pool.query(`INSERT INTO cleanup_holds (policy, key, reason, created_by) VALUES ($1, $2, 'demo: litigation hold', 'reaper demo')`, [PARTITION_POLICY, HELD_ID]);
  try {
    await pool.query(`DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = ${pg.escapeLiteral(owner)}) THEN CREATE ROLE ${pg.escapeIdentifier(owner)} NOLOGIN; END IF; END $$`);
    for (const table of [PARTITION_TABLE, ...RETIRABLE, ...KEPT]) await pool.query(`ALTER TABLE ${table} OWNER TO ${pg.escapeIdentifier(owner)}`);
    // `reaper restore --partition` moves a retired partition back into public.
    await pool.query(`GRANT CREATE, USAGE ON SCHEMA public TO ${pg.escapeIdentifier(owner)}`);
  } catch (error) {
    say(`   note: ${PARTITION_TABLE} stays owned by the DATABASE_URL's user: its owner role ${owner} could not be made (${(error as Error).message})`);
  }
}

/** Partitions the run retired so far (moved into reaper_retired). */
export async function retiredCount(pool: pg.Pool, runId: string): Promise<number> {
  return (await pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_partitions WHERE run_id = $1 AND state = 'quarantined'`, [runId])).rows[0]!.n;
}

/** The summary: exactly the retirable partitions retired (in reaper_retired, rows intact), the rest attached with the right rows. */
export async function summarisePartitions(pool: pg.Pool, runId: string, done: RunSummary): Promise<boolean> {
  const retired = (
    await pool.query<{ source_name: string; retired_name: string; row_count: string }>(
      `SELECT source_name, retired_name, row_count::text FROM cleanup_partitions WHERE run_id = $1 AND state = 'quarantined' ORDER BY source_name`,
      [runId],
    )
  ).rows;
  const inRetiredSchema = new Set(
    (await pool.query<{ name: string }>(`SELECT c.relname AS name FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'reaper_retired' AND c.relkind = 'r'`)).rows.map((row) => row.name),
  );
  let retiredRows = 0;
  for (const row of retired.filter((entry) => inRetiredSchema.has(entry.retired_name))) {
    retiredRows += (await pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM reaper_retired.${pg.escapeIdentifier(row.retired_name)}`)).rows[0]!.n;
  }
  const attached = (
    await pool.query<{ name: string }>(`SELECT c.relname AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass ORDER BY c.relname`, [PARTITION_TABLE])
  ).rows.map((row) => row.name);
  const left = (
    await pool.query<{ held_kept: number; expired_left: number; unexpired_kept: number }>(
      `SELECT count(*) FILTER (WHERE id = $1::bigint)::int AS held_kept,
              count(*) FILTER (WHERE expires_at <= now() AND id <> $1::bigint)::int AS expired_left,
              count(*) FILTER (WHERE expires_at > now())::int AS unexpired_kept
       FROM ${PARTITION_TABLE}`,
      [HELD_ID],
    )
  ).rows[0]!;
  const retiredSources = retired.map((row) => row.source_name);
  const expectedRetired = [...RETIRABLE].sort();
  const expectedDeleted = ROWS - 1 + ROWS / 2; // the held partition but its held row, the expired half of "now"
  say('');
  say(`${PARTITION_POLICY} (row-delete, partitions.retire; a table partitioned by day)`);
  say(`  partitions retired              ${retiredSources.join(', ') || 'none'}   (expected ${expectedRetired.join(', ')})`);
  say(`  in reaper_retired, rows intact  ${retired.filter((row) => inRetiredSchema.has(row.retired_name)).length} tables, ${retiredRows} rows   (expected ${RETIRABLE.length}, ${RETIRABLE.length * ROWS})`);
  say(`  still attached                  ${attached.join(', ')}`);
  say(`  deleted by the row path         ${done.deleted}   (expected ${expectedDeleted}: the mixed partitions' expired rows)`);
  say(`  under a legal hold, kept        ${left.held_kept} of 1`);
  say(`  not yet expired, kept           ${left.unexpired_kept} of ${ROWS / 2 + ROWS}`);
  say(`  expired rows left behind        ${left.expired_left}`);
  return (
    done.state === 'completed' &&
    JSON.stringify(retiredSources) === JSON.stringify(expectedRetired) &&
    retired.every((row) => inRetiredSchema.has(row.retired_name) && Number(row.row_count) === ROWS) &&
    retiredRows === RETIRABLE.length * ROWS &&
    JSON.stringify(attached) === JSON.stringify([...KEPT].sort()) &&
    done.deleted === expectedDeleted &&
    left.held_kept === 1 &&
    left.expired_left === 0 &&
    left.unexpired_kept === ROWS / 2 + ROWS
  );
}
