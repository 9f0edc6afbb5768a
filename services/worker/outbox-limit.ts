import { eventsEnabled, type Policy } from '../../shared/config/policies';
import type { Db } from '../../shared/db/pool';
import { outboxCountUpTo } from '../../shared/db/queries/outbox';
import { testTimings } from '../../shared/config/test-timings';

/** How long one reading of the outbox's size is trusted: the check is per group, the count is not. */
export const OUTBOX_CHECK_TTL_MS = 2_000;
/** The delay tier a batch of a paused policy waits in before it asks again. */
export const OUTBOX_FULL_RETRY_MS = 10_000;
/** OUTBOX_FULL_RETRY_MS, or a test's shorter REAPER_TEST_OUTBOX_FULL_RETRY_MS (shared/config/test-timings.ts). */
export function outboxFullRetryMs(): number {
  return testTimings().outboxFullRetryMs ?? OUTBOX_FULL_RETRY_MS;
}
/** The reason a paused policy's batches carry (logged, and shown by `reaper status` as the pause). */
export const OUTBOX_FULL_REASON = 'outbox-full';

export interface OutboxLimitCheck {
  /** Whether the policy's deletions must pause now. */
  over(db: Db): Promise<boolean>;
  /** This process just deleted (and so added outbox rows for) `rows` rows of the policy. */
  deleted(rows: number): void;
}

/**
 * Expiry events: a policy whose outbox holds `events.maxOutbox` unpublished events or more deletes
 * nothing more (its batches wait in a delay tier) until the relay catches up, so a broker outage
 * grows the outbox to a stated bound and no further. The outbox is counted up to the limit (a
 * bounded walk) at most once per OUTBOX_CHECK_TTL_MS per process, and sooner when this process's
 * own deletions since would reach the limit: the overshoot is what OTHER workers delete within
 * one TTL. A policy without events is never over.
 */
export function makeOutboxLimitCheck(
  policy: Policy,
  // Time and the count are inputs, so the unit test drives the cache without a clock or a database.
  inputs: { now?: () => number; countUpTo?: (db: Db, policy: string, cap: number) => Promise<number> } = {},
): OutboxLimitCheck {
  const now = inputs.now ?? (() => performance.now());
  const countUpTo = inputs.countUpTo ?? outboxCountUpTo;
  const limit = policy.events?.maxOutbox;
  if (!eventsEnabled(policy) || limit === undefined) return { over: () => Promise.resolve(false), deleted: () => undefined };
  let known: { count: number; deletedSince: number; at: number } | null = null;
  return {
    async over(db) {
      if (known && now() - known.at < OUTBOX_CHECK_TTL_MS && known.count + known.deletedSince < limit) return false;
      const count = await countUpTo(db, policy.name, limit);
      known = { count, deletedSince: 0, at: now() };
      return count >= limit;
    },
    deleted(rows) {
      if (known) known.deletedSince += rows;
    },
  };
}
