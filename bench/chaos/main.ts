/**
 * reaper's chaos run (issue 10): a scheduler, three workers and the stand-in media API under a
 * load generator, with faults injected at random, then the checker.
 *
 *   npm run chaos                       5 minutes, a fresh seed
 *   npm run chaos -- --minutes 2        (what .ci/run runs)
 *   npm run chaos -- --seed 1234        replays a run's fault schedule (times, kinds, targets)
 *   add --no-server-faults              leaves the machine's PostgreSQL and broker alone (no
 *                                       restart, no memory alarm; everything else still happens)
 *
 * A tool, not a test: it runs for minutes, prints as it goes and writes its figures to
 * bench/results/<date>-chaos-<seed>.json, like the benchmark beside it. It reuses the suite's
 * support code (own database and broker prefix, TCP proxy, stand-in API, the checker).
 *
 * Load (every 250 ms): holds on seats (row-delete, expiring within seconds), some renewed or
 * confirmed (also after expiry: the conditional DELETE must lose that race cleanly), some placed
 * under a legal hold while still unexpired; media assets (remote-delete) likewise, renewed or held
 * while unexpired. Both policies run every 10 s.
 *
 * Expiry events are on for both policies and `reaper relay` runs beside them; a consumer's queue
 * bound to `<prefix>.events` collects what it publishes, and the checker's `events` column counts
 * deletions whose event never arrived and events for no deletion.
 *
 * Faults (one every 6-15 s, chosen by the seed): worker, scheduler or relay SIGKILLed (and started
 * again), a worker SIGSTOPped past its lease, PostgreSQL restarted (immediate), a worker's
 * backend terminated, PostgreSQL or broker links reset, stalled for a few seconds, slowed by
 * latency, a 429 storm from the API, the broker closing the services' connections, the broker's
 * memory alarm. Each is undone (and servers awaited) before the next; the end undoes all.
 *
 * Then it settles (load stopped, one more run of each policy, the remote ledger drained), stops
 * the services (each must exit 0) and prints the checker table. Exit 1 on any violation.
 */
import { randomInt } from 'node:crypto';
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { parseArgs } from 'node:util';
import amqp from 'amqplib';
import { brokerNames } from '../../shared/amqp/topology';
import { outboxEventCount } from '../../shared/db/queries/outbox';
import { openTestBroker } from '../../test/support/broker';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { runReaperCli, startReaper, type ReaperProcess } from '../../test/support/processes';
import { prng } from '../../test/support/prng';
import { rabbitmqctl } from '../../test/support/rabbitmqctl';
import { eventViolations, formatChecker, measureRecovery, runChecker, type Recovery } from '../../test/support/run-checks';
import { ensurePostgresUp, restartPostgresImmediately, restoreMemoryWatermark, setMemoryWatermark } from '../../test/support/server-control';
import { TcpProxy } from '../../test/support/tcp-proxy';
import { makeTestBed, type TestBed } from '../../test/support/testbed';

const ROWS = 'chaos-holds';
const ASSETS = 'chaos-assets';
const RESULTS_DIR = path.resolve(__dirname, '..', '..', '..', 'bench', 'results');

type FaultKind =
  | 'sigkill-worker'
  | 'sigkill-scheduler'
  | 'sigkill-relay'
  | 'sigstop-worker'
  | 'pg-restart'
  | 'backend-terminated'
  | 'pg-link-reset'
  | 'amqp-link-reset'
  | 'pg-link-stalled'
  | 'amqp-link-stalled'
  | 'latency'
  | '429-storm'
  | 'broker-connections-closed'
  | 'broker-memory-alarm';

/** Relative weights; the two that disturb the whole machine are rarer and spaced (SERVER_FAULT_GAP_MS). */
const WEIGHTS: Record<FaultKind, number> = {
  'sigkill-worker': 3,
  'sigkill-scheduler': 1,
  'sigkill-relay': 2,
  'sigstop-worker': 2,
  'pg-restart': 1,
  'backend-terminated': 3,
  'pg-link-reset': 3,
  'amqp-link-reset': 3,
  'pg-link-stalled': 2,
  'amqp-link-stalled': 2,
  latency: 2,
  '429-storm': 2,
  'broker-connections-closed': 2,
  'broker-memory-alarm': 1,
};
const SERVER_FAULTS = new Set<FaultKind>(['pg-restart', 'broker-memory-alarm']);
const SERVER_FAULT_GAP_MS = 90_000;

/** Settings that make every fault detectable within seconds (documented in docs/testing.md "Reliability"). */
const HEARTBEAT_S = 2;
const STATEMENT_TIMEOUT_MS = 3_000;
const REMOTE_LEASE_MS = 12_000; // the least a 2 s remote timeout allows (timeout + 10 s)

interface FaultRecord {
  at: number;
  kind: FaultKind;
  target: string;
  durationMs: number;
  recoveryMs: number | null;
}

interface Options {
  minutes: number;
  seed: number;
  serverFaults: boolean;
}

function parseOptions(): Options {
  const { values } = parseArgs({
    options: { minutes: { type: 'string', default: '5' }, seed: { type: 'string' }, 'no-server-faults': { type: 'boolean', default: false } },
  });
  const minutes = Number(values.minutes);
  if (!Number.isFinite(minutes) || minutes <= 0) throw new Error(`--minutes must be a positive number (got ${values.minutes})`);
  const seed = values.seed === undefined ? randomInt(1, 2 ** 31 - 1) : Number(values.seed);
  if (!Number.isInteger(seed)) throw new Error(`--seed must be an integer (got ${values.seed})`);
  return { minutes, seed, serverFaults: !values['no-server-faults'] };
}

function policiesYaml(apiUrl: string): string {
  return `policies:
  - name: ${ROWS}
    kind: row-delete
    schedule: "*/10 * * * * *"
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
    guard: { status: held }
    batchSize: 50
    audit: { enabled: true }
    events: { enabled: true }
  - name: ${ASSETS}
    kind: remote-delete
    schedule: "5-59/10 * * * * *"
    table: media_assets
    key: asset_id
    expiresAt: retention_expires_at
    guard: { status: active }
    markConfirmed: { status: deleted }
    batchSize: 10
    remote:
      baseUrl: ${apiUrl}
      path: /assets/{id}
      timeoutMs: 2000
    admission: { ratePerSecond: 40, burst: 20, concurrency: 8 }
    retry: { maxAttempts: 1000 }
    leaseMs: ${REMOTE_LEASE_MS}
    events: { enabled: true }
`;
}

/** The services, restarted under the same label after a SIGKILL. */
class Services {
  readonly all = new Map<string, ReaperProcess>();
  /** Exits nobody asked for (a violation: services must survive every fault here). */
  readonly unexpectedExits: string[] = [];
  private readonly expectedExit = new Set<ReaperProcess>();

  constructor(private readonly start: (label: string) => ReaperProcess) {}

  launch(label: string): ReaperProcess {
    const process = this.start(label);
    this.all.set(label, process);
    void process.exited.then((exit) => {
      if (!this.expectedExit.has(process)) this.unexpectedExits.push(`${label}: ${JSON.stringify(exit)} ${process.output.slice(-3).join(' | ')}`);
    });
    return process;
  }

  async kill(label: string): Promise<void> {
    const process = this.all.get(label)!;
    this.expectedExit.add(process);
    process.signal('SIGKILL');
    await process.exited;
  }

  get(label: string): ReaperProcess {
    return this.all.get(label)!;
  }

  /** SIGTERM each; each must drain and exit 0. */
  async stopAll(): Promise<string[]> {
    const problems: string[] = [];
    await Promise.all(
      [...this.all.values()].map(async (process) => {
        this.expectedExit.add(process);
        process.signal('SIGCONT');
        const exit = await process.stop(30_000);
        if (exit.code !== 0) problems.push(`${process.label} exited ${JSON.stringify(exit)}: ${process.output.slice(-3).join(' | ')}`);
      }),
    );
    return problems;
  }
}

/** The load generator: what it created, and what must survive (id -> why). */
class Load {
  rowsCreated = 0;
  assetsCreated = 0;
  readonly protectedRows = new Map<string, string>();
  readonly protectedAssets = new Map<string, string>();
  readonly counts = { renewed: 0, confirmed: 0, rowHolds: 0, assetRenewals: 0, assetHolds: 0 };
  private assetSeq = 0;
  private recentRows: string[] = [];
  private recentAssets: string[] = [];

  constructor(
    private readonly bed: TestBed,
    private readonly random: () => number,
  ) {}

  /** One tick; every statement is its own transaction, and a failed one (database restarting) is skipped. */
  async tick(): Promise<void> {
    const pool = this.bed.pool;
    const rand = this.random;
    const attempt = async <T>(work: () => Promise<T>): Promise<T | undefined> => work().catch(() => undefined);
    // 40 holds on seats, expiring between 3 s ago and 8 s from now.
    const rows = await attempt(() =>
      pool.query<{ id: string }>(
        `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat)
         SELECT gen_random_uuid(), 'held', clock_timestamp() + (random() * 11 - 3) * interval '1 second', 'chaos' FROM generate_series(1, 40)
         RETURNING reservation_id::text AS id`,
      ),
    );
    if (rows) {
      this.rowsCreated += rows.rowCount ?? 0;
      this.recentRows = [...this.recentRows, ...rows.rows.map((r) => r.id)].slice(-400);
    }
    // Renew or confirm a few (expired or not: the row lock decides against a DELETE in flight).
    for (let i = 0; i < 3; i++) {
      const id = this.recentRows[Math.floor(rand() * this.recentRows.length)];
      if (!id || this.protectedRows.has(id)) continue;
      const confirm = rand() < 0.5;
      const changed = await attempt(() =>
        pool.query(
          confirm
            ? `UPDATE seat_reservations SET status = 'confirmed', updated_at = now() WHERE reservation_id = $1 AND status = 'held'`
            : `UPDATE seat_reservations SET expires_at = clock_timestamp() + interval '1 day', updated_at = now() WHERE reservation_id = $1 AND status = 'held'`,
          [id],
        ),
      );
      if (changed?.rowCount === 1) {
        this.protectedRows.set(id, confirm ? 'confirmed' : 'renewed');
        this.counts[confirm ? 'confirmed' : 'renewed'] += 1;
      }
    }
    // A legal hold on a row still 2 s from expiry (no DELETE can be in flight for it).
    {
      const id = this.recentRows[Math.floor(rand() * this.recentRows.length)];
      if (id && !this.protectedRows.has(id)) {
        const held = await attempt(() =>
          pool.query(
            `INSERT INTO cleanup_holds (policy, key, reason, created_by)
             SELECT $1, reservation_id::text, 'chaos: litigation', 'chaos' FROM seat_reservations
             WHERE reservation_id = $2 AND status = 'held' AND expires_at > clock_timestamp() + interval '2 seconds'
             ON CONFLICT DO NOTHING`,
            [ROWS, id],
          ),
        );
        if (held?.rowCount === 1) {
          this.protectedRows.set(id, 'legal hold');
          this.counts.rowHolds += 1;
        }
      }
    }
    // 4 assets, expiring between 3 s ago and 8 s from now.
    const first = this.assetSeq + 1;
    this.assetSeq += 4;
    const assets = await attempt(() =>
      pool.query<{ id: string }>(
        `INSERT INTO media_assets (asset_id, status, retention_expires_at, url, metadata)
         SELECT 'chaos-' || i, 'active', clock_timestamp() + (random() * 11 - 3) * interval '1 second', 'https://media.example/' || i, '{}'::jsonb
         FROM generate_series($1::int, $2::int) i RETURNING asset_id AS id`,
        [first, this.assetSeq],
      ),
    );
    if (assets) {
      this.assetsCreated += assets.rowCount ?? 0;
      this.recentAssets = [...this.recentAssets, ...assets.rows.map((r) => r.id)].slice(-100);
    }
    // Assets are protected only while unexpired (a call already in flight would otherwise be a legitimate race).
    if (rand() < 0.5) {
      const id = this.recentAssets[Math.floor(rand() * this.recentAssets.length)];
      if (id && !this.protectedAssets.has(id)) {
        const hold = rand() < 0.5;
        const done = await attempt(() =>
          pool.query(
            hold
              ? `INSERT INTO cleanup_holds (policy, key, reason, created_by)
                 SELECT $1, asset_id, 'chaos: litigation', 'chaos' FROM media_assets
                 WHERE asset_id = $2 AND status = 'active' AND retention_expires_at > clock_timestamp() + interval '2 seconds' ON CONFLICT DO NOTHING`
              : `UPDATE media_assets SET retention_expires_at = clock_timestamp() + interval '1 day', updated_at = now()
                 WHERE $1::text IS NOT NULL AND asset_id = $2 AND status = 'active' AND retention_expires_at > clock_timestamp() + interval '2 seconds'`,
            [ASSETS, id],
          ),
        );
        if (done?.rowCount === 1) {
          this.protectedAssets.set(id, hold ? 'legal hold' : 'renewed');
          this.counts[hold ? 'assetHolds' : 'assetRenewals'] += 1;
        }
      }
    }
  }
}

async function main(): Promise<number> {
  const options = parseOptions();
  const random = prng(options.seed);
  const durationMs = options.minutes * 60_000;
  const log = (text: string) => process.stdout.write(`${text}\n`);
  log(`chaos: seed ${options.seed}, ${options.minutes} min${options.serverFaults ? '' : ', no server faults'} (replay: npm run chaos -- --minutes ${options.minutes} --seed ${options.seed}${options.serverFaults ? '' : ' --no-server-faults'})`);

  // As deployed: every service logs in as its printed least-privilege role (issue 40); the faults
  // (backend terminations, restarts) and the checker use the bed's superuser pool.
  const bed = await makeTestBed('chaos');
  bed.pool.on('error', () => undefined); // its idle connections die with a PostgreSQL restart
  const api: MediaApi = await startMediaApi({ ratePerSecond: 60, burst: 30 });
  const database = new URL(bed.databaseUrl);
  const amqpTarget = new URL(bed.amqpUrl);
  const pgProxy = await TcpProxy.start({ targetHost: database.hostname, targetPort: Number(database.port || 5432), protocol: 'postgres' });
  const amqpProxy = await TcpProxy.start({ targetHost: amqpTarget.hostname, targetPort: Number(amqpTarget.port || 5672) });
  bed.writePolicies(policiesYaml(api.url));
  const serviceEnv = {
    DATABASE_URL: pgProxy.urlFor(bed.databaseUrl),
    AMQP_URL: amqpProxy.urlFor(bed.amqpUrl),
    REAPER_AMQP_HEARTBEAT_S: String(HEARTBEAT_S),
    REAPER_STATEMENT_TIMEOUT_MS: String(STATEMENT_TIMEOUT_MS),
    REAPER_PREFETCH: '2',
    LOG_LEVEL: 'info',
  };
  const command = (label: string) => (label.startsWith('scheduler') ? 'scheduler' : label.startsWith('relay') ? 'relay' : 'worker');
  // Every service's log is kept (each restart appends to its file): a run that fails explains itself.
  const logDir = path.join(RESULTS_DIR, `chaos-${options.seed}`);
  rmSync(logDir, { recursive: true, force: true });
  mkdirSync(logDir, { recursive: true });
  log(`service logs: ${path.relative(process.cwd(), logDir)}/`);
  const services = new Services((label) => startReaper(label, [command(label)], bed.processEnv({ ...serviceEnv, REAPER_WORKER_ID: label }), path.join(logDir, `${label}.log`)));
  emergencyStops.push(async () => {
    for (const process of services.all.values()) process.signal('SIGKILL');
    await Promise.all([...services.all.values()].map((process) => process.exited));
    await ensurePostgresUp().catch(() => undefined);
    if (options.serverFaults) await restoreMemoryWatermark().catch(() => undefined);
    await bed.close().catch(() => undefined);
  });
  const workers = ['worker-1', 'worker-2', 'worker-3'];
  // The consumer of the expiry events, bound before anything is published (an unroutable event is not confirmed).
  const eventsQueue = await bindEventsConsumer(bed);
  services.launch('scheduler');
  for (const label of workers) services.launch(label);
  services.launch('relay');

  const load = new Load(bed, prng(options.seed ^ 0x5eed));
  const faults: FaultRecord[] = [];
  const recoveries: Array<Promise<Recovery>> = [];
  const started = Date.now();
  const elapsed = () => ((Date.now() - started) / 1000).toFixed(1).padStart(6);
  let lastServerFault = -SERVER_FAULT_GAP_MS;
  const undo: Array<() => Promise<void>> = [];
  let exitCode = 0;

  const wait = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
  const pick = <T>(items: readonly T[]): T => items[Math.floor(random() * items.length)]!;

  /** Injects one fault, waits while it lasts, undoes it; returns its target and duration. */
  async function inject(kind: FaultKind): Promise<{ target: string; durationMs: number }> {
    const t0 = Date.now();
    switch (kind) {
      case 'sigkill-worker': {
        const label = pick(workers);
        await services.kill(label);
        services.launch(label);
        return { target: label, durationMs: Date.now() - t0 };
      }
      case 'sigkill-scheduler':
      case 'sigkill-relay': {
        const label = kind === 'sigkill-scheduler' ? 'scheduler' : 'relay';
        await services.kill(label);
        services.launch(label);
        return { target: label, durationMs: Date.now() - t0 };
      }
      case 'sigstop-worker': {
        const label = pick(workers);
        const process = services.get(label);
        process.signal('SIGSTOP');
        undo.push(async () => process.signal('SIGCONT'));
        await wait(REMOTE_LEASE_MS + 2_000); // past the remote lease; the broker's heartbeat also gives its batches back
        process.signal('SIGCONT');
        undo.pop();
        return { target: label, durationMs: Date.now() - t0 };
      }
      case 'pg-restart': {
        try {
          await restartPostgresImmediately();
        } finally {
          await ensurePostgresUp();
        }
        return { target: 'postgresql', durationMs: Date.now() - t0 };
      }
      case 'backend-terminated': {
        const found = await bed.pool.query<{ pid: number; name: string }>(
          `SELECT pid, application_name AS name FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'reaper-worker' ORDER BY random() LIMIT 1`,
        );
        const victim = found.rows[0];
        if (victim) await bed.pool.query('SELECT pg_terminate_backend($1)', [victim.pid]);
        return { target: victim ? `backend ${victim.pid}` : 'none idle', durationMs: Date.now() - t0 };
      }
      case 'pg-link-reset': {
        // Mid-commit when a DELETE comes within 2 s, else whatever is open.
        const link = await Promise.race([pgProxy.holdRepliesAfter(/DELETE FROM|reaper_row_delete_|UPDATE cleanup_ledger/), wait(2_000).then(() => null)]);
        if (link) pgProxy.reset(link);
        else pgProxy.resetAll();
        return { target: link ? 'postgres link mid-statement' : 'postgres links', durationMs: Date.now() - t0 };
      }
      case 'amqp-link-reset': {
        const n = amqpProxy.resetAll();
        return { target: `${n} broker links`, durationMs: Date.now() - t0 };
      }
      case 'pg-link-stalled':
      case 'amqp-link-stalled': {
        const proxy = kind === 'pg-link-stalled' ? pgProxy : amqpProxy;
        const n = proxy.stallAll().length;
        undo.push(async () => proxy.heal());
        await wait(kind === 'pg-link-stalled' ? STATEMENT_TIMEOUT_MS + 6_000 : 3 * HEARTBEAT_S * 1000 + 1_000);
        proxy.heal();
        undo.pop();
        return { target: `${n} links`, durationMs: Date.now() - t0 };
      }
      case 'latency': {
        pgProxy.latencyMs = 30;
        amqpProxy.latencyMs = 30;
        undo.push(async () => {
          pgProxy.latencyMs = 0;
          amqpProxy.latencyMs = 0;
        });
        await wait(8_000);
        await undo.pop()!();
        return { target: 'all links +30 ms', durationMs: Date.now() - t0 };
      }
      case '429-storm': {
        api.configure({ throttleUntil: Date.now() + 6_000 });
        await wait(6_000);
        return { target: 'media api', durationMs: Date.now() - t0 };
      }
      case 'broker-connections-closed': {
        const listed = await rabbitmqctl(['list_connections', 'pid', 'client_properties', '-q', '--no-table-headers']);
        const pids = listed
          .split('\n')
          .filter((line) => (/\{"connection_name","([^"]*)"\}/.exec(line)?.[1] ?? '').split(' ').includes(bed.prefix))
          .map((line) => line.split('\t')[0]!.trim())
          .filter((pid) => pid.startsWith('<'));
        await Promise.all(pids.map((pid) => rabbitmqctl(['close_connection', pid, 'chaos: connection closed by the broker', '-q']).catch(() => undefined)));
        return { target: `${pids.length} connections`, durationMs: Date.now() - t0 };
      }
      case 'broker-memory-alarm': {
        try {
          await setMemoryWatermark(0.0001);
          await wait(12_000); // past the scheduler's 10 s confirm timeout
        } finally {
          await restoreMemoryWatermark();
        }
        return { target: 'broker', durationMs: Date.now() - t0 };
      }
    }
  }

  const kinds = (Object.keys(WEIGHTS) as FaultKind[]).filter((kind) => options.serverFaults || !SERVER_FAULTS.has(kind));
  const chooseKind = (): FaultKind => {
    const allowed = kinds.filter((kind) => !SERVER_FAULTS.has(kind) || Date.now() - lastServerFault >= SERVER_FAULT_GAP_MS);
    const total = allowed.reduce((sum, kind) => sum + WEIGHTS[kind], 0);
    let r = random() * total;
    for (const kind of allowed) {
      r -= WEIGHTS[kind];
      if (r < 0) return kind;
    }
    return allowed[allowed.length - 1]!;
  };

  let loading = true;
  const loadLoop = (async () => {
    while (loading) {
      await load.tick();
      await wait(250);
    }
  })();

  try {
    await services.get('scheduler').waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 60_000);
    await wait(5_000 + random() * 5_000);
    while (Date.now() - started < durationMs - 15_000) {
      const kind = chooseKind();
      if (SERVER_FAULTS.has(kind)) lastServerFault = Date.now();
      const at = Date.now() - started;
      const { target, durationMs: lasted } = await inject(kind);
      const record: FaultRecord = { at, kind, target, durationMs: lasted, recoveryMs: null };
      faults.push(record);
      log(`[${elapsed()} s] fault ${kind.padEnd(26)} ${target} (${(lasted / 1000).toFixed(1)} s)`);
      recoveries.push(
        measureRecovery(bed.pool, kind, Date.now(), 60_000).then((recovery) => {
          record.recoveryMs = recovery.ms;
          return recovery;
        }),
      );
      await wait(6_000 + random() * 9_000);
    }
  } finally {
    for (const step of undo.splice(0).reverse()) await step().catch(() => undefined);
    pgProxy.latencyMs = 0;
    amqpProxy.latencyMs = 0;
    pgProxy.heal();
    amqpProxy.heal();
    await ensurePostgresUp();
    if (options.serverFaults) await restoreMemoryWatermark().catch((error: Error) => log(`restoring the watermark failed: ${error.message}`));
    for (const process of services.all.values()) process.signal('SIGCONT');
  }

  // ---- settle ----
  while (Date.now() - started < durationMs) await wait(500);
  loading = false;
  await loadLoop;
  log(`[${elapsed()} s] load stopped; settling`);
  const problems: string[] = [];
  const settleCutoffs: Record<string, string> = {};
  const settleDeadline = Date.now() + 180_000;
  const unfinishedRuns = async () =>
    (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_runs WHERE state IN ('pending', 'scanning', 'published')`)).rows[0]!.n;
  while ((await unfinishedRuns()) > 0 && Date.now() < settleDeadline) await wait(500);
  for (const policy of [ROWS, ASSETS]) {
    const triggered = await runReaperCli(['trigger', policy, '--json'], bed.processEnv(serviceEnv));
    if (triggered.code !== 0) {
      problems.push(`trigger ${policy} failed: ${triggered.stdout}`);
      continue;
    }
    const runId = (JSON.parse(triggered.stdout) as { runId: string }).runId;
    for (;;) {
      const run = (await bed.pool.query<{ state: string; cutoff: string }>(`SELECT state, reaper_iso(cutoff) AS cutoff FROM cleanup_runs WHERE run_id = $1`, [runId])).rows[0]!;
      if (run.state === 'completed') {
        settleCutoffs[policy] = run.cutoff;
        break;
      }
      if (['failed', 'incomplete', 'rejected'].includes(run.state) || Date.now() > settleDeadline) {
        problems.push(`settling run of ${policy} ended ${run.state}`);
        break;
      }
      await wait(300);
    }
  }
  const openOperations = async () =>
    (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM cleanup_ledger WHERE state <> 'done'`)).rows[0]!.n;
  while ((await openOperations()) > 0 && Date.now() < settleDeadline) await wait(500);
  const unpublished = () => outboxEventCount(bed.pool);
  while ((await unpublished()) > 0 && Date.now() < settleDeadline) await wait(500);
  const settledAt = (await bed.pool.query<{ now: string }>('SELECT reaper_iso(clock_timestamp()) AS now')).rows[0]!.now;
  // Each work queue as the settle left it, services still running: a queue with messages and no
  // consumer is a lost consumer, one with consumers that does not drain is a capacity problem.
  const queuesAtSettle = await describeWorkQueues(bed, [ROWS, ASSETS]);
  log(`work queues at the end of the settle: ${queuesAtSettle.map((q) => `${q.queue} ${q.messages} message(s), ${q.consumers} consumer(s)`).join('; ')}`);
  await Promise.all(recoveries);
  problems.push(...(await services.stopAll()));
  problems.push(...services.unexpectedExits.map((exit) => `unexpected exit: ${exit}`));

  const names = brokerNames(bed.prefix);
  // Opened now: a long-lived test connection would share the faults' fate for nothing.
  const broker = await openTestBroker(bed.amqpUrl);
  const report = await runChecker({
    pool: bed.pool,
    broker,
    workQueues: [names.workQueue(ROWS), names.workQueue(ASSETS)],
    deadLetterQueue: names.deadLetterQueue,
    rows: { policy: ROWS, created: load.rowsCreated, protected: load.protectedRows, cutoff: settleCutoffs[ROWS] ?? settledAt },
    assets: {
      policy: ASSETS,
      protected: load.protectedAssets,
      cutoff: settleCutoffs[ASSETS] ?? settledAt,
      executionsByKey: api.executionsByKey(),
      executedIds: new Set(api.calls.filter((call) => call.executed).map((call) => call.id)),
    },
    recoveries: faults.map((fault) => ({ fault: fault.kind, ms: fault.recoveryMs })),
    runsCreatedBefore: settledAt,
    events: { delivered: (await broker.drain(eventsQueue)).map((message) => String(message.properties.messageId)) },
  });
  const rowsDeleted = (await bed.pool.query<{ n: number }>('SELECT coalesce(sum(deleted), 0)::int AS n FROM cleanup_batches WHERE policy = $1', [ROWS])).rows[0]!.n;
  const assetsDeleted = (await bed.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM media_assets WHERE status = 'deleted'`)).rows[0]!.n;
  const byKind: Record<string, number> = {};
  for (const fault of faults) byKind[fault.kind] = (byKind[fault.kind] ?? 0) + 1;
  const recovered = faults.filter((f) => f.recoveryMs !== null);
  const longest = recovered.reduce<FaultRecord | null>((worst, f) => (worst === null || f.recoveryMs! > worst.recoveryMs! ? f : worst), null);

  log('');
  log(`faults injected: ${faults.length} (${Object.entries(byKind).map(([kind, n]) => `${kind} ${n}`).join(', ')})`);
  log(`rows: ${load.rowsCreated} created, ${rowsDeleted} deleted, ${load.counts.renewed} renewed, ${load.counts.confirmed} confirmed, ${load.counts.rowHolds} under legal hold`);
  log(`assets: ${load.assetsCreated} created, ${assetsDeleted} deleted remotely (${api.calls.length} API calls, ${api.calls.filter((c) => c.status === 429).length} answered 429), ${load.counts.assetRenewals} renewed, ${load.counts.assetHolds} under legal hold`);
  log(`longest recovery: ${longest ? `${(longest.recoveryMs! / 1000).toFixed(1)} s after ${longest.kind}` : '-'}`);
  log('');
  log(formatChecker(report));
  if (problems.length > 0) log(`\nproblems:\n  ${problems.join('\n  ')}`);
  const violations = report.lost + report.wrongful + report.doubled + report.stuck + eventViolations(report);
  if (violations > 0) log(`\nchecker details: ${JSON.stringify(report.details)}`);
  if (violations > 0 || problems.length > 0) exitCode = 1;
  log(`\nseed ${options.seed}: ${exitCode === 0 ? 'all zeros' : 'VIOLATIONS'}`);

  mkdirSync(RESULTS_DIR, { recursive: true });
  const file = path.join(RESULTS_DIR, `${new Date().toISOString().slice(0, 10)}-chaos-${options.seed}.json`);
  writeFileSync(
    file,
    `${JSON.stringify(
      {
        seed: options.seed,
        minutes: options.minutes,
        serverFaults: options.serverFaults,
        faults,
        byKind,
        rows: { created: load.rowsCreated, deleted: rowsDeleted, ...load.counts },
        assets: { created: load.assetsCreated, deletedRemotely: assetsDeleted, apiCalls: api.calls.length },
        checker: { lost: report.lost, wrongful: report.wrongful, doubled: report.doubled, stuck: report.stuck, events: eventViolations(report), details: report.details },
        events: report.events ?? null,
        longestRecoveryMs: longest?.recoveryMs ?? null,
        problems,
        queuesAtSettle,
        serviceLogs: path.relative(process.cwd(), logDir),
      },
      null,
      2,
    )}\n`,
  );
  log(`figures: ${path.relative(process.cwd(), file)}`);

  await pgProxy.close();
  await amqpProxy.close();
  await api.close();
  await broker.close();
  await bed.close();
  return exitCode;
}

/**
 * A consumer's own durable queue for every policy's expiry events (`*.expired` on `<prefix>.events`),
 * named under the bed's prefix so the bed's close deletes it. Read once, after the services stopped.
 */
async function bindEventsConsumer(bed: TestBed): Promise<string> {
  const names = brokerNames(bed.prefix);
  const queue = `${bed.prefix}.events-consumer`;
  const connection = await amqp.connect(bed.amqpUrl);
  try {
    const channel = await connection.createChannel();
    await channel.assertExchange(names.eventsExchange, 'topic', { durable: true });
    await channel.assertQueue(queue, { durable: true });
    await channel.bindQueue(queue, names.eventsExchange, '*.expired');
  } finally {
    await connection.close();
  }
  return queue;
}

/** Messages and consumers of each policy's work queue now (passive declare: the broker's count). */
async function describeWorkQueues(bed: TestBed, policies: readonly string[]): Promise<Array<{ queue: string; messages: number; consumers: number }>> {
  const names = brokerNames(bed.prefix);
  const broker = await openTestBroker(bed.amqpUrl);
  try {
    const described = [];
    for (const policy of policies) {
      const queue = names.workQueue(policy);
      described.push({ queue, messages: await broker.messageCount(queue), consumers: await broker.consumerCount(queue) });
    }
    return described;
  } finally {
    await broker.close();
  }
}

/** What a crash of the tool itself must still undo (services killed, servers restored, database dropped). */
const emergencyStops: Array<() => Promise<void>> = [];

main().then(
  (code) => process.exit(code),
  async (error: Error) => {
    process.stderr.write(`chaos failed: ${error.stack ?? error.message}\n`);
    for (const stop of emergencyStops) await stop().catch(() => undefined);
    process.exit(2);
  },
);
