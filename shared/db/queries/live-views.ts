import pg from 'pg';
import type { PolicySet } from '../../config/policies';
import type { Db } from '../pool';
import { quoteIdentifier } from '../pool';
import { expiringRowsExpiredSql } from './expiring-rows';

/**
 * Live views (issue 20): a view over a policy's table that leaves out every row reaper would delete
 * now, so readers stop seeing expired rows the moment they expire, not when a run gets to them.
 * The condition is expiringRowsExpiredSql, the scan's own, with `statement_timestamp()` as the
 * cutoff (the clock the worker's DELETE uses) and the policy's name and guard as literals.
 *
 * One view per table: when several policies name the table, a row any of them would delete is left
 * out. The view is plain (no security_invoker): it reads the table and cleanup_holds with its
 * owner's rights (the migrator, `reaper migrate --views`), and readers only need SELECT on it.
 * A keyed lookup through it still uses the table's index: the condition is only a filter.
 */

/** The default view name: the table's, suffixed `_live`, in the table's schema. */
export function liveViewName(table: string): string {
  return `${table}_live`;
}

/** The CREATE OR REPLACE VIEW (and its grants) for `table`, from the policies that name it. */
export function liveViewSql(policies: PolicySet, table: string, options: { viewName?: string; grantTo?: readonly string[] } = {}): string {
  const naming = [...policies.values()].filter((policy) => policy.table === table);
  if (naming.length === 0) throw new Error(`no policy names table "${table}"`);
  const view = quoteIdentifier(options.viewName ?? liveViewName(table));
  const hidden = naming.map((policy) => {
    const guard = Object.keys(policy.guard);
    const condition = expiringRowsExpiredSql(
      { key: quoteIdentifier(policy.key), expiresAt: quoteIdentifier(policy.expiresAt), guardColumns: guard.map(quoteIdentifier) },
      { cutoff: 'statement_timestamp()', policy: pg.escapeLiteral(policy.name), guard: guard.map((column) => pg.escapeLiteral(String(policy.guard[column]))) },
    );
    // IS NOT TRUE, not NOT: a row whose expiry or guard column is NULL is never deleted, so it stays visible.
    return `  -- policy ${policy.name}\n  AND (${condition}) IS NOT TRUE`;
  });
  const grants = (options.grantTo ?? []).map((role) => `GRANT SELECT ON ${view} TO ${quoteIdentifier(role)};`);
  return [
    `-- reaper: ${options.viewName ?? liveViewName(table)} shows the rows of ${table} that no policy (${naming.map((policy) => policy.name).join(', ')}) would delete now.`,
    `CREATE OR REPLACE VIEW ${view} AS`,
    `SELECT t.* FROM ${quoteIdentifier(table)} t`,
    `WHERE true`,
    ...hidden,
    ';',
    `COMMENT ON VIEW ${view} IS ${pg.escapeLiteral(`reaper live view of ${table}: rows reaper would delete now are left out (reaper sql live-view)`)};`,
    ...grants,
    '',
  ].join('\n');
}

/** The tables the policies name, each once. */
export function liveViewTables(policies: PolicySet): string[] {
  return [...new Set([...policies.values()].map((policy) => policy.table))];
}

/** Creates (or replaces) the live view of every policy's table in one transaction; returns the view names. */
export async function liveViewsCreate(db: pg.Client | Db, policies: PolicySet, grantTo: readonly string[]): Promise<string[]> {
  const tables = liveViewTables(policies);
  // One query string without BEGIN: PostgreSQL runs it as one implicit transaction, all or nothing.
  await db.query(tables.map((table) => liveViewSql(policies, table, { grantTo })).join('\n'));
  return tables.map(liveViewName);
}
