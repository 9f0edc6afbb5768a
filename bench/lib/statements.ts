import { withAdmin } from './database';

/**
 * Per-statement cost of one contender, from pg_stat_statements (issue 18: where reaper's database
 * time per row goes). Optional: only a server started with `shared_preload_libraries =
 * 'pg_stat_statements'` and the extension created in the admin database has it (this machine's
 * shared server has neither; `BENCH_STATEMENTS=1` with DATABASE_URL pointing at a scratch cluster
 * that does, see README Performance). Times are execution + planning time, not CPU: on data that
 * fits in shared buffers the two are close.
 */
export interface StatementCost {
  query: string;
  calls: number;
  rows: number;
  execMs: number;
  planMs: number;
  /** Shared buffers found in PostgreSQL's cache, read from outside it, dirtied, and written out by the backend itself (evicting). */
  blocksHit: number;
  blocksRead: number;
  blocksDirtied: number;
  blocksWritten: number;
  /** Full-page images this statement wrote to WAL (first change of a page after a checkpoint). */
  walFpi: number;
}

export const statementsWanted = (): boolean => process.env.BENCH_STATEMENTS === '1';

/** Forgets every statement's figures, cluster-wide. */
export async function statementsReset(adminUrl: string): Promise<void> {
  await withAdmin(adminUrl, (client) => client.query('SELECT pg_stat_statements_reset()'));
}

/** The statements run in `database` since the last reset, most expensive first. */
export async function statementsRead(adminUrl: string, database: string): Promise<StatementCost[]> {
  return withAdmin(adminUrl, async (client) => {
    const result = await client.query<{ query: string; calls: string; rows: string; exec_ms: number; plan_ms: number; hit: string; read: string; dirtied: string; written: string; fpi: string }>(
      `SELECT s.query, s.calls, s.rows, s.total_exec_time AS exec_ms, s.total_plan_time AS plan_ms,
              s.shared_blks_hit AS hit, s.shared_blks_read AS read, s.shared_blks_dirtied AS dirtied, s.shared_blks_written AS written, s.wal_fpi AS fpi
       FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
       WHERE d.datname = $1
       ORDER BY s.total_exec_time + s.total_plan_time DESC`,
      [database],
    );
    return result.rows.map((row) => ({
      query: row.query,
      calls: Number(row.calls),
      rows: Number(row.rows),
      execMs: row.exec_ms,
      planMs: row.plan_ms,
      blocksHit: Number(row.hit),
      blocksRead: Number(row.read),
      blocksDirtied: Number(row.dirtied),
      blocksWritten: Number(row.written),
      walFpi: Number(row.fpi),
    }));
  });
}

/** Buffers of one table or index over a contender's run (its database is fresh, so counters start at zero). */
export interface RelationBlocks {
  relation: string;
  hit: number;
  read: number;
}

/** Every table's heap and every index's buffers hit and read in `databaseUrl` (pg_statio_user_*; the bench database itself, read with the admin helper's one-client connection). */
export async function relationBlocksRead(databaseUrl: string): Promise<RelationBlocks[]> {
  return withAdmin(databaseUrl, async (client) => {
    const result = await client.query<{ relation: string; hit: string; read: string }>(
      `SELECT relname || ' (heap)' AS relation, coalesce(heap_blks_hit, 0) AS hit, coalesce(heap_blks_read, 0) AS read FROM pg_statio_user_tables
       UNION ALL
       SELECT indexrelname || ' (index)', coalesce(idx_blks_hit, 0), coalesce(idx_blks_read, 0) FROM pg_statio_user_indexes
       ORDER BY 3 DESC, 2 DESC`,
    );
    return result.rows.map((row) => ({ relation: row.relation, hit: Number(row.hit), read: Number(row.read) })).filter((row) => row.hit + row.read > 0);
  });
}

/** A Markdown table of the statements per 100k deleted rows: ms of execution and planning, calls. */
export function statementsMarkdown(title: string, statements: readonly StatementCost[], deletedRows: number, top = 15): string[] {
  const per = (value: number): string => ((value / deletedRows) * 100_000).toFixed(1);
  const perRow = (value: number): string => (value / deletedRows).toFixed(2);
  const totalMs = statements.reduce((sum, s) => sum + s.execMs + s.planMs, 0);
  const lines = [`### ${title}: ${per(totalMs)} ms per 100k rows in all, ${statements.length} statements`, '', '| statement | calls / 100k rows | exec ms / 100k | plan ms / 100k | share | buffers hit / read / dirtied / written per row | WAL full pages / 100k |', '|---|---|---|---|---|---|---|'];
  for (const s of statements.slice(0, top)) {
    const text = s.query.replace(/\s+/g, ' ').replace(/\|/g, '\\|').slice(0, 160);
    lines.push(`| \`${text}\` | ${per(s.calls)} | ${per(s.execMs)} | ${per(s.planMs)} | ${(((s.execMs + s.planMs) / totalMs) * 100).toFixed(1)}% | ${perRow(s.blocksHit)} / ${perRow(s.blocksRead)} / ${perRow(s.blocksDirtied)} / ${perRow(s.blocksWritten)} | ${per(s.walFpi)} |`);
  }
  lines.push('');
  return lines;
}

export function relationBlocksMarkdown(relations: readonly RelationBlocks[], deletedRows: number, top = 8): string[] {
  const lines = ['| relation | buffers hit per row | read per row |', '|---|---|---|'];
  for (const r of relations.slice(0, top)) lines.push(`| ${r.relation} | ${(r.hit / deletedRows).toFixed(2)} | ${(r.read / deletedRows).toFixed(3)} |`);
  lines.push('');
  return lines;
}
