import { randomUUID } from 'node:crypto';
import type { Logger } from 'pino';
import type { Counter, Registry } from 'prom-client';
import { promClient } from '../../shared/lazy-modules';
import { overrideFor, remoteAdmissionWith } from '../../shared/admission/overrides';
import type { ConfirmingPublisher } from '../../shared/amqp/publisher';
import type { BrokerNames } from '../../shared/amqp/topology';
import type { AnyRemoteDeletePolicy } from '../../shared/config/policies';
import { encodeBatch, type BatchV1 } from '../../shared/contracts/batch';
import { windowStateAt } from '../../shared/schedule/window';
import { withTransaction, type Pool } from '../../shared/db/pool';
import type { ResolvedTarget } from '../../shared/db/queries/target';
import { ledgerDatabaseNow, ledgerMarkCarried, ledgerSweepPick, ledgerUnmarkCarried, remoteBatchesKeep, remoteBatchesOrphaned, type SweepCandidate } from '../../shared/db/queries/ledger';

/**
 * The ledger sweeper (remote-delete): the ledger, not the broker, is the record of remote work.
 * Work that waits its turn, was recorded by a webhook, had its lease reclaimed, or whose copy was
 * lost from a delay tier sits in cleanup_ledger as pending operations that no copy carries
 * (last_delivered_at NULL or old). Every SWEEP_INTERVAL_MS one worker per policy (advisory lock)
 * publishes batches for the due ones in line order, only as many operations as admission can take
 * within SWEEP_AHEAD_MS minus what copies already carry — so the broker holds a batch again only
 * when it can be admitted soon, and nothing is sent while the policy is paused. A kept batch none
 * of whose operations is open any more (another batch's claims finished them while it was parked)
 * is sent again too, so that its delivery writes its receipt and its run completes.
 */
export const SWEEP_INTERVAL_MS = 1_000;
/** Operations are sent when admission can take them within this time. */
export const SWEEP_AHEAD_MS = 3_000;
/**
 * A copy that carried an operation this long ago and left it pending is presumed lost. Longer than
 * any wait a carried batch spends in a delay tier (WAIT_IN_BROKER_MAX_MS) plus its hold in a worker.
 */
export const CARRY_STALE_MS = 30_000;
/**
 * Kept batches a pass looks at for orphans (no open operation left, no receipt: remoteBatchesOrphaned),
 * going round the policy's kept batches in batch id order, so a pass's work stays bounded.
 */
export const ORPHAN_LOOK_BATCHES = 200;
/** Where the orphan look of each policy goes on (this process; any other start point is as good). */
const orphanCursor = new Map<string, string | null>();

const counters = new WeakMap<Registry, Counter<'policy'>>();
function publishedCounter(registry: Registry): Counter<'policy'> {
  let counter = counters.get(registry);
  if (!counter) {
    counter = new (promClient().Counter)({
      name: 'reaper_ledger_sweep_batches_published_total',
      help: 'Batches the ledger sweeper published for operations due and not carried (remote-delete)',
      labelNames: ['policy'],
      registers: [registry],
    });
    counters.set(registry, counter);
  }
  return counter;
}

export interface LedgerSweeperDeps {
  pool: Pool;
  publisher: ConfirmingPublisher;
  names: BrokerNames;
  policies: readonly AnyRemoteDeletePolicy[];
  /** Each policy's resolved table (its key type spells a message's ids canonically). */
  targets: ReadonlyMap<string, ResolvedTarget>;
  log: Logger;
  registry: Registry;
}

export function startLedgerSweeper(deps: LedgerSweeperDeps): { stop(): Promise<void> } {
  let pass: Promise<void> | null = null;
  const timer = setInterval(() => {
    if (pass) return; // the previous pass is still running: never two at once
    pass = (async () => {
      for (const policy of deps.policies) {
        // Outside its schedule window nothing is sent: the operations wait in the ledger (durably)
        // and the first pass after the opening sends them (window-gate.ts would only delay them).
        if (!windowStateAt(policy.window, new Date()).open) continue;
        try {
          const published = await sweepPolicy(deps, policy, deps.targets.get(policy.name)!);
          if (published > 0) deps.log.info({ policy: policy.name, batches: published }, 'ledger sweeper published batches for waiting operations');
        } catch (error) {
          deps.log.warn({ policy: policy.name, err: (error as Error).message }, 'ledger sweep failed; the next pass retries');
        }
      }
    })().finally(() => (pass = null));
  }, SWEEP_INTERVAL_MS);
  return {
    async stop() {
      clearInterval(timer);
      await pass;
    },
  };
}

/**
 * One pass for one policy: in one short transaction pick (locks the picked rows), keep the new
 * batches and mark the operations carried, commit; THEN publish each batch and wait for its confirm
 * with no transaction open (invariant 18: no wait inside an open transaction, so a slow broker never
 * holds ledger row locks that claims and outcome writes need). A publish that fails hands the marks
 * back (ledgerUnmarkCarried) so the next pass picks the same operations again; a crash between the
 * commit and the publish leaves them marked, and the sweeper re-finds them once the mark is older
 * than CARRY_STALE_MS. Either way an operation is published again, never lost; a duplicate copy is
 * a counted no-op for workers (the ledger decides).
 */
export async function sweepPolicy(deps: Omit<LedgerSweeperDeps, 'policies' | 'targets' | 'log'>, policy: AnyRemoteDeletePolicy, target: ResolvedTarget): Promise<number> {
  // The rate in force: the file's, or what `reaper admission set` put over it (as the claim reads it).
  const { ratePerSecond } = remoteAdmissionWith(policy, await overrideFor(deps.pool, policy.name));
  const messages = await withTransaction(deps.pool, async (client) => {
    const pick = await ledgerSweepPick(client, {
      policy: policy.name,
      ratePerSecond,
      aheadMs: SWEEP_AHEAD_MS,
      staleMs: CARRY_STALE_MS,
      limit: policy.batchSize * 8,
    });
    const messages = new Map<string, { runId: string; content: Buffer }>();
    const loose: SweepCandidate[] = [];
    if (!pick || pick.paused) return messages;
    // A parked batch whose operations another batch finished: sent again, its delivery writes the receipt.
    const look = await remoteBatchesOrphaned(client, {
      policy: policy.name,
      keyType: target.keyType,
      after: orphanCursor.get(policy.name) ?? null,
      limit: ORPHAN_LOOK_BATCHES,
      keptForMs: CARRY_STALE_MS,
    });
    orphanCursor.set(policy.name, look.last);
    for (const orphan of look.orphans) messages.set(orphan.batchId, { runId: runIdOf(orphan.content), content: orphan.content });
    for (const candidate of pick.picked) {
      const content = candidate.batchId === null ? undefined : pick.kept.get(candidate.batchId);
      if (candidate.batchId !== null && content !== undefined) {
        // The batch's own message, as published: same id, run and cutoff; its receipt counts for its run.
        if (!messages.has(candidate.batchId)) messages.set(candidate.batchId, { runId: runIdOf(content), content });
      } else {
        loose.push(candidate);
      }
    }
    // Operations no kept batch carries (a webhook recorded them): a batch of their own, kept too.
    const adopted: Array<{ operationKey: string; batchId: string }> = [];
    if (loose.length > 0) {
      const cutoff = await ledgerDatabaseNow(client);
      for (let start = 0; start < loose.length; start += policy.batchSize) {
        const chunk = loose.slice(start, start + policy.batchSize);
        const batch: BatchV1 = {
          version: 1,
          runId: randomUUID(),
          batchId: `ledger:${randomUUID()}`,
          policy: policy.name,
          cutoff,
          items: chunk.map((candidate) => ({ id: candidate.assetId, observedExpiry: candidate.observedExpiry })),
        };
        const content = encodeBatch(batch);
        await remoteBatchesKeep(client, { batchId: batch.batchId, policy: policy.name, content });
        messages.set(batch.batchId, { runId: batch.runId, content });
        for (const candidate of chunk) adopted.push({ operationKey: candidate.operationKey, batchId: batch.batchId });
      }
    }
    if (messages.size > 0) await ledgerMarkCarried(client, { batchIds: [...messages.keys()], adopted });
    return messages;
  });
  if (messages.size === 0) return 0;
  try {
    await Promise.all(
      [...messages].map(([batchId, message]) =>
        deps.publisher.publish(deps.names.workExchange, policy.name, message.content, {
          messageId: batchId,
          contentType: 'application/json',
          headers: { 'x-run-id': message.runId, 'x-reaper-source': 'ledger-sweeper' },
        }),
      ),
    );
  } catch (error) {
    // Some copies may have been confirmed: handing all marks back only risks a duplicate copy.
    await ledgerUnmarkCarried(deps.pool, [...messages.keys()]).catch(() => undefined); // else CARRY_STALE_MS re-finds them
    throw error;
  }
  publishedCounter(deps.registry).inc({ policy: policy.name }, messages.size);
  return messages.size;
}

/** The run of a kept batch's message, as published. */
function runIdOf(content: Buffer): string {
  return (JSON.parse(content.toString('utf8')) as Pick<BatchV1, 'runId'>).runId;
}
