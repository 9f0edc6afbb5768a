import { existsSync, readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import { DEFAULT_DB_ROLE_NAMES, reaperTablesGrant, type DbRoleNames, type GranteeRole, type ReaperTableGrants } from './queries/roles';

/**
 * Forward-only migrations: numbered plain SQL files, each applied in its own transaction. An
 * advisory lock held for the whole pass makes two migrators started at once apply each file once.
 */
const MIGRATION_LOCK = 7_364_917_251; // any constant; shared by every reaper migrator

export function migrationsDirectory(): string {
  // Compiled code runs from dist/shared/db; the .sql files stay in the source tree.
  const candidates = [path.join(__dirname, 'migrations'), path.resolve(__dirname, '..', '..', '..', 'shared', 'db', 'migrations')];
  const found = candidates.find((dir) => existsSync(dir) && readdirSync(dir).some((file) => file.endsWith('.sql')));
  if (!found) throw new Error(`no migrations found in ${candidates.join(' or ')}`);
  return found;
}

export interface Migration {
  version: number;
  name: string;
  sql: string;
}

export function listMigrations(dir = migrationsDirectory()): Migration[] {
  return readdirSync(dir)
    .filter((file) => /^\d{4}_.+\.sql$/.test(file))
    .sort()
    .map((file) => ({ version: Number(file.slice(0, 4)), name: file, sql: readFileSync(path.join(dir, file), 'utf8') }));
}

export interface MigrateOptions {
  onApplying?: (name: string) => void;
  /** Roles granted REAPER_TABLE_GRANTS at the end of the run (those that exist). Default: the default role names. */
  grantTo?: Pick<DbRoleNames, GranteeRole>;
  /** Tests only: more migration directories (a later release's migrations) and their grants. */
  extraDirectories?: readonly string[];
  tableGrants?: ReaperTableGrants;
}

export async function migrate(
  connectionString: string,
  options: MigrateOptions = {},
): Promise<{ applied: string[]; current: number; granted: { tables: string[]; roles: string[] } }> {
  const client = new pg.Client({ connectionString, application_name: 'reaper-migrate' });
  await client.connect();
  try {
    await client.query('SELECT pg_advisory_lock($1)', [MIGRATION_LOCK]);
    await client.query(`CREATE TABLE IF NOT EXISTS reaper_schema_migrations (
      version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`);
    const done = new Set(
      (await client.query<{ version: number }>('SELECT version FROM reaper_schema_migrations')).rows.map((row) => row.version),
    );
    const applied: string[] = [];
    let current = Math.max(0, ...done);
    const migrations = [migrationsDirectory(), ...(options.extraDirectories ?? [])].flatMap((dir) => listMigrations(dir));
    for (const migration of migrations.sort((a, b) => a.version - b.version)) {
      if (done.has(migration.version)) continue;
      options.onApplying?.(migration.name);
      await client.query('BEGIN');
      try {
        await client.query(migration.sql);
        await client.query('INSERT INTO reaper_schema_migrations (version, name) VALUES ($1, $2)', [migration.version, migration.name]);
        await client.query('COMMIT');
      } catch (error) {
        await client.query('ROLLBACK');
        throw new Error(`migration ${migration.name} failed: ${(error as Error).message}`);
      }
      applied.push(migration.name);
      current = migration.version;
    }
    // Every run, not only one that applied something: a table a release added is usable by the
    // services as soon as this commits, and a re-run repairs grants somebody changed by hand.
    await client.query('BEGIN');
    let granted: { tables: string[]; roles: string[] };
    try {
      granted = await reaperTablesGrant(client, options.grantTo ?? DEFAULT_DB_ROLE_NAMES, options.tableGrants);
      await client.query('COMMIT');
    } catch (error) {
      await client.query('ROLLBACK');
      throw new Error(`granting reaper's tables failed: ${(error as Error).message}`);
    }
    return { applied, current, granted };
  } finally {
    await client.query('SELECT pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => undefined);
    await client.end();
  }
}

/** The schema version this build needs (its newest migration) and the one the database is at. */
export interface SchemaVersions {
  wanted: number;
  /** 0 while reaper_schema_migrations does not exist (no `reaper migrate` has run yet). */
  current: number;
}

export function wantedSchemaVersion(): number {
  return Math.max(0, ...listMigrations().map((migration) => migration.version));
}

export async function schemaVersions(db: { query: pg.Pool['query'] }): Promise<SchemaVersions> {
  const wanted = wantedSchemaVersion();
  try {
    const result = await db.query<{ version: number | null }>('SELECT max(version) AS version FROM reaper_schema_migrations');
    return { wanted, current: result.rows[0]?.version ?? 0 };
  } catch (error) {
    if ((error as { code?: string }).code !== '42P01') throw error; // 42P01: the table does not exist yet
    return { wanted, current: 0 };
  }
}

/**
 * Refuses to run against a database whose schema is behind this build: a clear message at start-up
 * instead of "relation does not exist" in the middle of a run. (Deployments wait for it first with
 * `reaper schema wait`, services/cli/schema.ts, so this fires only when nothing migrated.)
 */
export async function assertSchemaCurrent(db: { query: pg.Pool['query'] }): Promise<void> {
  const { wanted, current } = await schemaVersions(db);
  if (current < wanted) {
    throw new Error(`database schema is at version ${current}, this reaper needs ${wanted}: run \`reaper migrate\` first`);
  }
}
