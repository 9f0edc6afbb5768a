import { randomBytes } from 'node:crypto';
import { BROKER_ROLES, brokerPermissions, brokerUserName, type BrokerPermission } from '../../shared/amqp/permissions';
import { rabbitmqctl } from './rabbitmqctl';
import { findServers } from './servers';

/**
 * The test broker's administration (users, permissions, vhosts, connections) for the tests that
 * act on the broker itself: through the management HTTP API when it answers, else `rabbitmqctl`,
 * which boots an Erlang VM for every call (about 0.9 CPU-s each; some 60 CPU-s of a whole `npm
 * test`, issue 43). `.ci/run` enables the management plugin; a plain `npm test` on a fresh machine
 * may not have it, and gets rabbitmqctl (which speaks to this machine's node). The choice is made
 * once per process. REAPER_TEST_MANAGEMENT_PORT moves the API's port (15672): a port where nothing
 * listens makes every file take the rabbitmqctl path.
 *
 * Each operation leaves the broker as the rabbitmqctl command named beside it does: users without
 * tags, the same permission patterns, connections closed by the broker with the reason given.
 */
export interface BrokerAdmin {
  /** 'management API' or 'rabbitmqctl': the path this process took. */
  readonly via: string;
  /** add_user: a user with this password and no tags (so no management API access). */
  addUser(user: string, password: string): Promise<void>;
  deleteUser(user: string): Promise<void>;
  setPermissions(vhost: string, user: string, permission: BrokerPermission): Promise<void>;
  clearPermissions(vhost: string, user: string): Promise<void>;
  addVhost(vhost: string): Promise<void>;
  deleteVhost(vhost: string): Promise<void>;
  /** The broker's client connections now, each with the id closeConnection takes. */
  listConnections(): Promise<BrokerConnection[]>;
  /** close_connection: the broker closes it (connection.close, CONNECTION_FORCED, with `reason`). */
  closeConnection(id: string, reason: string): Promise<void>;
  /** Returns once the broker application runs (a serial file may have restarted it just before). */
  awaitRunning(): Promise<void>;
}

export interface BrokerConnection {
  /** What closeConnection takes: the management API's connection name, or rabbitmqctl's <pid>. */
  id: string;
  /** client_properties.connection_name ('' when the client gave none). */
  name: string;
}

/** A management HTTP API that answered, as the AMQP URL's user (guest/guest when it names none). */
export interface ManagementApi {
  /** That user, and its tags: administration needs "administrator". */
  user: string;
  tags: string[];
  /** One request to /api/<path>: the JSON answer (undefined for none); a status other than 2xx throws. */
  request(method: string, path: string, options?: { body?: unknown; headers?: Record<string, string>; timeoutMs?: number; notFoundIsFine?: boolean }): Promise<unknown>;
}

const probes = new Map<string, Promise<ManagementApi | undefined>>();

/** The management API beside the broker at `amqpUrl`, asked once per process (GET /api/whoami); undefined when it does not answer. */
export function managementApi(amqpUrl: string): Promise<ManagementApi | undefined> {
  const url = new URL(amqpUrl);
  const credentials = `${decodeURIComponent(url.username || 'guest')}:${decodeURIComponent(url.password || 'guest')}`;
  const base = `http://${url.hostname}:${process.env.REAPER_TEST_MANAGEMENT_PORT || 15672}/api/`;
  const key = `${credentials}@${base}`;
  let probe = probes.get(key);
  if (!probe) {
    probe = probeApi(base, `Basic ${Buffer.from(credentials).toString('base64')}`);
    probes.set(key, probe);
  }
  return probe;
}

async function probeApi(base: string, authorization: string): Promise<ManagementApi | undefined> {
  const request: ManagementApi['request'] = async (method, path, { body, headers, timeoutMs = 10_000, notFoundIsFine = false } = {}) => {
    const response = await fetch(`${base}${path}`, {
      method,
      headers: { authorization, ...(body === undefined ? {} : { 'content-type': 'application/json' }), ...headers },
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(timeoutMs),
    });
    const text = await response.text();
    if (response.status === 404 && notFoundIsFine) return undefined;
    if (!response.ok) throw new Error(`management API ${method} /api/${path}: ${response.status} ${text}`);
    return text ? JSON.parse(text) : undefined;
  };
  try {
    const { name, tags } = (await request('GET', 'whoami', { timeoutMs: 3_000 })) as { name: string; tags: string[] | string };
    return { user: name, tags: typeof tags === 'string' ? tags.split(',').filter(Boolean) : tags, request };
  } catch {
    return undefined; // no management plugin there (or this user may not use it)
  }
}

let chosen: Promise<BrokerAdmin> | undefined;

/** The test broker's administration: the management API when it answers to an administrator, else rabbitmqctl. */
export function brokerAdmin(): Promise<BrokerAdmin> {
  chosen ??= (async () => {
    const api = await managementApi((await findServers()).amqpUrl);
    return api?.tags.includes('administrator') ? overApi(api) : withRabbitmqctl;
  })().catch((error: unknown) => {
    chosen = undefined; // servers not found this time: the next call asks again rather than failing for good
    throw error;
  });
  return chosen;
}

const at = (...names: string[]) => names.map(encodeURIComponent).join('/');

function overApi(api: ManagementApi): BrokerAdmin {
  return {
    via: 'management API',
    addUser: async (user, password) => void (await api.request('PUT', `users/${at(user)}`, { body: { password, tags: '' } })),
    deleteUser: async (user) => void (await api.request('DELETE', `users/${at(user)}`)),
    setPermissions: async (vhost, user, { configure, write, read }) => void (await api.request('PUT', `permissions/${at(vhost, user)}`, { body: { configure, write, read } })),
    clearPermissions: async (vhost, user) => void (await api.request('DELETE', `permissions/${at(vhost, user)}`)),
    async addVhost(vhost) {
      // Up to 45 s: RabbitMQ gives a new vhost that long to start on every node.
      await api.request('PUT', `vhosts/${at(vhost)}`, { timeoutMs: 45_000 });
      // The API grants the user who made the vhost full permissions on it; add_vhost grants none.
      // If that cannot be undone, the vhost is not left behind with the grant.
      await api.request('DELETE', `permissions/${at(vhost, api.user)}`).catch(async (error: unknown) => {
        await api.request('DELETE', `vhosts/${at(vhost)}`, { timeoutMs: 45_000 }).catch(() => undefined);
        throw error;
      });
    },
    // A vhost already gone is not an error: a clean-up after a half-made vhost deletes what is there.
    deleteVhost: async (vhost) => void (await api.request('DELETE', `vhosts/${at(vhost)}`, { timeoutMs: 45_000, notFoundIsFine: true })),
    async listConnections() {
      const listed = (await api.request('GET', 'connections?columns=name,client_properties')) as Array<{ name: string; client_properties?: { connection_name?: string } }>;
      return listed.map((entry) => ({ id: entry.name, name: entry.client_properties?.connection_name ?? '' }));
    },
    // rabbit_mgmt_wm_connection closes an AMQP 0-9-1 connection as close_connection does (rabbit_networking:close_connection).
    closeConnection: async (id, reason) => void (await api.request('DELETE', `connections/${at(id)}`, { headers: { 'x-reason': reason } })),
    async awaitRunning() {
      try {
        await api.request('GET', 'overview'); // the API is a plugin of the broker application: it answers only while that runs
      } catch {
        await withRabbitmqctl.awaitRunning(); // starting (or restarting): rabbitmqctl waits for it
      }
    },
  };
}

const withRabbitmqctl: BrokerAdmin = {
  via: 'rabbitmqctl',
  addUser: async (user, password) => void (await rabbitmqctl(['-q', 'add_user', user, password])),
  deleteUser: async (user) => void (await rabbitmqctl(['-q', 'delete_user', user])),
  setPermissions: async (vhost, user, { configure, write, read }) => void (await rabbitmqctl(['-q', 'set_permissions', '-p', vhost, user, configure, write, read])),
  clearPermissions: async (vhost, user) => void (await rabbitmqctl(['-q', 'clear_permissions', '-p', vhost, user])),
  addVhost: async (vhost) => void (await rabbitmqctl(['-q', 'add_vhost', vhost])),
  deleteVhost: async (vhost) => void (await rabbitmqctl(['-q', 'delete_vhost', vhost])),
  /**
   * The table output is read rather than `--formatter json`: the JSON formatter prints pids as
   * #PID<...>, which close_connection refuses. Each line is `<pid>\t[{"connection_name","..."},...]`.
   */
  async listConnections() {
    const stdout = await rabbitmqctl(['list_connections', 'pid', 'client_properties', '-q', '--no-table-headers']);
    return stdout
      .split('\n')
      .map((line) => ({ id: line.split('\t')[0]!.trim(), name: /\{"connection_name","([^"]*)"\}/.exec(line)?.[1] ?? '' }))
      .filter((connection) => connection.id.startsWith('<'));
  },
  closeConnection: async (id, reason) => void (await rabbitmqctl(['close_connection', id, reason, '-q'])),
  awaitRunning: async () => void (await rabbitmqctl(['-q', 'await_startup', '--timeout', '120'], 130_000)),
};

/**
 * The prefix's broker users (`<prefix>-scheduler`...), made on vhost "/" with the permissions
 * `reaper topology --definitions` grants (what `reaper doctor` checks); returns what removes them.
 */
export async function makeBrokerUsers(prefix: string): Promise<() => Promise<void>> {
  const admin = await brokerAdmin();
  const permissions = brokerPermissions(prefix);
  const made: string[] = [];
  const removeAll = async () => {
    await Promise.all(made.map((user) => admin.deleteUser(user).catch(() => undefined))); // best effort: a leftover user holds nothing
  };
  // Every role's calls settle before a failure is thrown: removeAll must see every user that was made.
  try {
    await allOrFirstFailure(
      BROKER_ROLES.map(async (role) => {
        const user = brokerUserName(prefix, role);
        await admin.addUser(user, randomBytes(12).toString('hex'));
        made.push(user);
        await admin.setPermissions('/', user, permissions[role]);
      }),
    );
  } catch (error) {
    await removeAll();
    throw error;
  }
  return removeAll;
}

/** Waits for every one of `work`, then throws the first failure if any (so a clean-up after it sees all that was made). */
export async function allOrFirstFailure(work: Array<Promise<unknown>>): Promise<void> {
  const failed = (await Promise.allSettled(work)).find((result): result is PromiseRejectedResult => result.status === 'rejected');
  if (failed) throw failed.reason;
}
