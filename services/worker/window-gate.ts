import { DELAY_TIERS_MS } from '../../shared/amqp/topology';
import type { Policy } from '../../shared/config/policies';
import { outsideWindowMessage, windowStateAt } from '../../shared/schedule/window';
import type { BatchResult } from './results';

/** The longest delay tier: a batch outside its window waits in the broker at most this long per round. */
const LONGEST_TIER_MS = DELAY_TIERS_MS[DELAY_TIERS_MS.length - 1];

/**
 * Worker admission by schedule window: outside the policy's window no new deletion is admitted.
 * The batch is not held and not requeued (no spinning): it waits, durably, in a delay tier for the
 * time until the window opens, capped by the longest tier; settle publishes it there and acks.
 * A batch that comes back early (the cap, or a tier shorter than the wait) meets this gate again.
 * null: the window is open (or the policy has none), the handler runs.
 * Called by the consumer before the handler; the deleting statements know nothing of windows.
 */
export function outsideWindow(policy: Policy | undefined, now: Date): Extract<BatchResult, { kind: 'retry' }> | null {
  if (!policy?.window) return null;
  const state = windowStateAt(policy.window, now);
  if (state.open) return null;
  const delayMs = Math.min(LONGEST_TIER_MS, Math.max(0, state.opensAt.getTime() - now.getTime()));
  return { kind: 'retry', delayMs, reason: outsideWindowMessage(policy.window, state.opensAt) };
}
