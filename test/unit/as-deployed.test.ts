import assert from 'node:assert/strict';
import { test } from 'node:test';
import { AS_DEPLOYED_ROLES_VARIABLE, SUPERUSER_REASON_VARIABLE, type AsDeployedRoles } from '../support/as-deployed';
import { asDeployedEnv, startReaper } from '../support/processes';

/**
 * The suite's "as deployed" rule (issue 40 item 1): a reaper process a test starts logs in as the
 * role `reaper roles --print` gives its command, or says why it must be the superuser; one given
 * a database and neither is refused before it starts.
 */
const deployed: AsDeployedRoles = {
  superuser: 'postgres',
  roles: { migrator: 'm_role', scheduler: 's_role', worker: 'w_role', operator: 'o_role' },
};
const bedEnv = (extra: Record<string, string> = {}): NodeJS.ProcessEnv => ({
  DATABASE_URL: 'postgres://postgres@127.0.0.1:5432/some_db',
  [AS_DEPLOYED_ROLES_VARIABLE]: JSON.stringify(deployed),
  ...extra,
});
const userOf = (env: NodeJS.ProcessEnv) => new URL(env.DATABASE_URL!).username;

test('each command logs in as its role; the bed variable does not reach the process', () => {
  for (const [command, role] of [
    ['scheduler', 's_role'],
    ['relay', 's_role'],
    ['worker', 'w_role'],
    ['migrate', 'm_role'],
    ['status', 'o_role'],
    ['trigger', 'o_role'],
    ['restore', 'o_role'],
    ['doctor', 'o_role'],
  ] as const) {
    const env = asDeployedEnv([command], bedEnv());
    assert.equal(userOf(env), role, command);
    assert.equal(env[AS_DEPLOYED_ROLES_VARIABLE], undefined, `${command}: the roles variable is the test's, not the process's`);
  }
  assert.equal(new URL(asDeployedEnv(['worker'], bedEnv()).DATABASE_URL!).host, '127.0.0.1:5432', 'only the user changes (a proxy keeps its host and port)');
});

test('a command without a role of its own, a URL naming another user, or a stated reason keeps its URL', () => {
  assert.equal(userOf(asDeployedEnv(['roles', '--print'], bedEnv())), 'postgres');
  assert.equal(userOf(asDeployedEnv(['worker'], bedEnv({ DATABASE_URL: 'postgres://chosen_role@127.0.0.1/db' }))), 'chosen_role');
  assert.equal(userOf(asDeployedEnv(['worker'], bedEnv({ [SUPERUSER_REASON_VARIABLE]: 'terminates other backends' }))), 'postgres');
});

test('a reaper service given a database that is no test bed\'s, and no reason, is refused before it starts', () => {
  assert.throws(
    () => startReaper('stray-worker', ['worker'], { DATABASE_URL: 'postgres://postgres@127.0.0.1:5432/some_db' }),
    new RegExp(`not a test bed's .*${SUPERUSER_REASON_VARIABLE}`),
  );
});
