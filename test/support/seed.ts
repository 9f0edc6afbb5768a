import type pg from 'pg';

/**
 * Seeds seat_reservations for tests. Expiries carry microseconds (random sub-millisecond parts), as
 * real timestamps do, so a message that dropped them would turn deletions into false no-ops.
 */
export async function seedHolds(
  pool: pg.Pool,
  counts: { expiredHeld: number; futureHeld?: number; expiredConfirmed?: number },
): Promise<{ expiredHeld: string[]; futureHeld: string[]; expiredConfirmed: string[] }> {
  const insert = async (count: number, status: 'held' | 'confirmed', expiry: string): Promise<string[]> => {
    if (count === 0) return [];
    const result = await pool.query<{ reservation_id: string }>(
      `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
       SELECT gen_random_uuid(), $2, ${expiry}, 'seat-' || i FROM generate_series(1, $1) i
       RETURNING reservation_id`,
      [count, status],
    );
    return result.rows.map((row) => row.reservation_id);
  };
  const past = `now() - interval '1 hour' + (i * interval '1 millisecond') + (random() * interval '1 millisecond')`;
  const future = `now() + interval '1 day' + (random() * interval '1 hour')`;
  return {
    expiredHeld: await insert(counts.expiredHeld, 'held', past),
    futureHeld: await insert(counts.futureHeld ?? 0, 'held', future),
    expiredConfirmed: await insert(counts.expiredConfirmed ?? 0, 'confirmed', past),
  };
}

export async function countReservations(pool: pg.Pool, ids: readonly string[]): Promise<number> {
  const result = await pool.query<{ n: number }>('SELECT count(*)::int AS n FROM seat_reservations WHERE reservation_id = ANY($1::uuid[])', [ids]);
  return result.rows[0]!.n;
}

/** The items a scan would publish for these ids: exact microsecond expiries read back from the table. */
export async function itemsFor(pool: pg.Pool, ids: readonly string[]): Promise<Array<{ id: string; observedExpiry: string }>> {
  const result = await pool.query<{ id: string; observed: string }>(
    `SELECT reservation_id::text AS id, reaper_iso(expires_at) AS observed FROM seat_reservations
     WHERE reservation_id = ANY($1::uuid[]) ORDER BY expires_at, reservation_id`,
    [ids],
  );
  return result.rows.map((row) => ({ id: row.id, observedExpiry: row.observed }));
}

export async function databaseNowIso(pool: pg.Pool): Promise<string> {
  return (await pool.query<{ now: string }>('SELECT reaper_iso(clock_timestamp()) AS now')).rows[0]!.now;
}
