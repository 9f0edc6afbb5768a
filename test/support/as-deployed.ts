import type { DbRoleNames } from '../../shared/db/queries/roles';

/**
 * Names shared by an as-deployed test bed (testbed.ts `asDeployed`) and the process starter
 * (processes.ts startReaper): kept apart so neither module imports the other.
 */

/** The environment variable that carries an as-deployed bed's role names to startReaper (test support only). */
export const AS_DEPLOYED_ROLES_VARIABLE = 'REAPER_TEST_DB_ROLES';
/** A reaper process of an as-deployed bed that must log in as the superuser names the reason here. */
export const SUPERUSER_REASON_VARIABLE = 'REAPER_TEST_SUPERUSER_BECAUSE';

/** What startReaper reads from AS_DEPLOYED_ROLES_VARIABLE. */
export interface AsDeployedRoles {
  /** The bed's login: a DATABASE_URL with this user is replaced by the command's role. */
  superuser: string;
  roles: DbRoleNames;
}

