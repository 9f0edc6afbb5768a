import type pg from 'pg';
import type { PolicySet } from '../../config/policies';
import type { Db } from '../pool';
import { quoteIdentifier } from '../pool';

/**
 * Least privilege in PostgreSQL, as SQL: four roles and exactly the grants each needs.
 *
 *  - the migrator owns reaper's own tables and may create new ones (the migrate Job), and owns
 *    the live views (`reaper migrate --views`), so it reads the targets;
 *  - the scheduler reads the targets (keyset scans, webhooks), writes runs, records ledger
 *    candidates from webhooks;
 *  - the worker deletes rows of row-delete targets, settles rows of remote-delete targets (DELETE,
 *    or UPDATE when the policy has `markConfirmed`), writes receipts, the ledger and admission;
 *  - the operator runs the CLI's commands (trigger, approve, reject, pause, hold, admission, dlq,
 *    audit, plan, status): it records and decides runs, places holds and overrides, reads the rest.
 *
 * Nobody else gets anything: the worker can neither drop a table nor delete from a table that no
 * policy names (test/integration/least-privilege-db.test.ts). The SQL is idempotent: it creates what
 * is missing and revokes before it grants, so re-running it after a policy or a migration changed
 * leaves exactly the new set. Run it as a superuser or the owner of every table involved (the
 * targets belong to their application), after `reaper migrate`. Later migrations need no re-run for
 * reaper's own tables: `reaper migrate` re-applies REAPER_TABLE_GRANTS at the end of every run
 * (reaperTablesGrant), so a table a release adds is usable by the services the moment it exists.
 */

export type DbPrivilege = 'SELECT' | 'INSERT' | 'UPDATE' | 'DELETE';
/** A table privilege, or UPDATE of some columns only (`UPDATE (state, updated_at)`: least privilege where a role changes a few columns). */
export type TablePrivilege = DbPrivilege | `UPDATE (${string})`;

/** The columns of a column privilege (`UPDATE (a, b)` -> ['a', 'b']); null for a table privilege. */
export function privilegeColumns(privilege: TablePrivilege): { privilege: DbPrivilege; columns: string[] | null } {
  const match = /^(UPDATE) \((.+)\)$/.exec(privilege);
  return match ? { privilege: 'UPDATE', columns: match[2]!.split(',').map((column) => column.trim()) } : { privilege: privilege as DbPrivilege, columns: null };
}

/** The roles, by purpose. Tests suffix them (role names are cluster-wide). */
export interface DbRoleNames {
  migrator: string;
  scheduler: string;
  worker: string;
  operator: string;
}

export const DEFAULT_DB_ROLE_NAMES: DbRoleNames = {
  migrator: 'reaper_migrator',
  scheduler: 'reaper_scheduler',
  worker: 'reaper_worker',
  operator: 'reaper_operator',
};

/** The roles that get grants on reaper's tables (the migrator owns them). */
export type GranteeRole = 'scheduler' | 'worker' | 'operator';
const GRANTEES: readonly GranteeRole[] = ['scheduler', 'worker', 'operator'];

/** Per table, what each grantee may do (the operator: nothing unless named). */
export type ReaperTableGrants = Readonly<Record<string, { scheduler: readonly TablePrivilege[]; worker: readonly TablePrivilege[]; operator?: readonly TablePrivilege[] }>>;

/**
 * reaper's own tables and what each service does with them, read off shared/db/queries/ (SELECT
 * ... FOR UPDATE needs UPDATE; INSERT ... ON CONFLICT DO UPDATE needs UPDATE). A migration that
 * adds a table must add it here: test/integration/least-privilege-db.test.ts compares this list
 * with the tables the migrations create, and `reaper migrate` grants what is listed here.
 * The operator's column is what the CLI's operator commands run (the same statements: `trigger
 * --execute` executes a run as the scheduler does).
 */
export const REAPER_TABLE_GRANTS: ReaperTableGrants = {
  reaper_schema_migrations: { scheduler: ['SELECT'], worker: ['SELECT'], operator: ['SELECT'] }, // assertSchemaCurrent at start-up, and `reaper doctor`
  cleanup_runs: { scheduler: ['SELECT', 'INSERT', 'UPDATE'], worker: [], operator: ['SELECT', 'INSERT', 'UPDATE'] },
  cleanup_run_batches: { scheduler: ['SELECT', 'INSERT'], worker: [], operator: ['SELECT', 'INSERT'] },
  cleanup_batches: { scheduler: ['SELECT'], worker: ['SELECT', 'INSERT'], operator: ['SELECT'] },
  cleanup_ledger: { scheduler: ['SELECT', 'INSERT', 'UPDATE'], worker: ['SELECT', 'INSERT', 'UPDATE'], operator: ['SELECT'] },
  // the scheduler's backlog gauges read the pause switch and the 429 block; `reaper pause` sets it
  cleanup_admission: { scheduler: ['SELECT'], worker: ['SELECT', 'INSERT', 'UPDATE'], operator: ['SELECT', 'INSERT', 'UPDATE'] },
  // kept bodies of remote batches until their receipt; the ledger sweeper republishes them; a
  // scheduled run (scheduler, or `trigger --execute` as the operator) reads which were received
  cleanup_remote_batches: { scheduler: ['SELECT'], worker: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'], operator: ['SELECT'] },
  // webhook signatures accepted once, pruned by age (the prune's FOR UPDATE SKIP LOCKED needs UPDATE)
  cleanup_webhook_signatures: { scheduler: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'], worker: [] },
  // legal holds: read by the scan, the brake and every deleting statement; placed by operators
  cleanup_holds: { scheduler: ['SELECT'], worker: ['SELECT'], operator: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'] },
  // audit rows: written by the deleting statements, kept to retainDays by the scheduler
  // (remote-delete: a confirmation is audited once per operation, a NOT EXISTS over the audit: SELECT)
  cleanup_audit: { scheduler: ['SELECT', 'INSERT', 'DELETE'], worker: ['SELECT', 'INSERT'], operator: ['SELECT'] }, // scheduler INSERT: a retired partition's row
  // archived rows (archive.enabled): written by the deleting statement, kept to retainDays by the
  // scheduler; `reaper restore` runs as reaper_operator: it locks and marks the rows it puts back
  // (FOR UPDATE, UPDATE) and INSERTs into the policy's table (targetGrants: archived policies only)
  cleanup_archive: { scheduler: ['SELECT', 'DELETE'], worker: ['INSERT'], operator: ['SELECT', 'UPDATE'] },
  // the restore log: written by `reaper restore` (the operator) only, rows and partitions
  cleanup_restores: { scheduler: [], worker: [], operator: ['SELECT', 'INSERT'] },
  // expiry events: written by the deleting statements (the worker reads its size for the limit);
  // `reaper relay` (scheduler role) claims (UPDATE), publishes and deletes them, the scheduler's gauge reads their age
  cleanup_outbox: { scheduler: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'], worker: ['SELECT', 'INSERT'], operator: ['SELECT'] }, // scheduler INSERT: a retired partition's event
  // partition retirements (issue 44): the scheduler records and steps them (detach, quarantine, drop);
  // `reaper restore --partition` (the operator) locks one (FOR UPDATE: UPDATE on some column) and
  // marks it restored, `reaper partitions --release` marks it released with who did: those columns
  // only; `reaper partitions`/status read them
  cleanup_partitions: { scheduler: ['SELECT', 'INSERT', 'UPDATE'], worker: [], operator: ['SELECT', 'UPDATE (state, reason, updated_at)'] },
  // `reaper admission set`: live overrides every worker reads (set by operators)
  cleanup_admission_overrides: { scheduler: ['SELECT'], worker: ['SELECT'], operator: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'] },
  // each process records a heartbeat (and forgets old ones); the scheduler reads the workers' versions
  service_heartbeats: {
    scheduler: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'],
    worker: ['SELECT', 'INSERT', 'UPDATE', 'DELETE'],
    operator: ['SELECT'], // `trigger` warns when no scheduler is running
  },
};

/** reaper's functions, owned by the migrator with its tables. */
const REAPER_FUNCTIONS = ['reaper_iso(timestamptz)'];

/** Role defaults: a session that forgets to set them still cannot hang on a lock or a statement. */
export interface DbRoleTimeouts {
  statementTimeoutMs: number;
  lockTimeoutMs: number;
  idleInTransactionSessionTimeoutMs: number;
}

export const DEFAULT_DB_ROLE_TIMEOUTS: Readonly<Record<keyof DbRoleNames, DbRoleTimeouts>> = {
  // A migration may rewrite a large table; it must still not queue forever behind an application's
  // lock (that would block every query queued behind the migration's own lock request).
  migrator: { statementTimeoutMs: 900_000, lockTimeoutMs: 10_000, idleInTransactionSessionTimeoutMs: 60_000 },
  // The same values as REAPER_STATEMENT_TIMEOUT_MS / REAPER_LOCK_TIMEOUT_MS (env.ts), which the
  // services also send per session; the role defaults cover any other client using the role.
  scheduler: { statementTimeoutMs: 60_000, lockTimeoutMs: 5_000, idleInTransactionSessionTimeoutMs: 60_000 },
  worker: { statementTimeoutMs: 60_000, lockTimeoutMs: 5_000, idleInTransactionSessionTimeoutMs: 60_000 },
  operator: { statementTimeoutMs: 60_000, lockTimeoutMs: 5_000, idleInTransactionSessionTimeoutMs: 60_000 },
};

/**
 * What each role gets on each policy's table, by policy kind (the migrator: SELECT; the operator:
 * SELECT, and INSERT where a row-delete policy archives its rows: `reaper restore` puts them back).
 */
export function targetGrants(policies: PolicySet): Map<string, { scheduler: Set<DbPrivilege>; worker: Set<DbPrivilege>; operator: Set<DbPrivilege> }> {
  const grants = new Map<string, { scheduler: Set<DbPrivilege>; worker: Set<DbPrivilege>; operator: Set<DbPrivilege> }>();
  for (const policy of policies.values()) {
    const entry = grants.get(policy.table) ?? { scheduler: new Set<DbPrivilege>(), worker: new Set<DbPrivilege>(), operator: new Set<DbPrivilege>(['SELECT']) };
    if (policy.kind === 'row-delete' && policy.archive?.enabled) entry.operator.add('INSERT');
    // The scheduler scans for expired rows (and webhooks re-read one): read only.
    entry.scheduler.add('SELECT');
    // The worker's conditional DELETE/UPDATE reads the columns it compares (SELECT), and the
    // remote-delete ledger joins the target when it records candidates.
    entry.worker.add('SELECT');
    if (policy.kind === 'row-delete') entry.worker.add('DELETE');
    else if (policy.markConfirmed && Object.keys(policy.markConfirmed).length > 0) entry.worker.add('UPDATE');
    else entry.worker.add('DELETE');
    grants.set(policy.table, entry);
  }
  return grants;
}

function literal(text: string): string {
  return `'${text.replace(/'/g, "''")}'`;
}

function ms(value: number): string {
  return literal(`${value}ms`);
}

/** Schemas the targets live in, besides the search path's `public`. */
function targetSchemas(tables: Iterable<string>): string[] {
  return [...new Set([...tables].filter((table) => table.includes('.')).map((table) => table.split('.')[0]!))];
}

/**
 * Revoke-then-grant for one of reaper's own tables, to the grantees given (those that exist): run
 * by the table's owner, in one transaction, so no session sees the table without its grants.
 */
function reaperTableGrantSql(table: string, grants: ReaperTableGrants[string], grantees: Partial<Record<GranteeRole, string>>): string[] {
  const q = (name: string) => quoteIdentifier(name);
  const roles = GRANTEES.filter((role) => grantees[role] !== undefined);
  const lines = [`REVOKE ALL ON ${q(table)} FROM ${['PUBLIC', ...roles.map((role) => q(grantees[role]!))].join(', ')};`];
  for (const role of roles) {
    const privileges = grants[role] ?? [];
    if (privileges.length > 0) lines.push(`GRANT ${privileges.join(', ')} ON ${q(table)} TO ${q(grantees[role]!)};`);
  }
  return lines;
}

/** The schema retired partitions are kept in (shared/db/queries/partitions.ts RETIRED_SCHEMA; migration 0029). */
const RETIRED_SCHEMA_NAME = 'reaper_retired';

/**
 * Schema reaper_retired (owned by the migrator): the scheduler moves retired partitions into it
 * (ALTER TABLE ... SET SCHEMA needs CREATE there) and drops them; the operator reads and restores
 * them (USAGE: `reaper restore --partition` moves one back out).
 */
function retiredSchemaGrantSql(grantees: Partial<Record<GranteeRole, string>>): string[] {
  const q = (name: string) => quoteIdentifier(name);
  const lines = [`REVOKE ALL ON SCHEMA ${q(RETIRED_SCHEMA_NAME)} FROM PUBLIC;`];
  if (grantees.scheduler) lines.push(`GRANT USAGE, CREATE ON SCHEMA ${q(RETIRED_SCHEMA_NAME)} TO ${q(grantees.scheduler)};`);
  if (grantees.operator) lines.push(`GRANT USAGE ON SCHEMA ${q(RETIRED_SCHEMA_NAME)} TO ${q(grantees.operator)};`);
  return lines;
}

/**
 * `reaper migrate` ends every run with this: REAPER_TABLE_GRANTS applied to each of reaper's tables
 * that exists and that the migrating role owns (or may act as the owner of), for each grantee role
 * that exists. A release whose migration adds a table lists it in REAPER_TABLE_GRANTS, and the
 * services can use it as soon as the migration committed: no `roles --print` to re-run. Roles that
 * do not exist (a local stack without least-privilege roles) are skipped. Returns what it granted.
 */
export async function reaperTablesGrant(
  db: Db | pg.Client,
  names: Pick<DbRoleNames, GranteeRole>,
  grants: ReaperTableGrants = REAPER_TABLE_GRANTS,
): Promise<{ tables: string[]; roles: string[] }> {
  const existing = await db.query<{ name: string }>('SELECT rolname AS name FROM pg_roles WHERE rolname = ANY($1::text[])', [GRANTEES.map((role) => names[role])]);
  const present = new Set(existing.rows.map((row) => row.name));
  const grantees: Partial<Record<GranteeRole, string>> = {};
  for (const role of GRANTEES) if (present.has(names[role])) grantees[role] = names[role];
  if (Object.keys(grantees).length === 0) return { tables: [], roles: [] };
  const owned = await db.query<{ name: string }>(
    `SELECT n.name FROM unnest($1::text[]) AS n(name)
     JOIN pg_class c ON c.oid = to_regclass(quote_ident(n.name))
     WHERE pg_has_role(current_user, c.relowner, 'USAGE') ORDER BY n.name`,
    [Object.keys(grants)],
  );
  const tables = owned.rows.map((row) => row.name);
  if (tables.length > 0) await db.query(tables.flatMap((table) => reaperTableGrantSql(table, grants[table]!, grantees)).join('\n'));
  const retired = await db.query<{ owned: boolean }>(
    `SELECT pg_has_role(current_user, nspowner, 'USAGE') AS owned FROM pg_namespace WHERE nspname = $1`,
    [RETIRED_SCHEMA_NAME],
  );
  if (retired.rows[0]?.owned) await db.query(retiredSchemaGrantSql(grantees).join('\n'));
  return { tables, roles: Object.values(grantees) };
}

/**
 * The SQL that creates the roles (LOGIN, no password: set it with `ALTER ROLE ... PASSWORD` or use
 * your platform's authentication), sets their defaults and grants exactly what each needs.
 */
export function rolesSql(policies: PolicySet, names: DbRoleNames = DEFAULT_DB_ROLE_NAMES, timeouts = DEFAULT_DB_ROLE_TIMEOUTS): string {
  const q = (name: string) => quoteIdentifier(name);
  const { migrator, scheduler, worker, operator } = { migrator: q(names.migrator), scheduler: q(names.scheduler), worker: q(names.worker), operator: q(names.operator) };
  const all = ['migrator', 'scheduler', 'worker', 'operator'] as const;
  const lines: string[] = [
    `-- reaper: least-privilege roles (${all.map((role) => names[role]).join(', ')}).`,
    '-- Run as a superuser (or the owner of every table below) BEFORE the first `reaper migrate`, which',
    '-- runs as the migrator it creates, and again whenever the policies change; safe to run again.',
    '-- On a fresh database reaper\'s tables do not exist yet: their blocks below do nothing, and',
    '-- `reaper migrate` (as the migrator) grants the same on each table as it creates it.',
    '-- Passwords are not set here: ALTER ROLE <role> PASSWORD ..., or your platform\'s authentication.',
    'BEGIN;',
    '',
    '-- The roles: log in, nothing else (no superuser, no CREATEROLE, no CREATEDB, no RLS bypass).',
  ];
  for (const key of all) {
    const role = names[key];
    lines.push(
      `DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = ${literal(role)}) THEN CREATE ROLE ${q(role)}; END IF; END $$;`,
      `ALTER ROLE ${q(role)} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT;`,
    );
  }
  lines.push('', '-- Role defaults: every session of the role starts with these limits.');
  for (const key of all) {
    const limits = timeouts[key];
    const role = q(names[key]);
    lines.push(
      `ALTER ROLE ${role} SET statement_timeout = ${ms(limits.statementTimeoutMs)};`,
      `ALTER ROLE ${role} SET lock_timeout = ${ms(limits.lockTimeoutMs)};`,
      `ALTER ROLE ${role} SET idle_in_transaction_session_timeout = ${ms(limits.idleInTransactionSessionTimeoutMs)};`,
    );
  }
  const rowPolicies = [...policies.values()].filter((policy) => policy.kind === 'row-delete');
  const braked = rowPolicies.some((policy) => policy.brake !== undefined);
  const adaptive = rowPolicies.some((policy) => policy.admission?.adaptive !== false);
  if (braked || adaptive) {
    // The replica-lag brake reads replay_lag from pg_stat_replication, and adaptive admission (the
    // default) reads the application's sessions in pg_stat_activity: only members of
    // pg_read_all_stats (or superusers) see either. Without it the brake would read no lag, and
    // adaptive admission no application (the worker refuses to start instead).
    const uses = [braked ? 'brake.maxReplicationLagSeconds (the standbys\' replay lag)' : null, adaptive ? 'adaptive admission (other sessions\' state)' : null].filter(Boolean).join(' and ');
    lines.push('', `-- ${uses}: the worker reads server statistics.`, `GRANT pg_read_all_stats TO ${q(names.worker)};`);
  }
  if (braked) {
    // `reaper status` shows the standbys' lag and whether the brake is engaged: as the operator it
    // reads pg_stat_replication too (without the role it would read no lag: "not engaged").
    lines.push('-- brake.maxReplicationLagSeconds: `reaper status` (the operator) reads the standbys\' lag.', `GRANT pg_read_all_stats TO ${q(names.operator)};`);
  }
  const targets = targetGrants(policies);
  lines.push(
    '',
    '-- The database and the schema: the migrator creates tables, the others only look them up.',
    `DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I, %I, %I, %I', current_database(), ${all.map((role) => literal(names[role])).join(', ')}); END $$;`,
    `GRANT USAGE, CREATE ON SCHEMA public TO ${migrator};`,
    `GRANT USAGE ON SCHEMA public TO ${scheduler}, ${worker}, ${operator};`,
    ...targetSchemas(targets.keys()).map((schema) => `GRANT USAGE ON SCHEMA ${q(schema)} TO ${migrator}, ${scheduler}, ${worker}, ${operator};`),
    '',
    "-- reaper's own tables: owned by the migrator (later migrations alter them), then exactly the",
    '-- statements each role runs (shared/db/queries/). `reaper migrate` re-applies these grants at the',
    '-- end of every run, so a table a later release adds needs no re-run of this file. Each block acts',
    '-- only where its table exists (a fresh database has none yet).',
  );
  const whereExists = (exists: string, statements: readonly string[]) => [`DO $$ BEGIN IF ${exists} IS NOT NULL THEN`, ...statements.map((statement) => `  ${statement}`), 'END IF; END $$;'];
  for (const [table, grants] of Object.entries(REAPER_TABLE_GRANTS)) {
    lines.push(...whereExists(`to_regclass(${literal(q(table))})`, [`ALTER TABLE ${q(table)} OWNER TO ${migrator};`, ...reaperTableGrantSql(table, grants, names)]));
  }
  for (const fn of REAPER_FUNCTIONS) lines.push(...whereExists(`to_regprocedure(${literal(fn)})`, [`ALTER FUNCTION ${fn} OWNER TO ${migrator};`]));
  // Created here, not only by migration 0029: CREATE SCHEMA needs CREATE on the database, which the
  // migrator does not get; on a new database this SQL runs before the first migrate (first install).
  lines.push(`CREATE SCHEMA IF NOT EXISTS ${q(RETIRED_SCHEMA_NAME)};`, `ALTER SCHEMA ${q(RETIRED_SCHEMA_NAME)} OWNER TO ${migrator};`, ...retiredSchemaGrantSql(names));
  lines.push(
    '',
    '-- The policies\' tables (they belong to their application): per policy kind, see docs/deploying.md "Deploying".',
    '-- The operator reads them (plan, status, trigger --execute); the migrator reads them for the live',
    '-- views it owns (`reaper migrate --views`: a view reads its tables with its owner\'s rights).',
  );
  for (const [table, grants] of targets) {
    lines.push(
      `REVOKE ALL ON ${q(table)} FROM ${migrator}, ${scheduler}, ${worker}, ${operator};`,
      `GRANT ${[...grants.scheduler].join(', ')} ON ${q(table)} TO ${scheduler};`,
      `GRANT ${[...grants.worker].join(', ')} ON ${q(table)} TO ${worker};`,
      `GRANT SELECT ON ${q(table)} TO ${migrator};`,
      `GRANT ${[...grants.operator].join(', ')} ON ${q(table)} TO ${operator};`,
    );
  }
  const retiring = [...policies.values()].filter((policy) => policy.kind === 'row-delete' && policy.partitions?.retire === true);
  if (retiring.length > 0) {
    lines.push(
      '',
      '-- partitions.retire (issue 44): DETACH PARTITION, ALTER TABLE ... SET SCHEMA, DROP TABLE and ATTACH',
      '-- PARTITION need the OWNER of the partitioned table (PostgreSQL has no grant for them). The',
      '-- scheduler (retires, drops after the quarantine) and the operator (`reaper restore --partition`)',
      '-- become members of the table\'s owner role: give each such table an owner role of its own, never',
      '-- a superuser (refused below: membership would let the service become the superuser).',
    );
    for (const table of new Set(retiring.map((policy) => policy.table))) {
      lines.push(
        `DO $$ DECLARE owner_name name; owner_super boolean; BEGIN`,
        `  SELECT r.rolname, r.rolsuper INTO owner_name, owner_super FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner WHERE c.oid = to_regclass(${literal(q(table))});`,
        `  IF owner_name IS NULL THEN RETURN; END IF;`,
        `  IF owner_super THEN RAISE EXCEPTION 'partitions.retire: table ${table.replace(/'/g, "''")} is owned by superuser %: give it an owner role of its own (ALTER TABLE ... OWNER TO <app role>), then run this again', owner_name; END IF;`,
        `  EXECUTE format('GRANT %I TO %I, %I', owner_name, ${literal(names.scheduler)}, ${literal(names.operator)});`,
        'END $$;',
      );
    }
  }
  lines.push('', 'COMMIT;', '');
  return lines.join('\n');
}

/**
 * One privilege a deployment role needs: `privilege` on `table` (on its `column` only, when given),
 * membership in `table` when privilege is 'MEMBER', or membership in the role that owns `table`
 * when privilege is 'OWNER' (partitions.retire: DETACH, ATTACH, SET SCHEMA and DROP need the owner).
 */
export interface NeededPrivilege {
  role: string;
  /** What the role is for (scheduler, worker, operator), for the message. */
  purpose: GranteeRole;
  table: string;
  privilege: DbPrivilege | 'MEMBER' | 'OWNER';
  column?: string;
  /** Why it is needed, for the message. */
  why: string;
}

/**
 * Everything the printed roles grant for these policies (REAPER_TABLE_GRANTS, targetGrants and
 * pg_read_all_stats), as a list `reaper doctor` checks one by one against the database.
 */
export function neededPrivileges(policies: PolicySet, names: Pick<DbRoleNames, GranteeRole>): NeededPrivilege[] {
  const needed: NeededPrivilege[] = [];
  for (const [table, grants] of Object.entries(REAPER_TABLE_GRANTS)) {
    for (const purpose of GRANTEES) {
      for (const granted of grants[purpose] ?? []) {
        const { privilege, columns } = privilegeColumns(granted);
        for (const column of columns ?? [undefined]) needed.push({ role: names[purpose], purpose, table, privilege, ...(column ? { column } : {}), why: `reaper's table ${table}` });
      }
    }
  }
  for (const [table, grants] of targetGrants(policies)) {
    for (const purpose of GRANTEES) {
      for (const privilege of grants[purpose]) needed.push({ role: names[purpose], purpose, table, privilege, why: `policy table ${table}` });
    }
  }
  const rowPolicies = [...policies.values()].filter((policy) => policy.kind === 'row-delete');
  if (rowPolicies.some((policy) => policy.brake !== undefined || policy.admission?.adaptive !== false)) {
    needed.push({ role: names.worker, purpose: 'worker', table: 'pg_read_all_stats', privilege: 'MEMBER', why: 'adaptive admission (the default) and the replica-lag brake read server statistics' });
  }
  if (rowPolicies.some((policy) => policy.brake !== undefined)) {
    needed.push({ role: names.operator, purpose: 'operator', table: 'pg_read_all_stats', privilege: 'MEMBER', why: '`reaper status` shows the standbys\' lag the brake reads' });
  }
  for (const table of new Set(rowPolicies.filter((policy) => policy.partitions?.retire === true).map((policy) => policy.table))) {
    needed.push({ role: names.scheduler, purpose: 'scheduler', table, privilege: 'OWNER', why: 'partitions.retire: DETACH, SET SCHEMA and DROP need the table\'s owner (the scheduler refuses to start without it)' });
    needed.push({ role: names.operator, purpose: 'operator', table, privilege: 'OWNER', why: 'partitions.retire: `reaper restore --partition` (SET SCHEMA, ATTACH) needs the table\'s owner' });
  }
  return needed;
}

/** Of `needed`, what the database does not grant now (a role that does not exist lacks everything). */
export async function privilegesMissing(
  db: Db,
  needed: readonly NeededPrivilege[],
): Promise<Array<NeededPrivilege & { roleExists: boolean; tableExists: boolean; owner: string | null }>> {
  if (needed.length === 0) return [];
  const result = await db.query<{ i: number; role_exists: boolean; table_exists: boolean; granted: boolean | null; owner: string | null }>(
    `SELECT n.i::int AS i, r.oid IS NOT NULL AS role_exists,
            (n.privilege = 'MEMBER' OR t.oid IS NOT NULL) AS table_exists,
            CASE WHEN n.privilege = 'OWNER' THEN pg_get_userbyid(c.relowner)::text END AS owner,
            CASE WHEN r.oid IS NULL THEN false
                 WHEN n.privilege = 'MEMBER' THEN pg_has_role(n.role, n.tbl, 'USAGE')
                 WHEN t.oid IS NULL THEN false
                 WHEN n.privilege = 'OWNER' THEN pg_has_role(n.role, c.relowner, 'USAGE')
                 WHEN n.col IS NOT NULL THEN has_column_privilege(n.role, t.oid, n.col, n.privilege)
                 ELSE has_table_privilege(n.role, t.oid, n.privilege) END AS granted
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS n(role, tbl, privilege, col, i)
     LEFT JOIN pg_roles r ON r.rolname = n.role
     LEFT JOIN LATERAL (SELECT CASE WHEN n.privilege = 'MEMBER' THEN NULL ELSE coalesce(to_regclass(quote_ident(n.tbl)), to_regclass(n.tbl)) END AS oid) t ON true
     LEFT JOIN pg_class c ON c.oid = t.oid
     ORDER BY n.i`,
    [needed.map((entry) => entry.role), needed.map((entry) => entry.table), needed.map((entry) => entry.privilege), needed.map((entry) => entry.column ?? null)],
  );
  return result.rows.filter((row) => !row.granted).map((row) => ({ ...needed[row.i - 1]!, roleExists: row.role_exists, tableExists: row.table_exists, owner: row.owner }));
}
