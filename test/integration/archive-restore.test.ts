import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { loadPolicies, parsePolicies, policyVersion, type PolicySet } from '../../shared/config/policies';
import { runsGetSummary, runsInsertIfAbsent } from '../../shared/db/queries/runs';
import { startAuditRetention } from '../../services/scheduler/audit-retention';
import { startScheduler, type SchedulerHandle } from '../../services/scheduler/scheduler';
import { startWorker, type WorkerHandle } from '../../services/worker/worker';
import { eventually } from '../support/eventually';
import { closeBedAndBroker, openBedAndBroker, rowDeletePolicyYaml, type BedAndBroker } from '../support/fixtures';
import { runReaperCli, startReaper } from '../support/processes';
import { seedHolds } from '../support/seed';

/**
 * Archive and restore (issue 19 item 2): the deleting statement archives each deleted row, and
 * `reaper restore --run` puts a run back exactly, never over a key that exists again, once per row
 * even when killed mid-way, only within archive.retainDays, and not into a table whose columns
 * changed. Runs are real (scheduler and worker in process); restore is the real CLI process.
 */
const RETAIN_DAYS = 7;

interface RestoreJson {
  restored: number;
  conflicts: number;
  conflictKeys: string[];
  archived: number;
  alreadyRestored: number;
  restoreId: string | null;
  dryRun: boolean;
}

describe('archive and restore', () => {
  let world: BedAndBroker;
  let policies: PolicySet;
  let scheduler: SchedulerHandle;
  let worker: WorkerHandle;
  const log = pino({ level: process.env.TEST_LOG_LEVEL ?? 'silent' });

  before(async () => {
    // As deployed: `reaper restore` (the CLI) runs as reaper_operator, the role the README names
    // for it (issue 40 item 5: before, no printed role could restore). The runs are in process.
    world = await openBedAndBroker('archive_restore', rowDeletePolicyYaml({ batchSize: 10, archiveRetainDays: RETAIN_DAYS }));
    const env = world.bed.env();
    policies = loadPolicies(env.policiesPath);
    scheduler = await startScheduler(world.bed.as(env, 'scheduler'), policies, log);
    worker = await startWorker(world.bed.as(env, 'worker'), policies, log);
  });

  after(async () => {
    await closeBedAndBroker(world, async () => {
      await scheduler?.stop();
      await worker?.stop();
    });
  });

  const pool = () => world.bed.pool;
  const cli = (args: string[], env: Record<string, string> = {}) => runReaperCli(args, world.bed.processEnv(env));
  const parsed = (stdout: string): RestoreJson => JSON.parse(stdout.slice(stdout.indexOf('{'), stdout.lastIndexOf('}') + 1)) as RestoreJson;

  /** Seeds `expired` held rows (with holders), runs the policy to completion; returns the run and the rows as they were, as text. */
  async function deletedByARun(expired: number): Promise<{ runId: string; ids: string[]; rows: string[] }> {
    await pool().query('TRUNCATE seat_reservations');
    const seeded = await seedHolds(pool(), { expiredHeld: expired, futureHeld: 3 });
    await pool().query(`UPDATE seat_reservations SET holder = 'holder of ' || seat`);
    const ids = seeded.expiredHeld;
    const rows = await rowsAsText(ids);
    const run = (await runsInsertIfAbsent(pool(), { policy: 'seat-holds', trigger: 'manual', scheduledFor: null, cutoff: null }))!;
    const summary = await eventually('the run completed', async () => {
      const found = await runsGetSummary(pool(), run.runId);
      return found?.state === 'completed' ? found : undefined;
    });
    assert.equal(summary.deleted, expired, 'the run deleted every expired row');
    return { runId: run.runId, ids, rows };
  }

  async function rowsAsText(ids: readonly string[]): Promise<string[]> {
    const result = await pool().query<{ row: string }>('SELECT t::text AS row FROM seat_reservations t WHERE reservation_id = ANY($1::uuid[]) ORDER BY reservation_id', [ids]);
    return result.rows.map((row) => row.row);
  }

  test('a policy without `archive` keeps its version hash (the key is absent, not defaulted)', () => {
    const plain = parsePolicies(rowDeletePolicyYaml({ batchSize: 10 }), 'test').get('seat-holds')!;
    assert.ok(!('archive' in plain), 'no archive key is added to a policy that has none');
    // The hash this policy had before `archive` existed (main at 1e957b0): runs and audit rows keep matching it.
    assert.equal(policyVersion(plain), '2873c5ed19330e25');
    const archived = policies.get('seat-holds')!;
    assert.equal(archived.kind === 'row-delete' && archived.archive?.retainDays, RETAIN_DAYS);
  });

  test('a bad run is archived row by row and restored exactly; a second restore restores nothing', async () => {
    const { runId, ids, rows } = await deletedByARun(23);
    assert.deepEqual(await rowsAsText(ids), [], 'the run deleted them');
    const archive = await pool().query<{ n: number; runs: number; versions: string[]; batches: number }>(
      `SELECT count(*)::int AS n, count(DISTINCT run_id)::int AS runs, array_agg(DISTINCT policy_version) AS versions, count(DISTINCT batch_id)::int AS batches
       FROM cleanup_archive WHERE run_id = $1`,
      [runId],
    );
    assert.deepEqual(archive.rows[0], { n: 23, runs: 1, versions: [policyVersion(policies.get('seat-holds')!)], batches: 3 });

    const dry = await cli(['restore', '--run', runId, '--dry-run', '--json']);
    assert.equal(dry.code, 0, dry.stdout);
    assert.deepEqual({ ...parsed(dry.stdout), restoreId: null }, { ...parsed(dry.stdout), restored: 23, conflicts: 0, dryRun: true });
    assert.deepEqual(await rowsAsText(ids), [], '--dry-run changed nothing');

    const restored = await cli(['restore', '--run', runId, '--json']);
    assert.equal(restored.code, 0, restored.stdout);
    const result = parsed(restored.stdout);
    assert.deepEqual({ restored: result.restored, conflicts: result.conflicts, archived: result.archived, alreadyRestored: result.alreadyRestored }, {
      restored: 23,
      conflicts: 0,
      archived: 23,
      alreadyRestored: 0,
    });
    assert.deepEqual(await rowsAsText(ids), rows, 'every row is back exactly as it was (every column, microseconds included)');
    const logged = await pool().query<{ outcome: string; n: number }>('SELECT outcome, count(*)::int AS n FROM cleanup_restores WHERE restore_id = $1 GROUP BY outcome', [result.restoreId]);
    assert.deepEqual(logged.rows, [{ outcome: 'restored', n: 23 }], 'the restore is logged row by row');

    const again = await cli(['restore', '--run', runId, '--json']);
    assert.equal(again.code, 0, again.stdout);
    assert.deepEqual({ restored: parsed(again.stdout).restored, alreadyRestored: parsed(again.stdout).alreadyRestored }, { restored: 0, alreadyRestored: 23 });
    assert.deepEqual(await rowsAsText(ids), rows);
  });

  test('a key re-created since the run is reported, never overwritten; --id restores one key', async () => {
    const { runId, ids, rows } = await deletedByARun(10);
    const recreated = [ids[2]!, ids[7]!].sort();
    await pool().query(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat, holder)
       SELECT id, 'confirmed', now() + interval '1 day', 'new seat', 'new holder' FROM unnest($1::uuid[]) id`,
      [recreated],
    );
    const recreatedRows = await rowsAsText(recreated);

    const one = await cli(['restore', '--run', runId, '--id', ids[0]!.toUpperCase(), '--json']);
    assert.equal(one.code, 0, one.stdout);
    assert.equal(parsed(one.stdout).restored, 1, '--id restores that key only (given in any case a uuid accepts)');
    assert.deepEqual(await rowsAsText([ids[0]!, ids[1]!]), [rowOf(rows, ids[0]!)], 'that row is back, its neighbour not');

    const restore = await cli(['restore', '--run', runId, '--json']);
    assert.equal(restore.code, 1, `keys that exist again: exit 1\n${restore.stdout}`);
    const result = parsed(restore.stdout);
    assert.deepEqual({ restored: result.restored, conflicts: result.conflicts, keys: [...result.conflictKeys].sort() }, { restored: 7, conflicts: 2, keys: recreated });
    assert.deepEqual(await rowsAsText(recreated), recreatedRows, 'the re-created rows are untouched');
    const others = ids.filter((id) => !recreated.includes(id));
    assert.deepEqual(await rowsAsText(others), [...others].sort().map((id) => rowOf(rows, id)), 'the others are back exactly');

    const text = await cli(['restore', '--run', runId]);
    assert.equal(text.code, 1);
    assert.match(text.stdout, /2 row\(s\) NOT restored: their key exists again .*never overwritten/);
    const log = await pool().query<{ outcome: string; n: number }>(`SELECT outcome, count(*)::int AS n FROM cleanup_restores WHERE run_id = $1 GROUP BY outcome ORDER BY outcome`, [runId]);
    assert.deepEqual(log.rows, [
      { outcome: 'conflict', n: 4 },
      { outcome: 'restored', n: 8 },
    ], 'each restore logs the conflicts it reported; each row restored once');
  });

  test('archive ids that cross a power of ten within one step: a conflict is listed once, never a raw cleanup_restores_pkey error (issue 40)', async () => {
    // The run's rows get archive ids 96..107, so one restore step holds 96..99 and 100..107: in
    // text order '99' sorts after '107', the cursor went back to 99, and the next step met the
    // conflict row (id >= 100, still unrestored) again in the same restore (a duplicate log row).
    await pool().query('ALTER TABLE cleanup_archive ALTER COLUMN archive_id RESTART WITH 96');
    const { runId, ids } = await deletedByARun(12);
    const byArchiveId = await pool().query<{ key: string }>(`SELECT key FROM cleanup_archive WHERE run_id = $1 ORDER BY archive_id`, [runId]);
    assert.equal(byArchiveId.rows.length, 12);
    const conflicting = byArchiveId.rows[11]!.key; // archive id 107
    await pool().query(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat, holder) VALUES ($1, 'confirmed', now() + interval '1 day', 'new seat', 'new holder')`,
      [conflicting],
    );
    const restore = await cli(['restore', '--run', runId, '--json', '--batch-size', '50']);
    assert.equal(restore.code, 1, `one key exists again: exit 1, listed\n${restore.stdout}`);
    const result = parsed(restore.stdout);
    assert.deepEqual({ restored: result.restored, conflicts: result.conflicts, keys: result.conflictKeys }, { restored: 11, conflicts: 1, keys: [conflicting] });
    assert.equal(ids.length, 12);
  });

  test('a key the run deleted twice (re-created in between) goes back once; its later copy is reported, and marked only if restored', async () => {
    const { runId, ids, rows } = await deletedByARun(3);
    const twice = ids[1]!;
    // What the archive holds when the application re-created the key during the run and the run deleted it again.
    await pool().query(
      `INSERT INTO cleanup_archive (policy, key, row_data, run_id, batch_id, policy_version)
       SELECT policy, key, jsonb_set(row_data, '{holder}', '"the second holder"'), run_id, batch_id, policy_version
       FROM cleanup_archive WHERE run_id = $1 AND key = $2`,
      [runId, twice],
    );
    const restore = await cli(['restore', '--run', runId, '--json']);
    assert.equal(restore.code, 1, restore.stdout);
    const result = parsed(restore.stdout);
    assert.deepEqual({ restored: result.restored, conflicts: result.conflicts, keys: result.conflictKeys }, { restored: 3, conflicts: 1, keys: [twice] });
    assert.deepEqual(await rowsAsText(ids), rows, 'the earlier copy went back');
    const marks = await pool().query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_archive WHERE run_id = $1 AND restored_at IS NOT NULL', [runId]);
    assert.equal(marks.rows[0]!.n, 3, 'the copy that did not go back is not marked restored');
  });

  test('SIGKILL between batches, then run again: each row is restored exactly once', async () => {
    const { runId, ids, rows } = await deletedByARun(25);
    const killed = startReaper('cli restore (killed)', ['restore', '--run', runId, '--batch-size', '10'], world.bed.processEnv({ REAPER_TEST_FAILPOINT: 'restore-after-batch' }));
    const exit = await killed.exitWithin(60_000, 'to reach the failpoint');
    assert.deepEqual(exit, { code: null, signal: 'SIGKILL' }, killed.output.join('\n'));
    assert.equal((await rowsAsText(ids)).length, 10, 'the first batch committed before the kill');

    const resumed = await cli(['restore', '--run', runId, '--batch-size', '10', '--json']);
    assert.equal(resumed.code, 0, resumed.stdout);
    const result = parsed(resumed.stdout);
    assert.deepEqual({ restored: result.restored, conflicts: result.conflicts, alreadyRestored: result.alreadyRestored }, { restored: 15, conflicts: 0, alreadyRestored: 10 });
    assert.deepEqual(await rowsAsText(ids), rows);
    const once = await pool().query<{ archived: number; restoredOnce: number }>(
      `SELECT count(*)::int AS archived,
         count(*) FILTER (WHERE (SELECT count(*) FROM cleanup_restores r WHERE r.archive_id = a.archive_id AND r.outcome = 'restored') = 1)::int AS "restoredOnce"
       FROM cleanup_archive a WHERE a.run_id = $1 AND a.restored_at IS NOT NULL`,
      [runId],
    );
    assert.deepEqual(once.rows[0], { archived: 25, restoredOnce: 25 });
  });

  test('a run older than archive.retainDays is pruned in bounded passes, and restore says so', async () => {
    const { runId } = await deletedByARun(5);
    await pool().query(`UPDATE cleanup_archive SET deleted_at = deleted_at - $2 * interval '1 day' - interval '1 hour' WHERE run_id = $1`, [runId, RETAIN_DAYS]);
    await pool().query(`UPDATE cleanup_runs SET created_at = created_at - $2 * interval '1 day' - interval '1 hour' WHERE run_id = $1`, [runId, RETAIN_DAYS]);
    const retention = startAuditRetention({ pool: pool(), policies, log, intervalMs: 3_600_000 });
    await retention.stop(); // the first pass runs at start; stop() waits for it
    const left = await pool().query<{ n: number }>('SELECT count(*)::int AS n FROM cleanup_archive WHERE run_id = $1', [runId]);
    assert.equal(left.rows[0]!.n, 0, 'the retention pass pruned the old archive rows');
    const restore = await cli(['restore', '--run', runId]);
    assert.equal(restore.code, 1, restore.stdout);
    assert.match(restore.stdout, new RegExp(`past archive\\.retainDays \\(${RETAIN_DAYS}\\): its archived rows were pruned; restore is only possible within retention`));
  });

  test('a column dropped or renamed since the run: restore refuses, naming it, and restores nothing', async () => {
    const { runId, ids } = await deletedByARun(4);
    await pool().query('ALTER TABLE seat_reservations RENAME COLUMN holder TO holder_name');
    try {
      const restore = await cli(['restore', '--run', runId]);
      assert.equal(restore.code, 1, restore.stdout);
      assert.match(restore.stdout, /column "holder" is archived but table "seat_reservations" no longer has it \(dropped or renamed\)/);
      assert.deepEqual(await rowsAsText(ids), [], 'nothing restored');
    } finally {
      await pool().query('ALTER TABLE seat_reservations RENAME COLUMN holder_name TO holder');
    }
    const usage = await cli(['restore', '--run', 'not-a-run']);
    assert.equal(usage.code, 2, usage.stdout);
    const badKey = await cli(['restore', '--run', runId, '--id', 'not-a-uuid']);
    assert.equal(badKey.code, 2, badKey.stdout);
    assert.match(badKey.stdout, /--id: .*uuid/);
    const unknown = await cli(['restore', '--run', '00000000-0000-4000-8000-000000000000']);
    assert.equal(unknown.code, 1, unknown.stdout);
    assert.match(unknown.stdout, /no run 00000000-0000-4000-8000-000000000000/);
  });
});

/** The row (as text) of `id` among rows as rowsAsText returns them. */
function rowOf(rows: readonly string[], id: string): string {
  const row = rows.find((text) => text.startsWith(`(${id},`));
  assert.ok(row, `row ${id} was seeded`);
  return row;
}
