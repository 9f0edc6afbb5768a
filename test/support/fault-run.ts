import assert from 'node:assert/strict';
import { brokerNames } from '../../shared/amqp/topology';
import type { TestBroker } from './broker';
import { rowDeletePolicyYaml, runRow, runReceipts, startServices, stopAllCleanly, type ServiceGroup, type ServiceSpec } from './fixtures';
import { runReaperCli, type ReaperProcess } from './processes';
import { assertCheckerZero, formatChecker, measureRecovery, runChecker, type CheckerReport, type Recovery } from './run-checks';
import { seedHolds } from './seed';
import type { TestBed } from './testbed';

/**
 * The shape every fault test of issue 10 shares: seed expired holds (the work), unexpired and
 * confirmed ones (must stay), and expired holds under a legal hold in cleanup_holds (must stay);
 * start the services; trigger a run; inject the fault mid-run; let the system settle (the run
 * ends, then one more run triggered after the fault finds nothing left); stop everything
 * cleanly; the checker must read zero everywhere.
 */
export interface FaultRunOptions {
  bed: TestBed;
  broker: TestBroker;
  policy?: string;
  expired: number;
  batchSize: number;
  /** Unexpired and confirmed holds seeded next to the expired ones (default 300 each). */
  bystanders?: number;
  /** Expired holds placed under a legal hold before the run (default 100). */
  legallyHeld?: number;
  services: readonly ServiceSpec[];
  /** Injects the fault once the run is under way; returns the recoveries to report. */
  inject(context: FaultContext): Promise<Recovery[]>;
  /** Error-level log lines this fault is expected to cause. */
  allowErrors?: RegExp;
  /** How long the faulted run may take to end. */
  runTimeoutMs?: number;
}

export interface FaultContext {
  runId: string;
  group: ServiceGroup;
  scheduler: ReaperProcess;
  workers: ReaperProcess[];
  /** Batches committed so far in this run. */
  batchesDone(): Promise<number>;
  /** Waits (alive) until at least `n` batches of the run are committed. */
  afterBatches(n: number): Promise<void>;
  /** The recovery after a fault that ended at `since`. */
  recovery(fault: string, since: number): Promise<Recovery>;
}

export async function runUnderFault(options: FaultRunOptions): Promise<CheckerReport> {
  const { bed, broker } = options;
  const policy = options.policy ?? 'seat-holds';
  const names = brokerNames(bed.prefix);
  bed.writePolicies(rowDeletePolicyYaml({ name: policy, batchSize: options.batchSize }));
  const bystanders = options.bystanders ?? 300;
  const seeded = await seedHolds(bed.pool, { expiredHeld: options.expired, futureHeld: bystanders, expiredConfirmed: bystanders });
  const legal = await seedHolds(bed.pool, { expiredHeld: options.legallyHeld ?? 100 });
  await bed.pool.query(
    `INSERT INTO cleanup_holds (policy, key, reason, created_by) SELECT $1, id, 'litigation (fault test)', 'test' FROM unnest($2::text[]) AS id`,
    [policy, legal.expiredHeld],
  );
  const protectedRows = new Map<string, string>([
    ...seeded.futureHeld.map((id) => [id, 'unexpired'] as const),
    ...seeded.expiredConfirmed.map((id) => [id, 'confirmed'] as const),
    ...legal.expiredHeld.map((id) => [id, 'legal hold'] as const),
  ]);
  const created = options.expired + 2 * bystanders + legal.expiredHeld.length;

  const group = startServices(bed, options.services, 'no service may die of this fault');
  const [scheduler, ...workers] = group.services as [ReaperProcess, ...ReaperProcess[]];
  let passed = false;
  try {
    await scheduler.waitForLine('scheduler started', (line) => line.msg === 'scheduler started', 30_000);
    await Promise.all(workers.map((w) => w.waitForLine('worker consuming', (line) => line.msg === 'worker consuming', 30_000)));
    const runId = await trigger(bed, policy);
    const batchesDone = async () => (await runReceipts(bed.pool, runId)).batches;
    const recoveries = await options.inject({
      runId,
      group,
      scheduler,
      workers,
      batchesDone,
      afterBatches: async (n) => {
        await group.eventuallyAlive(`${n} batches committed`, async () => (await batchesDone()) >= n, { timeoutMs: 30_000, intervalMs: 20 });
      },
      recovery: (fault, since) => measureRecovery(bed.pool, fault, since, 30_000),
    });
    const finished = await group.eventuallyAlive(
      'the faulted run to end',
      async () => {
        const state = (await runRow(bed.pool, runId)).state;
        return ['completed', 'failed', 'incomplete'].includes(state) ? state : undefined;
      },
      { timeoutMs: options.runTimeoutMs ?? 45_000, intervalMs: 200, describe: async () => ({
          run: await runRow(bed.pool, runId),
          receipts: await runReceipts(bed.pool, runId),
          // What the scheduler said last (a step it retries says why): the cause, not only the symptom.
          scheduler: scheduler.output.slice(-8),
          // And who waits on what in the test's database (a hang between two sessions shows here).
          sessions: (
            await bed.pool.query<{ application_name: string; state: string; wait: string | null; query: string }>(
              `SELECT application_name, state, wait_event_type || ':' || wait_event AS wait, left(query, 120) AS query
               FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'`,
            )
          ).rows,
        }),
      },
    );
    assert.equal(finished, 'completed', `the faulted run completes: ${JSON.stringify(await runRow(bed.pool, runId))}`);
    // Settling: one more run after the fault must find nothing left to delete.
    const settleId = await trigger(bed, policy);
    await group.eventuallyAlive('the settling run to complete', async () => (await runRow(bed.pool, settleId)).state === 'completed', { timeoutMs: 30_000, intervalMs: 200 });
    const settle = await runRow(bed.pool, settleId);
    await stopAllCleanly(group.services, { allowErrors: options.allowErrors });
    const report = await runChecker({
      pool: bed.pool,
      broker,
      workQueues: [names.workQueue(policy)],
      deadLetterQueue: names.deadLetterQueue,
      rows: { policy, created, protected: protectedRows, cutoff: settle.cutoff },
      recoveries,
    });
    if (process.env.TEST_ECHO) process.stderr.write(`${formatChecker(report)}\n`);
    assertCheckerZero(report);
    assert.equal(settle.candidates, 0, 'the settling run found nothing left');
    passed = true;
    return report;
  } finally {
    if (!passed) await group.stopLeftovers();
  }
}

export async function trigger(bed: TestBed, policy: string, env: Record<string, string> = {}): Promise<string> {
  const triggered = await runReaperCli(['trigger', policy, '--json'], bed.processEnv(env));
  assert.equal(triggered.code, 0, triggered.stdout);
  return (JSON.parse(triggered.stdout) as { runId: string }).runId;
}
