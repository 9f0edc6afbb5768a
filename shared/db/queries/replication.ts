import type { Db } from '../pool';

/**
 * What the replica-lag brake knows about the standbys (policy `brake`, shared/admission/rows.ts).
 * It fails closed: a standby whose lag cannot be read is UNKNOWN, never lag 0.
 *
 * - Only physical standbys count. A logical walsender (a CDC connector, a logical replica) is
 *   recognised by its logical slot and left out: its lag says nothing about read replicas, and a
 *   slow connector would otherwise hold deletions forever.
 * - `standbys` (application_names), when given, is the complete list: walsenders not in it are left
 *   out (a delayed standby, a backup stream), and a listed name with no walsender is a disconnected
 *   standby: unknown. Without a list every physical walsender counts, and every inactive physical
 *   replication slot is a standby that is gone: unknown.
 * - A walsender that has replayed everything the primary wrote has lag 0 (replay_lag reads NULL
 *   on an idle, caught-up standby); otherwise its replay_lag; NULL there (not reporting yet,
 *   columns hidden from a role without pg_read_all_stats) is unknown.
 *
 * The rule is one SQL text over two relations, so a test can run it over rows it chooses
 * (`replicationLagEvaluate`) that no test server could produce (a logical walsender, a hidden row).
 */

export interface StandbyLag {
  /** Standbys that count (connected or not). */
  standbys: number;
  /** Largest known replay lag, seconds; 0 when none is known. */
  lagSeconds: number;
  /** Standbys whose lag is unknown: application_name, or `slot <name>` for an inactive slot. */
  unknown: string[];
}

/** The server's walsenders: application_name, state, replay_lsn, replay_lag, logical, current_lsn. */
const SERVER_WALSENDERS = `
  SELECT r.application_name, r.state, r.replay_lsn, r.replay_lag,
         EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical') AS logical,
         pg_current_wal_lsn() AS current_lsn
  FROM pg_stat_replication r`;
/** The server's physical slots that no standby uses now: slot_name. */
const SERVER_INACTIVE_SLOTS = `SELECT slot_name::text AS slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND NOT active`;

/**
 * CTEs ending in `lag(standbys, seconds, unknown)`, over `walsenders` and `inactiveSlots` (SQL
 * relations with the columns above) and `names`, a text[] parameter reference ('{}': no list).
 */
export function standbyLagCtes(sources: { walsenders: string; inactiveSlots: string }, names: string): string {
  return `walsender AS (${sources.walsenders}),
    inactive_slot AS (${sources.inactiveSlots}),
    standby AS (
      SELECT coalesce(w.application_name, '(hidden: no pg_read_all_stats)') AS name,
             CASE WHEN w.state = 'streaming' AND w.replay_lsn >= w.current_lsn THEN 0::float8
                  ELSE extract(epoch FROM w.replay_lag)::float8 END AS lag
      FROM walsender w
      WHERE NOT w.logical AND (cardinality(${names}) = 0 OR w.application_name = ANY(${names}))
      UNION ALL
      SELECT n, NULL FROM unnest(${names}) n
      WHERE NOT EXISTS (SELECT 1 FROM walsender w WHERE NOT w.logical AND w.application_name = n)
      UNION ALL
      SELECT 'slot ' || i.slot_name, NULL FROM inactive_slot i WHERE cardinality(${names}) = 0
    ),
    lag AS (
      SELECT count(*)::int AS standbys, coalesce(max(lag), 0)::float8 AS seconds,
             coalesce(array_agg(name ORDER BY name) FILTER (WHERE lag IS NULL), '{}')::text[] AS unknown
      FROM standby
    )`;
}

/** The server's standbys as the brake sees them (also `reaper status`). */
export const SERVER_STANDBY_LAG_CTES = (names: string): string => standbyLagCtes({ walsenders: SERVER_WALSENDERS, inactiveSlots: SERVER_INACTIVE_SLOTS }, names);

export async function replicationLagRead(db: Db, filter: { standbys?: readonly string[] } = {}): Promise<StandbyLag> {
  const result = await db.query<{ standbys: number; seconds: number; unknown: string[] }>(
    `WITH ${SERVER_STANDBY_LAG_CTES('$1::text[]')} SELECT standbys, seconds, unknown FROM lag`,
    [filter.standbys ?? []],
  );
  const row = result.rows[0]!;
  return { standbys: row.standbys, lagSeconds: row.seconds, unknown: row.unknown };
}

/** One walsender row for `replicationLagEvaluate` (what pg_stat_replication would show). */
export interface WalsenderRow {
  applicationName: string | null;
  state: string | null;
  replayLsn: string | null;
  replayLagSeconds: number | null;
  logical: boolean;
  currentLsn: string;
}

/** The brake's rule over given rows instead of the server's (tests: rows no test server can make). */
export async function replicationLagEvaluate(
  db: Db,
  rows: { walsenders: readonly WalsenderRow[]; inactiveSlots: readonly string[] },
  filter: { standbys?: readonly string[] } = {},
): Promise<StandbyLag> {
  const walsenders = `SELECT application_name, state, replay_lsn, replay_lag_s * interval '1 second' AS replay_lag, logical, current_lsn
    FROM unnest($2::text[], $3::text[], $4::pg_lsn[], $5::float8[], $6::bool[], $7::pg_lsn[])
      AS t(application_name, state, replay_lsn, replay_lag_s, logical, current_lsn)`;
  const inactiveSlots = `SELECT slot_name FROM unnest($8::text[]) AS s(slot_name)`;
  const w = rows.walsenders;
  const result = await db.query<{ standbys: number; seconds: number; unknown: string[] }>(
    `WITH ${standbyLagCtes({ walsenders, inactiveSlots }, '$1::text[]')} SELECT standbys, seconds, unknown FROM lag`,
    [
      filter.standbys ?? [],
      w.map((r) => r.applicationName),
      w.map((r) => r.state),
      w.map((r) => r.replayLsn),
      w.map((r) => r.replayLagSeconds),
      w.map((r) => r.logical),
      w.map((r) => r.currentLsn),
      rows.inactiveSlots,
    ],
  );
  const row = result.rows[0]!;
  return { standbys: row.standbys, lagSeconds: row.seconds, unknown: row.unknown };
}

/** Whether this session's role may read the standbys' lag (member of pg_read_all_stats, or superuser). */
export async function replicationLagReadable(db: Db): Promise<{ role: string; readable: boolean }> {
  const result = await db.query<{ role: string; readable: boolean }>(
    `SELECT current_user::text AS role, pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') AS readable`,
  );
  return result.rows[0]!;
}
