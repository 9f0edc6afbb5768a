import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { BROKER_ROLES, brokerPermissions, brokerUserName } from '../../shared/amqp/permissions';

/**
 * The local broker's admin tool, for fault tests that act on the broker itself (close a
 * connection, stop and start the broker). Only those tests need a local RabbitMQ; clean-up and
 * everything else go through AMQP. Every call is bounded.
 */
export function rabbitmqctl(args: readonly string[], timeoutMs = 60_000): Promise<string> {
  return new Promise((resolve, reject) =>
    execFile('rabbitmqctl', [...args], { timeout: timeoutMs }, (error, stdout, stderr) =>
      error ? reject(new Error(`rabbitmqctl ${args.join(' ')} failed: ${error.message} ${stderr}`)) : resolve(stdout),
    ),
  );
}

/**
 * The prefix's broker users (`<prefix>-scheduler`...), made on vhost "/" with the permissions
 * `reaper topology --definitions` grants (what `reaper doctor` checks); returns what removes them.
 */
export async function makeBrokerUsers(prefix: string): Promise<() => Promise<void>> {
  const permissions = brokerPermissions(prefix);
  const made: string[] = [];
  const removeAll = async () => {
    await Promise.all(made.map((user) => rabbitmqctl(['-q', 'delete_user', user]).catch(() => undefined))); // best effort: a leftover user holds nothing
  };
  try {
    await Promise.all(
      BROKER_ROLES.map(async (role) => {
        const user = brokerUserName(prefix, role);
        await rabbitmqctl(['-q', 'add_user', user, randomBytes(12).toString('hex')]);
        made.push(user);
        const { configure, write, read } = permissions[role];
        await rabbitmqctl(['-q', 'set_permissions', '-p', '/', user, configure, write, read]);
      }),
    );
  } catch (error) {
    await removeAll();
    throw error;
  }
  return removeAll;
}

/**
 * Stops the broker application (every connection drops, queues stay on disk), runs `whileDown`,
 * and starts it again, waiting for `await_startup`, in a `finally`: a failing test never leaves
 * the broker down for the files after it.
 */
export async function withBrokerStopped<T>(whileDown: () => Promise<T>): Promise<T> {
  await rabbitmqctl(['stop_app', '-q']);
  try {
    return await whileDown();
  } finally {
    await rabbitmqctl(['start_app', '-q']);
    await rabbitmqctl(['await_startup', '-q', '--timeout', '60'], 90_000);
  }
}
