import type { Db } from '../pool';
import type { ResolvedTarget } from './target';

/**
 * Legal holds (cleanup_holds). A held key is left out of scans and plans, and every statement that
 * acts (the row-delete DELETE, the remote-delete claim) re-checks it with `noActiveHold`, so a hold
 * placed after the scan, while the batch waits in a queue or a delay tier, still wins.
 */

/**
 * SQL condition: no active hold on `keyExpression` for the policy in `policyParameter` (e.g. `$6`).
 * Keys are compared as text, the form ids travel in. Active: until held_until, or until removed.
 */
export function noActiveHold(policyParameter: string, keyExpression: string): string {
  return `NOT EXISTS (SELECT 1 FROM cleanup_holds hold WHERE hold.policy = ${policyParameter} AND hold.key = (${keyExpression})::text
            AND ${holdActiveSql('hold')})`;
}

/** SQL condition: the hold row `alias` is active now (until held_until, or until removed). */
export function holdActiveSql(alias: string): string {
  return `(${alias}.held_until IS NULL OR ${alias}.held_until > statement_timestamp())`;
}

export interface Hold {
  policy: string;
  key: string;
  reason: string;
  heldUntil: string | null;
  createdBy: string;
  createdAt: string;
  active: boolean;
}

interface HoldRow {
  policy: string;
  key: string;
  reason: string;
  held_until: string | null;
  created_by: string;
  created_at: string;
  active: boolean;
}

const HOLD_COLUMNS = `policy, key, reason, reaper_iso(held_until) AS held_until, created_by, reaper_iso(created_at) AS created_at,
  (held_until IS NULL OR held_until > statement_timestamp()) AS active`;

function toHold(row: HoldRow): Hold {
  return {
    policy: row.policy,
    key: row.key,
    reason: row.reason,
    heldUntil: row.held_until,
    createdBy: row.created_by,
    createdAt: row.created_at,
    active: row.active,
  };
}

/**
 * Places (or replaces) holds on `ids`. Each id is cast through the key's own type first, so a uuid
 * is stored in the canonical text the DELETE compares with; a value that cannot be a key raises
 * 22xxx for the caller to report. Returns the holds as stored.
 */
export async function holdsAdd(
  db: Db,
  target: ResolvedTarget,
  hold: { ids: readonly string[]; reason: string; until: string | null; createdBy: string },
): Promise<Hold[]> {
  const result = await db.query<HoldRow>(
    `INSERT INTO cleanup_holds AS h (policy, key, reason, held_until, created_by)
     SELECT $1, (id::${target.keyType})::text, $3, $4::timestamptz, $5 FROM unnest($2::text[]) AS id
     ON CONFLICT (policy, key) DO UPDATE SET reason = excluded.reason, held_until = excluded.held_until,
       created_by = excluded.created_by, created_at = clock_timestamp()
     RETURNING ${HOLD_COLUMNS}`,
    [target.policy, hold.ids, hold.reason, hold.until, hold.createdBy],
  );
  return result.rows.map(toHold);
}

/** Removes holds; returns the keys that had one. */
export async function holdsRemove(db: Db, target: ResolvedTarget, ids: readonly string[]): Promise<string[]> {
  const result = await db.query<{ key: string }>(
    `DELETE FROM cleanup_holds WHERE policy = $1 AND key IN (SELECT (id::${target.keyType})::text FROM unnest($2::text[]) AS id) RETURNING key`,
    [target.policy, ids],
  );
  return result.rows.map((row) => row.key);
}

export async function holdsList(db: Db, filter: { policy?: string | undefined; includeExpired: boolean }): Promise<Hold[]> {
  const result = await db.query<HoldRow>(
    `SELECT ${HOLD_COLUMNS} FROM cleanup_holds
     WHERE ($1::text IS NULL OR policy = $1) AND ($2 OR held_until IS NULL OR held_until > statement_timestamp())
     ORDER BY policy, created_at, key`,
    [filter.policy ?? null, filter.includeExpired],
  );
  return result.rows.map(toHold);
}
