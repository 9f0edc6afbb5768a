/**
 * The conditional DELETE every contender runs, spelled once. It is the same predicate as reaper's
 * (key, exact observed expiry to the microsecond, expiry <= cutoff, guard) without reaper's batch
 * receipt, so the raw floor and pg-boss do the least work that is still correct.
 */

/** Deletes the rows of one batch that are still expired and unchanged. $1 ids, $2 observed expiries, $3 cutoff. */
export const DELETE_BATCH_SQL = `DELETE FROM seat_reservations t
  USING unnest($1::uuid[], $2::timestamptz[]) AS item(id, observed_expiry)
  WHERE t.reservation_id = item.id AND t.expires_at = item.observed_expiry AND t.expires_at <= $3::timestamptz AND t.status = 'held'`;

/** The same for a single row. $1 id, $2 observed expiry, $3 cutoff. */
export const DELETE_ROW_SQL = `DELETE FROM seat_reservations t
  WHERE t.reservation_id = $1::uuid AND t.expires_at = $2::timestamptz AND t.expires_at <= $3::timestamptz AND t.status = 'held'`;

export interface ScannedItem {
  id: string;
  observedExpiry: string;
}

/** A pg-boss job carrying one batch: the same fields as reaper's batch message, minus the envelope. */
export interface BatchJobData {
  cutoff: string;
  items: ScannedItem[];
}

/** A pg-boss job carrying one row: the common one-job-per-row design. */
export interface RowJobData extends ScannedItem {
  cutoff: string;
}
