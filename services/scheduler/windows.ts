import type { Logger } from 'pino';
import type { Policy, PolicySet } from '../../shared/config/policies';
import type { Metrics } from '../../shared/observability/metrics';
import { describeWindow, windowStateAt } from '../../shared/schedule/window';

/** How often the scheduler reads the windows: an opening is noticed (and its catch-up run made) within this. */
const WINDOW_CHECK_MS = 1_000;

export interface WindowWatch {
  /** Whether `policy`'s schedule window is open now (always, without a window). */
  isOpen(policy: Policy): boolean;
  /** The clock windows are read with (the run executor checks each window with it). */
  now: () => Date;
  stop(): void;
}

/**
 * Reads every policy's schedule window on a timer: sets reaper_policy_window_open (1/0) and, while
 * closed, reaper_policy_window_opens_at_seconds, and calls `onOpened` when a window it saw closed
 * is open: the scheduler then makes the one catch-up run for the ticks skipped meanwhile.
 * The clock is injectable; the windows are pure functions of it (shared/schedule/window.ts).
 */
export function startWindowWatch(options: {
  policies: PolicySet;
  metrics: Metrics;
  log: Logger;
  onOpened: (policy: Policy) => void;
  now?: () => Date;
}): WindowWatch {
  const { policies, metrics, log, onOpened } = options;
  const now = options.now ?? (() => new Date());
  const wasOpen = new Map<string, boolean>();
  const read = (notify: boolean): void => {
    const at = now();
    for (const policy of policies.values()) {
      const state = windowStateAt(policy.window, at);
      metrics.policyWindowOpen.set({ policy: policy.name }, state.open ? 1 : 0);
      if (state.open) metrics.policyWindowOpensAtSeconds.remove({ policy: policy.name });
      else metrics.policyWindowOpensAtSeconds.set({ policy: policy.name }, state.opensAt.getTime() / 1000);
      const before = wasOpen.get(policy.name);
      wasOpen.set(policy.name, state.open);
      if (before === undefined || before === state.open || !policy.window) continue;
      if (state.open) log.info({ policy: policy.name, window: describeWindow(policy.window), closesAt: state.closesAt }, 'schedule window opened');
      else log.info({ policy: policy.name, window: describeWindow(policy.window), opensAt: state.opensAt }, 'schedule window closed');
      if (state.open && notify) onOpened(policy);
    }
  };
  read(false);
  const timer = setInterval(() => read(true), WINDOW_CHECK_MS);
  timer.unref();
  return {
    isOpen: (policy) => windowStateAt(policy.window, now()).open,
    now,
    stop: () => clearInterval(timer),
  };
}
