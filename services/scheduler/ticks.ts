import { createTask } from 'node-cron';
import { windowStateAt, type ScheduleWindow } from '../../shared/schedule/window';

/** Cron expressions are evaluated in UTC (docs/design.md). */
export const CRON_TIMEZONE = 'Etc/UTC';

export function truncateToSecond(date: Date): Date {
  return new Date(Math.floor(date.getTime() / 1000) * 1000);
}

/**
 * The latest tick of `schedule` strictly after `after` and at or before `now`, or null. Used once at
 * start-up: all missed ticks together become ONE catch-up run (a missed tick adds backlog, it
 * never changes correctness). Walks back second by second for 6-field schedules (at most a day)
 * and minute by minute for 5-field ones (at most 31 days).
 */
export function latestMissedTick(schedule: string, after: Date, now: Date): Date | null {
  const matcher = createTask(schedule, () => undefined, { timezone: CRON_TIMEZONE });
  const withSeconds = schedule.trim().split(/\s+/).length === 6;
  const stepMs = withSeconds ? 1000 : 60_000;
  const lookbackMs = withSeconds ? 86_400_000 : 31 * 86_400_000;
  const earliest = Math.max(after.getTime() + 1, now.getTime() - lookbackMs);
  let candidate = Math.floor(now.getTime() / stepMs) * stepMs;
  try {
    for (; candidate >= earliest; candidate -= stepMs) {
      if (matcher.match(new Date(candidate))) return new Date(candidate);
    }
    return null;
  } finally {
    void matcher.destroy();
  }
}

/**
 * The first tick of `schedule` at or after `from`, before `from + horizonMs`, inside `window`, or
 * null. Steps as latestMissedTick does (by the second for 6-field schedules, by the minute for
 * 5-field ones), over the window's open spans only.
 */
export function firstTickInWindow(schedule: string, window: ScheduleWindow, from: Date, horizonMs: number): Date | null {
  const matcher = createTask(schedule, () => undefined, { timezone: CRON_TIMEZONE });
  const stepMs = schedule.trim().split(/\s+/).length === 6 ? 1000 : 60_000;
  const onStep = (ms: number) => Math.ceil(ms / stepMs) * stepMs;
  try {
    const end = from.getTime() + horizonMs;
    for (let candidate = onStep(from.getTime()); candidate < end; ) {
      const state = windowStateAt(window, new Date(candidate));
      if (!state.open) {
        candidate = onStep(state.opensAt.getTime());
        continue;
      }
      const closes = Math.min(state.closesAt!.getTime(), end);
      for (; candidate < closes; candidate += stepMs) if (matcher.match(new Date(candidate))) return new Date(candidate);
    }
    return null;
  } finally {
    void matcher.destroy();
  }
}
