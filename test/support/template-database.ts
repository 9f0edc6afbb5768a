import pg from 'pg';
import { migrate } from '../../shared/db/migrate';
import { demoTablesCreate } from '../../shared/db/queries/demo-tables';
import { findServers } from './servers';
import { stampedSuffix } from './sweeper';

/**
 * One migrated database per test run, which every test bed copies (CREATE DATABASE ... TEMPLATE)
 * instead of applying every migration and the demo tables itself, about 170 times a run.
 * test/run.js makes it before the files start, hands its name to them in this variable and drops it
 * when they are done; a run that is killed leaves it to the sweeper (its name is stamped and starts
 * reaper_test_, like a test bed's). Without the variable (a file run by `node --test` directly) a
 * test bed migrates its own database, as before. Connections to it are refused (ALLOW_CONNECTIONS
 * false): CREATE DATABASE fails while anyone is connected to its template.
 */
export const TEMPLATE_DATABASE_VARIABLE = 'REAPER_TEST_TEMPLATE_DATABASE';

/** What a test bed's database holds before its test: reaper's migrations (or `migrateWith`'s) and the demo's own tables (seat_reservations, media_assets), the tests' targets. */
export async function migrateForTests(databaseUrl: string, migrateWith: (databaseUrl: string) => Promise<unknown> = migrate): Promise<void> {
  await migrateWith(databaseUrl);
  const setup = new pg.Client({ connectionString: databaseUrl });
  await setup.connect();
  try {
    await demoTablesCreate(setup);
  } finally {
    await setup.end();
  }
}

export async function makeTemplateDatabase(): Promise<string> {
  const servers = await findServers();
  const name = `reaper_test_template_${stampedSuffix()}`;
  const admin = new pg.Client({ connectionString: servers.databaseUrl });
  await admin.connect();
  try {
    await admin.query(`CREATE DATABASE ${pg.escapeIdentifier(name)}`);
    try {
      const url = new URL(servers.databaseUrl);
      url.pathname = `/${name}`;
      await migrateForTests(url.toString());
      await admin.query(`ALTER DATABASE ${pg.escapeIdentifier(name)} ALLOW_CONNECTIONS false`);
    } catch (error) {
      await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(name)} WITH (FORCE)`);
      throw error;
    }
  } finally {
    await admin.end();
  }
  return name;
}

export async function dropTemplateDatabase(name: string): Promise<void> {
  const servers = await findServers();
  const admin = new pg.Client({ connectionString: servers.databaseUrl });
  await admin.connect();
  try {
    await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(name)} WITH (FORCE)`);
  } finally {
    await admin.end();
  }
}
