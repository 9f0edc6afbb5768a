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
}

export const statementsWanted = (): boolean => process.env.BENCH_STATEMENTS === '1';

/** Forgets every statement's figures, cluster-wide. */
export async function statementsReset(adminUrl: string): Promise<void> {
  await withAdmin(adminUrl, (client) => client.query('SELECT pg_stat_statements_reset()'));
}

/** The statements run in `database` since the last reset, most expensive first. */
export async function statementsRead(adminUrl: string, database: string): Promise<StatementCost[]> {
  return withAdmin(adminUrl, async (client) => {
    const result = await client.query<{ query: string; calls: string; rows: string; exec_ms: number; plan_ms: number }>(
      `SELECT s.query, s.calls, s.rows, s.total_exec_time AS exec_ms, s.total_plan_time AS plan_ms
       FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
       WHERE d.datname = $1
       ORDER BY s.total_exec_time + s.total_plan_time DESC`,
      [database],
    );
    return result.rows.map((row) => ({ query: row.query, calls: Number(row.calls), rows: Number(row.rows), execMs: row.exec_ms, planMs: row.plan_ms }));
  });
}

/** A Markdown table of the statements per 100k deleted rows: ms of execution and planning, calls. */
export function statementsMarkdown(title: string, statements: readonly StatementCost[], deletedRows: number, top = 15): string[] {
  const per = (value: number): string => ((value / deletedRows) * 100_000).toFixed(1);
  const totalMs = statements.reduce((sum, s) => sum + s.execMs + s.planMs, 0);
  const lines = [`### ${title}: ${per(totalMs)} ms per 100k rows in all, ${statements.length} statements`, '', '| statement | calls / 100k rows | exec ms / 100k | plan ms / 100k | share |', '|---|---|---|---|---|'];
  for (const s of statements.slice(0, top)) {
    const text = s.query.replace(/\s+/g, ' ').replace(/\|/g, '\\|').slice(0, 160);
    lines.push(`| \`${text}\` | ${per(s.calls)} | ${per(s.execMs)} | ${per(s.planMs)} | ${(((s.execMs + s.planMs) / totalMs) * 100).toFixed(1)}% |`);
  }
  lines.push('');
  return lines;
}
