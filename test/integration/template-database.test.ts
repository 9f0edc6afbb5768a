/**
 * The run's template database (test/support/template-database.ts): a test bed copied from it holds
 * what a bed that migrates itself holds (tables and columns, indexes, constraints, grants, the
 * migrations recorded), nobody can connect to the template (CREATE DATABASE ... TEMPLATE would fail
 * while anyone is), and dropping it leaves nothing behind.
 */
import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import pg from 'pg';
import { findServers } from '../support/servers';
import { dropTemplateDatabase, makeTemplateDatabase, TEMPLATE_DATABASE_VARIABLE } from '../support/template-database';
import { makeTestBed, type TestBed } from '../support/testbed';

const beds: TestBed[] = [];
after(async () => {
  await Promise.all(beds.map((bed) => bed.close()));
});

/** What the schema holds, as rows of text: a difference between two databases shows as a differing line. */
async function schemaOf(bed: TestBed): Promise<string[]> {
  const rows = await bed.pool.query<{ line: string }>(
    `SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || coalesce(column_default, '') AS line
       FROM information_schema.columns WHERE table_schema = 'public'
     UNION ALL SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
     UNION ALL SELECT 'constraint ' || conrelid::regclass || ' ' || pg_get_constraintdef(oid) FROM pg_constraint WHERE connamespace = 'public'::regnamespace
     UNION ALL SELECT 'grant ' || table_name || ' ' || grantee || ' ' || privilege_type FROM information_schema.role_table_grants WHERE table_schema = 'public' AND grantee NOT LIKE 'reaper\\_t\\_%'
     UNION ALL SELECT 'migration ' || version || ' ' || name FROM reaper_schema_migrations
     ORDER BY 1`,
  );
  return rows.rows.map((row) => row.line);
}

test('a test bed copied from the template database holds what one that migrates itself holds; the template refuses connections and is dropped whole', async () => {
  const template = await makeTemplateDatabase();
  const before = process.env[TEMPLATE_DATABASE_VARIABLE];
  try {
    process.env[TEMPLATE_DATABASE_VARIABLE] = template;
    const copied = await makeTestBed('template_copied');
    beds.push(copied);
    delete process.env[TEMPLATE_DATABASE_VARIABLE];
    const migrated = await makeTestBed('template_migrated');
    beds.push(migrated);
    const [copiedSchema, migratedSchema] = [await schemaOf(copied), await schemaOf(migrated)];
    assert.ok(copiedSchema.some((line) => line.startsWith('column seat_reservations.')), 'the demo tables are there');
    assert.ok(copiedSchema.some((line) => line.startsWith('migration ')), 'the migrations are recorded');
    assert.deepEqual(copiedSchema, migratedSchema);

    const servers = await findServers();
    const url = new URL(servers.databaseUrl);
    url.pathname = `/${template}`;
    const client = new pg.Client({ connectionString: url.toString() });
    await assert.rejects(client.connect(), /not currently accepting connections/, 'nobody connects to the template');
  } finally {
    if (before === undefined) delete process.env[TEMPLATE_DATABASE_VARIABLE];
    else process.env[TEMPLATE_DATABASE_VARIABLE] = before;
    await dropTemplateDatabase(template);
  }
  const admin = new pg.Client({ connectionString: (await findServers()).databaseUrl });
  await admin.connect();
  try {
    assert.equal((await admin.query('SELECT 1 FROM pg_database WHERE datname = $1', [template])).rowCount, 0, 'dropped');
  } finally {
    await admin.end();
  }
});
