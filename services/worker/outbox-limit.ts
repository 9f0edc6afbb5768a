import { eventsEnabled, type Policy } from '../../shared/config/policies';
import type { Db } from '../../shared/db/pool';
import { outboxCountUpTo } from '../../shared/db/queries/outbox';

/** How long one reading of the outbox's size is trusted: the check is per group, the count is not. */
export const OUTBOX_CHECK_TTL_MS = 2_000;
/** The delay tier a batch of a paused policy waits in before it asks again. */
export const OUTBOX_FULL_RETRY_MS = 10_000;
/** The reason a paused policy's batches carry (logged, and shown by `reaper status` as the pause). */
export const OUTBOX_FULL_REASON = 'outbox-full';

/**
 * Expiry events: a policy whose outbox holds `events.maxOutbox` unpublished events or more deletes
 * nothing more (its batches wait in a delay tier) until the relay catches up, so a broker outage
 * grows the outbox to a stated bound and no further. Counted up to the limit (a bounded walk) at
 * most once per OUTBOX_CHECK_TTL_MS per process: the overshoot is what the workers delete in that
 * time. A policy without events is never over.
 */
export function makeOutboxLimitCheck(policy: Policy, now: () => number = () => performance.now()): (db: Db) => Promise<boolean> {
  const limit = policy.events?.maxOutbox;
  if (!eventsEnabled(policy) || limit === undefined) return () => Promise.resolve(false);
  let known: { over: boolean; at: number } | null = null;
  return async (db) => {
    if (known && now() - known.at < OUTBOX_CHECK_TTL_MS) return known.over;
    const over = (await outboxCountUpTo(db, policy.name, limit)) >= limit;
    known = { over, at: now() };
    return over;
  };
}
