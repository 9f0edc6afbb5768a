import type { Logger } from 'pino';
import { isS3Policy, type Policy, type PolicySet, type RemoteDeletePolicy, type RowDeletePolicy, type S3DeletePolicy } from '../../shared/config/policies';
import type { Env } from '../../shared/config/env';
import { assertSchemaCurrent } from '../../shared/db/migrate';
import type { Pool } from '../../shared/db/pool';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { assertStatisticsReadable } from '../../shared/admission/rows';
import type { Metrics } from '../../shared/observability/metrics';
import { failpoint } from '../../shared/observability/failpoint-hook';
import { DEFAULT_BREAKER, makeHttpRemoteClient, withCircuitBreaker } from '../../shared/remote/client';
import { testTimings } from '../../shared/config/test-timings';
import { makeObjectStorageClient } from '../../shared/remote/s3';
import type { BatchV1 } from '../../shared/contracts/batch';
import { makeCoalescer } from './coalescer';
import { makeRemoteDeleteHandler } from './handlers/remote-delete';
import { makeRowDeleteGroupHandler } from './handlers/row-delete';
import { makeS3DeleteHandler } from './handlers/s3-delete';
import type { BatchHandler } from './handlers/types';
import type { BatchResult } from './results';

/**
 * Coalesced row-delete groups one worker runs at once per policy: while they run, deliveries in
 * hand gather into the next group. Two keep the database busy while a group's acks go out; the
 * second starts only with half a prefetch in hand (the coalescer's minItemsBeside). In the bench's
 * end-to-end run, where the workers keep the queue nearly empty, that took 8% less CPU per row
 * (all processes) and finished 1.07x as fast as starting it with any one delivery
 * (bench/results/2026-12-03-cost-quick-ab-minbeside16.md).
 */
const ROW_GROUPS_PER_POLICY = 2;

export interface PolicyHandlersDeps {
  pool: Pool;
  env: Pick<Env, 'workerId' | 'prefetch'>;
  log: Logger;
  metrics: Metrics;
  /** Set once the worker stops: a row-delete group then stops waiting for admission. */
  stopping: () => boolean;
}

export interface PolicyHandlers {
  /** One handler per policy name: a batch in, a result out (the consumer settles it). */
  handlers: Map<string, BatchHandler>;
  /** Each policy's table as resolved at start (key type: the ledger sweeper's canonical keys). */
  targets: Map<string, ResolvedTarget>;
}

/**
 * Checks the schema, resolves every policy's table and wires its kind's handler. Any failure is a
 * start-up error naming the policy; the pool is ended before it is thrown.
 */
export async function makePolicyHandlers(deps: PolicyHandlersDeps, policies: PolicySet): Promise<PolicyHandlers> {
  const made: PolicyHandlers = { handlers: new Map(), targets: new Map() };
  try {
    await assertSchemaCurrent(deps.pool);
    for (const policy of policies.values()) {
      try {
        const target = await targetResolve(deps.pool, policy);
        made.targets.set(policy.name, target);
        made.handlers.set(policy.name, await makeHandlerFor(policy, target, deps));
      } catch (error) {
        throw new Error(`policy ${policy.name}: ${(error as Error).message}`);
      }
    }
  } catch (error) {
    await deps.pool.end();
    throw error;
  }
  return made;
}

function makeHandlerFor(policy: Policy, target: ResolvedTarget, deps: PolicyHandlersDeps): Promise<BatchHandler> {
  switch (policy.kind) {
    case 'row-delete':
      return wireRowDelete(policy, target, deps);
    case 'remote-delete':
      return isS3Policy(policy) ? wireS3Delete(policy, target) : Promise.resolve(wireHttpRemoteDelete(policy, target, deps));
  }
}

/**
 * row-delete: the group handler behind a coalescer, so the batches in hand for the policy go to
 * the database as one statement (handlers/row-delete.ts); each delivery still gets its own result.
 */
async function wireRowDelete(policy: RowDeletePolicy, target: ResolvedTarget, deps: PolicyHandlersDeps): Promise<BatchHandler> {
  // A brake that cannot read the lag, or adaptive admission that cannot see the application, is a start-up error, not "lag 0" or "alone".
  await assertStatisticsReadable(deps.pool, policy);
  const group = makeRowDeleteGroupHandler(policy, target);
  const { pool, env, metrics, stopping } = deps;
  const context = { pool, workerId: env.workerId, log: deps.log.child({ policy: policy.name }), metrics, deliveryCount: 1, failpoint, stopping };
  const coalescer = makeCoalescer<BatchV1, BatchResult>({
    maxGroups: ROW_GROUPS_PER_POLICY,
    maxItems: env.prefetch.rowDelete,
    minItemsBeside: Math.ceil(env.prefetch.rowDelete / 2),
    run: (batches, heldSince) => group(batches, { ...context, heldSince }),
  });
  return (batch) => coalescer.submit(batch);
}

/** remote-delete over S3: the object store's client, its region and credentials resolved now (a missing one is a start-up error). */
async function wireS3Delete(policy: S3DeletePolicy, target: ResolvedTarget): Promise<BatchHandler> {
  const storage = makeObjectStorageClient(policy.remote);
  await storage.warmUp();
  return makeS3DeleteHandler(policy, target, storage);
}

/** remote-delete over HTTP: the client behind a circuit breaker whose state is a gauge. */
function wireHttpRemoteDelete(policy: RemoteDeletePolicy, target: ResolvedTarget, { log, metrics }: PolicyHandlersDeps): BatchHandler {
  const resetTimeoutMs = testTimings().breakerResetMs ?? DEFAULT_BREAKER.resetTimeoutMs;
  const remote = withCircuitBreaker(makeHttpRemoteClient(policy.remote, log.child({ policy: policy.name })), { ...DEFAULT_BREAKER, resetTimeoutMs });
  // reaper_circuit_open: half-open still refuses all but one trial call, so it counts as open.
  remote.breaker.on('open', () => metrics.circuitOpen.set({ policy: policy.name }, 1));
  remote.breaker.on('close', () => metrics.circuitOpen.set({ policy: policy.name }, 0));
  return makeRemoteDeleteHandler(policy, target, remote);
}
