import pg from 'pg';

/**
 * Helpers for tests that log in as reaper's least-privilege roles (`reaper roles --print`). Role
 * names are cluster-wide, so those tests suffix them and drop them with dropTestRoles.
 */

/** The database URL logging in as `role` (trust authentication: no password). */
export function databaseUrlAs(databaseUrl: string, role: string): string {
  const url = new URL(databaseUrl);
  url.username = role;
  url.password = '';
  return url.toString();
}

/** The SQLSTATE a statement fails with as `role`, or undefined when it succeeds. */
export async function sqlStateAs(databaseUrl: string, role: string, sql: string): Promise<string | undefined> {
  const client = new pg.Client({ connectionString: databaseUrlAs(databaseUrl, role) });
  await client.connect();
  try {
    await client.query(sql);
    return undefined;
  } catch (error) {
    return (error as { code?: string }).code;
  } finally {
    await client.end();
  }
}

/** Roles outlive databases: hands back what they own in this database, then drops them. */
export async function dropTestRoles(pool: pg.Pool, roles: readonly string[]): Promise<void> {
  for (const role of roles) {
    if ((await pool.query('SELECT 1 FROM pg_roles WHERE rolname = $1', [role])).rowCount === 0) continue;
    await pool.query(`REASSIGN OWNED BY ${pg.escapeIdentifier(role)} TO CURRENT_USER`);
    await pool.query(`DROP OWNED BY ${pg.escapeIdentifier(role)}`);
    await pool.query(`DROP ROLE ${pg.escapeIdentifier(role)}`);
  }
}
