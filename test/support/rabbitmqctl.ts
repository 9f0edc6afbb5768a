import { execFile } from 'node:child_process';

/**
 * The local broker's admin tool, for what only it can do: stop and start the broker application,
 * its memory alarm (server-control.ts), a definitions import. Users, permissions, vhosts and
 * connections go through broker-admin.ts, which uses the management HTTP API when it answers:
 * every call here boots an Erlang VM (about 0.9 CPU-s). Every call is bounded.
 */
export function rabbitmqctl(args: readonly string[], timeoutMs = 60_000): Promise<string> {
  return new Promise((resolve, reject) =>
    execFile('rabbitmqctl', [...args], { timeout: timeoutMs }, (error, stdout, stderr) =>
      error ? reject(new Error(`rabbitmqctl ${args.join(' ')} failed: ${error.message} ${stderr}`)) : resolve(stdout),
    ),
  );
}

/**
 * Stops the broker application (every connection drops, queues stay on disk), runs `whileDown`,
 * and starts it again, waiting for `await_startup`, in a `finally`: a failing test never leaves
 * the broker down for the files after it. rabbitmqctl only: the management API stops with the
 * application and cannot start it.
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
