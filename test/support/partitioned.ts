import { after, before } from 'node:test';
import pg from 'pg';
import { loadPolicies } from '../../shared/config/policies';
import { runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startScheduler } from '../../services/scheduler/scheduler';
import { startWorker } from '../../services/worker/worker';
import { eventually } from './eventually';
import { testLog } from './fixtures';
import { assertNoLeakedProcesses } from './processes';
import { findServers } from './servers';
import { makeTestBed, type TestBed } from './testbed';

/**
 * A range-partitioned table by day (`events_by_day`, primary key (id, expires_at)), owned by a role
 * of its own as docs/guardrails.md "Retiring partitions" asks (the printed roles make the scheduler
 * and the operator members of it). Each partition is named by what it is for in the tests:
 *   p_fk        6-5 days ago, referenced by a foreign key          -> blocked
 *   p_old_a     5-4 days ago, all expired, guard, no hold          -> retirable
 *   p_old_b     4-3 days ago, all expired, guard, no hold          -> retirable
 *   p_held      3-2 days ago, one row under a legal hold           -> mixed (row path deletes the rest)
 *   p_guard     2-1 days ago, one row outside the guard            -> mixed
 *   p_today     1 day ago to tomorrow, half expired                -> mixed (bound after the cutoff)
 *   p_future    tomorrow to the day after                          -> unexpired
 *   p_default   DEFAULT, one expired row 10 days ago               -> blocked
 * ROWS_PER_PARTITION rows each (ids unique across the table; the held and guard rows are named).
 */
export const PARTITIONED_TABLE = 'events_by_day';
export const ROWS_PER_PARTITION = 6;
export const HELD_ID = '4001'; // in p_held (partition 4: ids 4001..)
export const OUT_OF_GUARD_ID = '5001'; // in p_guard

export function partitionedPolicyYaml(options: { name?: string; quarantineDays?: number; limits?: string; extra?: string } = {}): string {
  return [
    'policies:',
    `  - name: ${options.name ?? 'day-events'}`,
    '    kind: row-delete',
    '    schedule: "0 0 1 1 *"',
    `    table: ${PARTITIONED_TABLE}`,
    '    key: id',
    '    expiresAt: expires_at',
    '    guard: { status: open }',
    '    batchSize: 50',
    '    audit: { enabled: true, retainDays: 30 }',
    `    partitions: { retire: true${options.quarantineDays === undefined ? '' : `, quarantineDays: ${options.quarantineDays}`} }`,
    ...(options.limits ? [`    limits: ${options.limits}`] : []),
    ...(options.extra ? [options.extra] : []),
    '',
  ].join('\n');
}

/** The owner role's name for a bed (cluster-wide, so suffixed by the bed's database name). */
export function partitionOwnerRole(bed: TestBed): string {
  return `app_owner_${new URL(bed.databaseUrl).pathname.slice(1).slice(-24)}`.toLowerCase();
}

/** Creates the table, its partitions, the FK, and the rows (as the superuser: it is the application's setup). */
export async function createPartitionedTable(bed: TestBed): Promise<void> {
  const owner = partitionOwnerRole(bed);
  const q = (sql: string) => bed.pool.query(sql);
  await q(`DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '${owner}') THEN CREATE ROLE ${pg.escapeIdentifier(owner)} NOLOGIN; END IF; END $$`);
  await q(`CREATE TABLE ${PARTITIONED_TABLE} (id bigint NOT NULL, status text NOT NULL, expires_at timestamptz NOT NULL, payload text, PRIMARY KEY (id, expires_at)) PARTITION BY RANGE (expires_at)`);
  // The keyset scan's index (docs/configuration.md: every policy table needs one on (expiresAt, key),
  // partial on the guard); on the parent, so each partition has its own.
  await q(`CREATE INDEX ${PARTITIONED_TABLE}_open_by_expiry ON ${PARTITIONED_TABLE} (expires_at, id) WHERE status = 'open'`);
  const day = (offset: number) => `date_trunc('day', now()) + interval '${offset} days'`;
  const parts: Array<[string, number, number]> = [
    ['p_fk', -6, -5],
    ['p_old_a', -5, -4],
    ['p_old_b', -4, -3],
    ['p_held', -3, -2],
    ['p_guard', -2, -1],
    ['p_today', -1, 1],
    ['p_future', 1, 2],
  ];
  for (const [index, [name, from, to]] of parts.entries()) {
    // Bounds are constants: read them from the clock first.
    const bounds = await bed.pool.query<{ lo: string; hi: string }>(`SELECT (${day(from)})::text AS lo, (${day(to)})::text AS hi`);
    await q(`CREATE TABLE ${name} PARTITION OF ${PARTITIONED_TABLE} FOR VALUES FROM ('${bounds.rows[0]!.lo}') TO ('${bounds.rows[0]!.hi}')`);
    // Rows spread over the partition's range: for p_today half are before now, half after.
    await q(`INSERT INTO ${PARTITIONED_TABLE} (id, status, expires_at, payload)
             SELECT ${(index + 1) * 1000} + g, 'open', ${day(from)} + (g - 0.5) * (${day(to)} - (${day(from)})) / ${ROWS_PER_PARTITION}, 'row ' || g
             FROM generate_series(1, ${ROWS_PER_PARTITION}) g`);
  }
  await q(`CREATE TABLE p_default PARTITION OF ${PARTITIONED_TABLE} DEFAULT`);
  await q(`INSERT INTO ${PARTITIONED_TABLE} VALUES (9001, 'open', ${day(-10)}, 'in the default partition')`);
  await q(`UPDATE ${PARTITIONED_TABLE} SET status = 'closed' WHERE id = ${OUT_OF_GUARD_ID}`);
  // A table that references p_fk's rows: detaching p_fk would break it (the row path may delete them: CASCADE).
  await q(`CREATE TABLE event_notes (id bigint, expires_at timestamptz, FOREIGN KEY (id, expires_at) REFERENCES p_fk (id, expires_at) ON DELETE CASCADE)`);
  await q(`INSERT INTO event_notes VALUES (1001, (SELECT expires_at FROM p_fk WHERE id = 1001))`);
  for (const table of [PARTITIONED_TABLE, ...parts.map(([name]) => name), 'p_default', 'event_notes']) await q(`ALTER TABLE ${table} OWNER TO ${pg.escapeIdentifier(owner)}`);
  // ALTER TABLE ... SET SCHEMA back out of reaper_retired (restore) needs CREATE where it goes.
  await q(`GRANT CREATE, USAGE ON SCHEMA public TO ${pg.escapeIdentifier(owner)}`);
}

/** Drops the owner role (after the bed's database, which holds its objects, is gone). */
export async function dropPartitionOwner(adminUrl: string, owner: string): Promise<void> {
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  try {
    await admin.query(`DROP ROLE IF EXISTS ${pg.escapeIdentifier(owner)}`);
  } finally {
    await admin.end();
  }
}

/**
 * A suite's world around the partitioned table: registers before (a test bed, the table, then
 * `setup`, e.g. writing the policies) and after (no leaked process, the bed closed, the owner role
 * dropped). The returned object is filled in by the time the suite's tests run.
 */
export function partitionedSuite(label: string, setup: (bed: TestBed) => Promise<void> | void = () => undefined): { bed: TestBed } {
  const world: Partial<{ bed: TestBed }> = {};
  let owner: string | undefined;
  before(async () => {
    world.bed = await makeTestBed(label);
    owner = partitionOwnerRole(world.bed);
    await createPartitionedTable(world.bed);
    await setup(world.bed);
  });
  after(async () => {
    await assertNoLeakedProcesses();
    await world.bed?.close();
    if (owner) await dropPartitionOwner((await findServers()).databaseUrl, owner);
  });
  return world as { bed: TestBed };
}

/**
 * One manual run of `day-events` with the scheduler and the worker as their printed roles, until
 * it ends (completed or failed): its id and final state.
 */
export async function runDayEventsUntilEnded(bed: TestBed): Promise<{ runId: string; state: string; error: string | null }> {
  const env = bed.env();
  const policies = loadPolicies(env.policiesPath);
  const scheduler = await startScheduler(bed.as(env, 'scheduler'), policies, testLog);
  const worker = await startWorker(bed.as(env, 'worker'), policies, testLog);
  try {
    const run = (await runsInsertIfAbsent(bed.pool, { policy: 'day-events', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const ended = async () => (await bed.pool.query<{ state: string; error: string | null }>(`SELECT state, error FROM cleanup_runs WHERE run_id = $1 AND state IN ('completed', 'failed')`, [run.runId])).rows[0];
    await eventually('the run ended', async () => (await ended()) !== undefined, { timeoutMs: 30_000 });
    const row = (await ended())!;
    return { runId: run.runId, state: row.state, error: row.error };
  } finally {
    await scheduler.stop();
    await worker.stop();
  }
}
