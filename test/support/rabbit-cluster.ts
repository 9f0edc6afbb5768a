import { spawn, execFile, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { chmodSync, chownSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir, userInfo } from 'node:os';
import path from 'node:path';

/**
 * A three-node RabbitMQ cluster on this one machine, for the cluster test (issue 10). The machine's
 * own broker (rabbit@localhost, 5672) is left alone: each extra node has its own node name, AMQP
 * and distribution ports, data, log and pid locations under a temporary folder, an empty plugins
 * file and a config naming only its own listener. Nodes run RabbitMQ 3.10's server script as the
 * `rabbitmq` user, so they share its Erlang cookie (and `rabbitmqctl -n <node>` reaches them).
 * Nodes 2 and 3 join node 1 with `rabbitmqctl join_cluster`. `stop()` stops every node and removes
 * the folder; it is safe to call after a failure half-way.
 */
export interface ClusterNode {
  name: string;
  amqpPort: number;
  amqpUrl: string;
}

const RABBITMQ_SERVER = '/usr/lib/rabbitmq/bin/rabbitmq-server';

function run(command: string, args: readonly string[], timeoutMs = 120_000): Promise<string> {
  return new Promise((resolve, reject) =>
    execFile(command, [...args], { timeout: timeoutMs }, (error, stdout, stderr) =>
      error ? reject(new Error(`${command} ${args.join(' ')} failed: ${error.message} ${stderr}`)) : resolve(stdout),
    ),
  );
}

export function nodeCtl(node: string, args: readonly string[], timeoutMs = 120_000): Promise<string> {
  return run('rabbitmqctl', ['-n', node, ...args], timeoutMs);
}

export class RabbitCluster {
  private readonly processes: ChildProcess[] = [];
  private constructor(
    readonly nodes: ClusterNode[],
    private readonly folder: string,
  ) {}

  /** Boots three nodes (in parallel) and clusters them. `log` receives progress lines. */
  static async start(log: (line: string) => void = () => undefined): Promise<RabbitCluster> {
    const suffix = randomBytes(3).toString('hex');
    const folder = mkdtempSync(path.join(tmpdir(), 'reaper-cluster-'));
    // Ports from a range nothing else here uses; a suffix-derived offset keeps two runs apart.
    const base = 21_000 + (parseInt(suffix, 16) % 400) * 10;
    const nodes: ClusterNode[] = [1, 2, 3].map((i) => ({
      name: `reaper-c${i}-${suffix}@localhost`,
      amqpPort: base + i,
      amqpUrl: `amqp://guest:guest@127.0.0.1:${base + i}`,
    }));
    const cluster = new RabbitCluster(nodes, folder);
    try {
      const rabbitmq = await run('id', ['-u', 'rabbitmq']).then((out) => Number(out.trim()));
      const group = await run('id', ['-g', 'rabbitmq']).then((out) => Number(out.trim()));
      if (userInfo().uid === 0) chownSync(folder, rabbitmq, group);
      chmodSync(folder, 0o755);
      const plugins = path.join(folder, 'enabled_plugins');
      writeFileSync(plugins, '[].\n');
      const emptyEnv = path.join(folder, 'rabbitmq-env.conf');
      writeFileSync(emptyEnv, '');
      nodes.forEach((node, index) => {
        const dir = path.join(folder, `node${index + 1}`);
        mkdirSync(dir);
        for (const sub of ['mnesia', 'log']) mkdirSync(path.join(dir, sub));
        // Only this node's listener (the machine's rabbitmq.conf names 5672, which is taken).
        writeFileSync(path.join(dir, 'rabbitmq.conf'), `listeners.tcp.local = 127.0.0.1:${node.amqpPort}\nloopback_users = none\n`);
        if (userInfo().uid === 0) for (const entry of ['', 'mnesia', 'log', 'rabbitmq.conf']) chownSync(path.join(dir, entry), rabbitmq, group);
        const env: Record<string, string> = {
          PATH: process.env.PATH ?? '/usr/bin:/bin',
          HOME: '/var/lib/rabbitmq', // the rabbitmq user's cookie, shared by every node and rabbitmqctl
          RABBITMQ_NODENAME: node.name,
          RABBITMQ_NODE_PORT: String(node.amqpPort),
          RABBITMQ_DIST_PORT: String(node.amqpPort + 10_000),
          RABBITMQ_MNESIA_BASE: path.join(dir, 'mnesia'),
          RABBITMQ_LOG_BASE: path.join(dir, 'log'),
          RABBITMQ_PID_FILE: path.join(dir, 'rabbit.pid'),
          RABBITMQ_ENABLED_PLUGINS_FILE: plugins,
          RABBITMQ_CONFIG_FILE: path.join(dir, 'rabbitmq.conf'),
          RABBITMQ_CONF_ENV_FILE: emptyEnv,
          ERL_EPMD_ADDRESS: '127.0.0.1',
        };
        const args = Object.entries(env).map(([key, value]) => `${key}=${value}`);
        const child =
          userInfo().uid === 0
            ? spawn('runuser', ['-u', 'rabbitmq', '--', 'env', '-i', ...args, RABBITMQ_SERVER], { stdio: 'ignore', detached: false })
            : spawn(RABBITMQ_SERVER, [], { env, stdio: 'ignore' });
        cluster.processes.push(child);
      });
      const bootStarted = Date.now();
      // `wait <pid file>`: waits for the node to write its pid and boot (await_startup fails at once
      // while the node is not yet registered with epmd).
      await Promise.all(nodes.map((node, index) => nodeCtl(node.name, ['wait', path.join(folder, `node${index + 1}`, 'rabbit.pid'), '-q', '--timeout', '150'], 180_000)));
      log(`cluster: 3 nodes booted in ${((Date.now() - bootStarted) / 1000).toFixed(1)} s`);
      for (const node of nodes.slice(1)) {
        await nodeCtl(node.name, ['stop_app', '-q']);
        await nodeCtl(node.name, ['join_cluster', nodes[0]!.name, '-q']);
        await nodeCtl(node.name, ['start_app', '-q']);
        await nodeCtl(node.name, ['await_startup', '-q', '--timeout', '120'], 150_000);
      }
      const status = await nodeCtl(nodes[0]!.name, ['cluster_status', '--formatter', 'json', '-q']);
      const running = (JSON.parse(status) as { running_nodes?: string[] }).running_nodes ?? [];
      if (running.length !== 3) throw new Error(`cluster has ${running.length} running nodes: ${status}`);
      log(`cluster: joined (${nodes.map((n) => `${n.name}:${n.amqpPort}`).join(', ')})`);
      return cluster;
    } catch (error) {
      await cluster.stop();
      throw error;
    }
  }

  /** The node that leads a quorum queue now (its Raft leader). */
  async leaderOf(queue: string, askNode = this.nodes[0]!.name): Promise<string> {
    const out = await nodeCtl(askNode, ['list_queues', 'name', 'leader', '--formatter', 'json', '-q']);
    const row = (JSON.parse(out) as Array<{ name: string; leader: string }>).find((q) => q.name === queue);
    if (!row) throw new Error(`queue ${queue} not found on ${askNode}`);
    return row.leader;
  }

  /** Members (replicas) of a quorum queue. */
  async membersOf(queue: string, askNode = this.nodes[0]!.name): Promise<string[]> {
    const out = await nodeCtl(askNode, ['list_queues', 'name', 'members', '--formatter', 'json', '-q']);
    const row = (JSON.parse(out) as Array<{ name: string; members: string[] }>).find((q) => q.name === queue);
    return row?.members ?? [];
  }

  async stopApp(node: string): Promise<void> {
    await nodeCtl(node, ['stop_app', '-q']);
  }

  async startApp(node: string): Promise<void> {
    await nodeCtl(node, ['start_app', '-q']);
    await nodeCtl(node, ['await_startup', '-q', '--timeout', '120'], 150_000);
  }

  /** Stops every node (the Erlang VMs) and removes the folder. Never throws. */
  async stop(): Promise<void> {
    await Promise.all(this.nodes.map((node) => nodeCtl(node.name, ['stop', '-q'], 60_000).catch(() => undefined)));
    for (const child of this.processes) if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    rmSync(this.folder, { recursive: true, force: true });
  }
}
