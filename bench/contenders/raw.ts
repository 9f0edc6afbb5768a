import { randomUUID } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import pg from 'pg';
import { ROW_DELETE_PLAN_CACHE_MODE } from '../../shared/db/pool';
import { expiringRowsDeleteGroupIfStillExpired } from '../../shared/db/queries/expiring-rows';
import { targetResolve } from '../../shared/db/queries/target';
import { checkFinished, checkSeatRows, throughput, type BenchContext, type Measured } from '../lib/context';
import { CpuMeter } from '../lib/cpu';
import { countSeatRows, databaseNowIso, type Seed } from '../lib/database';
import { seatHoldsPolicy } from '../lib/policies';
import { DELETE_BATCH_SQL } from './sql';

/**
 * The floor: the conditional DELETE alone. The candidates are read first (untimed) in reaper's scan
 * order and cut into batches of the same size; then `clients` connections each take the next batch
 * and run BEGIN / DELETE ... USING unnest(ids, expiries) / COMMIT until none is left. No scan, no
 * broker, no receipts: what the database itself costs.
 *
 * `statement: 'reaper'` runs reaper's own statement instead (the product's query function: the
 * same DELETE plus the batch receipt, in the same BEGIN / COMMIT as the worker): a diagnostic that
 * splits what reaper costs into database work and pipeline.
 */
export async function runRawDelete(
  context: BenchContext,
  seed: Seed,
  options: { clients: number; batchSize: number; statement?: 'plain' | 'reaper' },
): Promise<Measured> {
  await context.databases.fresh();
  const pool = context.databases.pool(1, 'bench-raw-reader');
  const deleters = context.databases.pool(options.clients, 'bench-raw');
  const clients: pg.PoolClient[] = [];
  try {
    const cutoff = await databaseNowIso(pool);
    const rows = (
      await pool.query<{ id: string; expiry: string }>(
        `SELECT reservation_id::text AS id, reaper_iso(expires_at) AS expiry FROM seat_reservations
         WHERE status = 'held' AND expires_at <= $1::timestamptz ORDER BY expires_at, reservation_id`,
        [cutoff],
      )
    ).rows;
    const batches: Array<{ ids: string[]; expiries: string[] }> = [];
    for (let start = 0; start < rows.length; start += options.batchSize) {
      const slice = rows.slice(start, start + options.batchSize);
      batches.push({ ids: slice.map((row) => row.id), expiries: slice.map((row) => row.expiry) });
    }
    const target = await targetResolve(pool, seatHoldsPolicy('raw', options.batchSize));
    const runId = randomUUID();
    const deleteBatch = async (client: pg.PoolClient, batch: { ids: string[]; expiries: string[] }, index: number): Promise<number> => {
      if (options.statement !== 'reaper') return (await client.query(DELETE_BATCH_SQL, [batch.ids, batch.expiries, cutoff])).rowCount ?? 0;
      const items = batch.ids.map((id, i) => ({ id, observedExpiry: batch.expiries[i]! }));
      // The worker's own statement, for one batch (it coalesces several when it holds them).
      const outcome = await expiringRowsDeleteGroupIfStillExpired(client, target, {
        policy: 'raw',
        batches: [{ batchId: `${runId}:${index}`, runId, cutoff, items }],
        workerId: 'bench-raw',
      });
      return outcome.batches[0]!.deleted;
    };
    for (let i = 0; i < options.clients; i++) {
      const client = await deleters.connect();
      // As the worker's transaction plans it (shared/db/pool.ts).
      if (options.statement === 'reaper') await client.query(`SET plan_cache_mode = ${ROW_DELETE_PLAN_CACHE_MODE}`);
      clients.push(client);
    }

    const cpu = new CpuMeter(pool, { services: [], backends: 'bench-raw', includeSelf: true });
    await cpu.start();
    const deadline = Date.now() + context.boundMs;
    let next = 0;
    let deleted = 0;
    let bounded = false;
    const started = performance.now();
    await Promise.all(
      clients.map(async (client) => {
        for (;;) {
          if (Date.now() > deadline) {
            bounded = true;
            return;
          }
          const index = next++;
          const batch = batches[index];
          if (!batch) return;
          await client.query('BEGIN');
          const count = await deleteBatch(client, batch, index);
          await client.query('COMMIT');
          deleted += count;
        }
      }),
    );
    const seconds = (performance.now() - started) / 1000;
    const cpuSplit = await cpu.finish();
    const figure = `${options.statement === 'reaper' ? "reaper's statement" : 'raw DELETE'}, ${options.clients} clients, batch ${options.batchSize}, ${seed.candidates} candidates`;
    if (checkFinished(context, figure, !bounded)) checkSeatRows(context, figure, seed, seed.candidates, await countSeatRows(pool));
    return { ...throughput(deleted, seconds, bounded), cpu: cpuSplit };
  } finally {
    for (const client of clients) client.release();
    await deleters.end();
    await pool.end();
  }
}
