import type { Db } from '../pool';

/**
 * The database clock is the only clock that decides eligibility (docs/design.md invariant 2). A cutoff
 * given by an operator is compared with it, never with the CLI machine's clock.
 */
export async function clockCheckCutoff(db: Db, cutoff: string): Promise<{ inFuture: boolean; now: string; cutoff: string }> {
  const result = await db.query<{ in_future: boolean; now: string; cutoff: string }>(
    `SELECT $1::timestamptz > statement_timestamp() AS in_future, reaper_iso(statement_timestamp()) AS now, reaper_iso($1::timestamptz) AS cutoff`,
    [cutoff],
  );
  const row = result.rows[0]!;
  return { inFuture: row.in_future, now: row.now, cutoff: row.cutoff };
}

/** The database clock now, in the microsecond form batches carry. */
export async function databaseNow(db: Db): Promise<string> {
  const result = await db.query<{ now: string }>('SELECT reaper_iso(statement_timestamp()) AS now');
  return result.rows[0]!.now;
}
