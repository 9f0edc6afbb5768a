import { execFile } from 'node:child_process';
import { BROKER_ROLES, brokerPermissions, brokerUserName, type BrokerPermission } from '../../shared/amqp/permissions';
import { splitAmqpUrls } from '../../shared/amqp/connection';
import type { Env } from '../../shared/config/env';
import type { PolicySet } from '../../shared/config/policies';
import { describeWindow, parseTimeOfDay } from '../../shared/schedule/window';
import { firstTickInWindow } from '../scheduler/ticks';

/** One line of `reaper doctor`: what was checked, whether it holds, and what fixes it. */
export interface Finding {
  check: string;
  ok: boolean;
  detail: string;
  fix: string | null;
  /** Not checked (doctor could not ask, or the check cannot conclude): printed as such, never a failure. */
  skipped?: true;
}

/** A user's permissions on one vhost, as the broker lists them. */
type Listed = Map<string, BrokerPermission>;

/**
 * The broker permissions of each service's user for REAPER_AMQP_PREFIX (`<prefix>-scheduler`...),
 * compared with what `reaper topology --definitions` grants them (shared/amqp/permissions.ts).
 * AMQP cannot list permissions: the management API is asked (AMQP_URL's host and credentials, over
 * https on 15671 for amqps and http on 15672 for amqp: no weaker than the AMQP link itself), else
 * `rabbitmqctl list_permissions` on this machine. When neither answers (the operator's user has no
 * management tag, the API is off or fenced by a network policy), or a user of the expected name does
 * not exist (a deployment may name its users otherwise), the line says it was not checked: doctor
 * must not fail a correct deployment for what it cannot see.
 */
export async function brokerPermissionFindings(env: Pick<Env, 'amqpUrl' | 'amqpPrefix'>): Promise<Finding[]> {
  const url = new URL(splitAmqpUrls(env.amqpUrl)[0]!);
  const vhost = decodeURIComponent(url.pathname.replace(/^\//, '')) || '/';
  const asked: string[] = [];
  let listed: Listed | null = null;
  for (const ask of [askManagementApi, askRabbitmqctl]) {
    try {
      listed = await ask(url, vhost);
      break;
    } catch (error) {
      asked.push((error as Error).message);
    }
  }
  const expected = brokerPermissions(env.amqpPrefix);
  const setPermissions = (user: string, want: BrokerPermission) => `rabbitmqctl set_permissions -p '${vhost}' '${user}' '${want.configure}' '${want.write}' '${want.read}'`;
  if (!listed) {
    return [
      {
        check: 'broker permissions',
        ok: true,
        skipped: true,
        detail: `not checked: cannot ask the broker for its users' permissions (${asked.join('; ')})`,
        fix: `check them by hand against \`reaper topology --definitions\` (users ${BROKER_ROLES.map((role) => brokerUserName(env.amqpPrefix, role)).join(', ')}, vhost "${vhost}")`,
      },
    ];
  }
  const findings: Finding[] = [];
  for (const role of BROKER_ROLES) {
    const user = brokerUserName(env.amqpPrefix, role);
    const want = expected[role];
    const have = listed.get(user);
    if (!have) {
      findings.push({
        check: `broker user ${user}`,
        ok: true,
        skipped: true,
        detail: `not checked: no user "${user}" (${role}) holds permissions on vhost "${vhost}"; a deployment whose users are named otherwise is compared by hand`,
        fix: `if reaper's ${role} logs in as "${user}": create it (the deployment's users file) and run ${setPermissions(user, want)}`,
      });
      continue;
    }
    const differs = (['configure', 'write', 'read'] as const).filter((kind) => have[kind] !== want[kind]);
    if (differs.length > 0) {
      const what = differs.map((kind) => `${kind} "${have[kind]}" (expected "${want[kind]}")`).join(', ');
      findings.push({ check: `broker user ${user}`, ok: false, detail: `user "${user}" (${role}) on vhost "${vhost}": ${what}`, fix: setPermissions(user, want) });
    }
  }
  const checked = BROKER_ROLES.length - findings.filter((finding) => finding.skipped).length;
  if (checked > 0 && findings.every((finding) => finding.ok)) {
    findings.push({ check: 'broker permissions', ok: true, detail: `the ${checked} service user(s) found hold the permissions of \`reaper topology --definitions\` on vhost "${vhost}"`, fix: null });
  }
  return findings;
}

async function askManagementApi(url: URL, vhost: string): Promise<Listed> {
  // The same protection as the AMQP link that AMQP_URL already sends these credentials over.
  const secure = url.protocol === 'amqps:';
  const where = `${url.hostname}:${secure ? 15671 : 15672}`;
  const api = `${secure ? 'https' : 'http'}://${where}/api/vhosts/${encodeURIComponent(vhost)}/permissions`;
  const auth = `Basic ${Buffer.from(`${decodeURIComponent(url.username || 'guest')}:${decodeURIComponent(url.password || 'guest')}`).toString('base64')}`;
  let response: Response;
  try {
    response = await fetch(api, { headers: { authorization: auth }, signal: AbortSignal.timeout(3_000) });
  } catch (error) {
    throw new Error(`management API at ${where}: ${(error as Error).message}`);
  }
  if (!response.ok) throw new Error(`management API at ${where} answered ${response.status}${response.status === 401 ? ' (listing permissions needs a user with the management or administrator tag)' : ''}`);
  const rows = (await response.json()) as Array<{ user: string } & BrokerPermission>;
  return new Map(rows.map((row) => [row.user, { configure: row.configure, write: row.write, read: row.read }]));
}

function askRabbitmqctl(url: URL, vhost: string): Promise<Listed> {
  if (!['127.0.0.1', 'localhost', '::1', '[::1]'].includes(url.hostname)) return Promise.reject(new Error(`rabbitmqctl: the broker (${url.hostname}) is not on this machine`));
  return new Promise((resolve, reject) =>
    execFile('rabbitmqctl', ['-q', '--no-table-headers', 'list_permissions', '-p', vhost], { timeout: 30_000 }, (error, stdout, stderr) => {
      if (error) return reject(new Error(`rabbitmqctl list_permissions: ${(stderr || error.message).trim().split('\n')[0]}`));
      const listed: Listed = new Map();
      for (const line of stdout.split('\n')) {
        const [user, configure, write, read] = line.split('\t');
        if (user && configure !== undefined && write !== undefined && read !== undefined) listed.set(user, { configure, write, read });
      }
      resolve(listed);
    }),
  );
}

/** How far ahead a schedule is tried against its window: a week covers every weekday. */
const WINDOW_HORIZON_MS = 8 * 86_400_000;

/**
 * Whether a week of ticks decides: only when the schedule's day-of-month and month fields are `*`
 * (a schedule like "0 3 1 * *" fires once a month: a week without a tick inside the window says nothing).
 */
function weekDecides(schedule: string): boolean {
  const fields = schedule.trim().split(/\s+/);
  const [dayOfMonth, month] = (fields.length === 6 ? fields.slice(1) : fields).slice(2, 4);
  return dayOfMonth === '*' && month === '*';
}

/**
 * Windows that cannot work: a schedule with no tick inside its window in the coming week (every run
 * then waits for the catch-up at the opening), or a window shorter than one batch may take (the
 * statement timeout for a row-delete policy, the lease for a remote one), in which a batch started
 * at the opening cannot finish.
 */
export function windowFindings(policies: PolicySet, env: Pick<Env, 'sessionTimeouts'>, now: Date): Finding[] {
  const findings: Finding[] = [];
  let windows = 0;
  for (const policy of policies.values()) {
    const window = policy.window;
    if (!window) continue;
    windows += 1;
    const described = describeWindow(window);
    const tick = firstTickInWindow(policy.schedule, window, now, WINDOW_HORIZON_MS);
    if (!tick && !weekDecides(policy.schedule)) {
      findings.push({
        check: `window ${policy.name}`,
        ok: true,
        skipped: true,
        detail: `not checked: schedule "${policy.schedule}" (UTC) does not fire inside the window ${described} in the coming week, and its day-of-month or month field may make it fire inside later`,
        fix: null,
      });
    } else if (!tick) {
      findings.push({
        check: `window ${policy.name}`,
        ok: false,
        detail: `schedule "${policy.schedule}" (UTC) never fires inside the window ${described} in the coming week`,
        fix: `move the schedule into the window (cron is UTC), or widen the window`,
      });
    }
    const lengthMs = ((parseTimeOfDay(window.end)! - parseTimeOfDay(window.start)! + 86_400) % 86_400) * 1000;
    const batchMs = policy.kind === 'row-delete' ? env.sessionTimeouts.statementTimeoutMs : policy.leaseMs;
    const bound = policy.kind === 'row-delete' ? `REAPER_STATEMENT_TIMEOUT_MS ${batchMs} ms` : `leaseMs ${batchMs} ms`;
    if (lengthMs < batchMs) {
      findings.push({
        check: `window ${policy.name}`,
        ok: false,
        detail: `the window ${described} is open ${lengthMs / 1000} s, shorter than one batch may take (${bound}): a batch started at the opening may not finish`,
        fix: `widen the window to at least ${Math.ceil(batchMs / 60_000)} minute(s), or lower ${policy.kind === 'row-delete' ? 'REAPER_STATEMENT_TIMEOUT_MS' : 'the policy\'s leaseMs'}`,
      });
    }
  }
  if (windows > 0 && findings.length === 0) findings.push({ check: 'windows', ok: true, detail: `${windows} schedule window(s): each has a tick inside it and room for a batch`, fix: null });
  return findings;
}
