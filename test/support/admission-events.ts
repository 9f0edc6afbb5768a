import type pg from 'pg';

/**
 * What admission decided, stamped by the database itself (clock_timestamp() inside triggers on
 * the test's own database): every claim of an operation (a grant of one call, attempt + 1), every
 * change of the 429 block, every change of the pause switch. Grants, blocks and pauses all
 * serialise on the policy's admission row, so "no grant after X" can be checked exactly, whatever
 * the machine speed; the stand-in's wall-clock call times cannot say when a call was granted.
 */
export interface AdmissionEvent {
  /** When the trigger ran (clock_timestamp(), after the decision). */
  ms: number;
  /** When the statement that made the change began (statement_timestamp(), before the decision). */
  statementMs: number;
  /**
   * claim only: the instant the grant was decided at (the bucket's refill instant the same
   * statement stored on the admission row): what the token bucket is exact about.
   */
  decidedMs: number | null;
  kind: 'claim' | 'block' | 'pause';
  detail: string | null;
}

export interface AdmissionEvents {
  read(): Promise<AdmissionEvent[]>;
  remove(): Promise<void>;
}

export async function recordAdmissionEvents(pool: pg.Pool): Promise<AdmissionEvents> {
  await pool.query(
    `CREATE TABLE IF NOT EXISTS reaper_test_admission_events (at timestamptz NOT NULL, statement_at timestamptz NOT NULL, decided_at timestamptz, kind text NOT NULL, detail text)`,
  );
  // An AFTER trigger sees the whole statement's changes: the admission row as the claiming statement stored it.
  await pool.query(`CREATE OR REPLACE FUNCTION reaper_test_claim_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
    BEGIN
      INSERT INTO reaper_test_admission_events
        VALUES (clock_timestamp(), statement_timestamp(), (SELECT refilled_at FROM cleanup_admission WHERE policy = NEW.policy), 'claim', NEW.operation_key);
      RETURN NULL;
    END $$`);
  await pool.query(`CREATE OR REPLACE FUNCTION reaper_test_admission_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
    BEGIN
      IF NEW.blocked_until IS DISTINCT FROM OLD.blocked_until THEN
        INSERT INTO reaper_test_admission_events VALUES (clock_timestamp(), statement_timestamp(), NULL, 'block', NEW.blocked_until::text);
      END IF;
      IF NEW.paused IS DISTINCT FROM OLD.paused THEN
        INSERT INTO reaper_test_admission_events VALUES (clock_timestamp(), statement_timestamp(), NULL, 'pause', NEW.paused::text);
      END IF;
      RETURN NULL;
    END $$`);
  await pool.query(`CREATE OR REPLACE TRIGGER reaper_test_claim AFTER UPDATE ON cleanup_ledger FOR EACH ROW
    WHEN (NEW.state = 'in_flight' AND NEW.attempt_count > OLD.attempt_count) EXECUTE FUNCTION reaper_test_claim_event()`);
  await pool.query(`CREATE OR REPLACE TRIGGER reaper_test_admission AFTER UPDATE ON cleanup_admission FOR EACH ROW EXECUTE FUNCTION reaper_test_admission_event()`);
  await pool.query('DELETE FROM reaper_test_admission_events');
  return {
    async read() {
      return (
        await pool.query<AdmissionEvent>(
          `SELECT (extract(epoch FROM at) * 1000)::float8 AS ms, (extract(epoch FROM statement_at) * 1000)::float8 AS "statementMs",
                  (extract(epoch FROM decided_at) * 1000)::float8 AS "decidedMs", kind, detail
           FROM reaper_test_admission_events ORDER BY at`,
        )
      ).rows;
    },
    async remove() {
      await pool.query('DROP TRIGGER IF EXISTS reaper_test_claim ON cleanup_ledger');
      await pool.query('DROP TRIGGER IF EXISTS reaper_test_admission ON cleanup_admission');
    },
  };
}
