/**
 * Schedule windows (policy key `window: { start, end, timeZone }`): the wall-clock hours of a
 * time zone in which a policy may run and delete, like TiDB's tidb_ttl_job_schedule_window.
 * Pure functions of (window, now): the caller passes the clock (docs STYLE 15, time is an input).
 *
 * Wall-clock semantics, evaluated with Intl in the window's zone:
 *  - open while the local time of day t satisfies start <= t < end; when start > end the window
 *    crosses midnight (22:00-04:00): open while t >= start or t < end;
 *  - DST: on the day clocks go forward, a start inside the skipped hour opens at the jump (the
 *    first instant whose local time is past start); on the day clocks go back, the repeated hour
 *    counts twice (a window inside it opens twice). A window is never stretched or shortened by
 *    converting it to UTC once: every decision reads the local time at `now`.
 */

export interface ScheduleWindow {
  /** "HH:MM" or "HH:MM:SS", local time in `timeZone`. */
  start: string;
  end: string;
  /** An IANA zone name ("Europe/Berlin", "UTC"). */
  timeZone: string;
}

export type WindowState =
  /** closesAt null: the policy has no window (always open). */
  | { open: true; closesAt: Date | null }
  | { open: false; opensAt: Date };

const TIME_OF_DAY = /^([01]\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?$/;

/** Seconds since local midnight of "HH:MM[:SS]"; null when the text is not such a time. */
export function parseTimeOfDay(text: string): number | null {
  const match = TIME_OF_DAY.exec(text);
  if (!match) return null;
  return Number(match[1]) * 3600 + Number(match[2]) * 60 + Number(match[3] ?? 0);
}

/** Whether Intl knows `timeZone` as a zone (an IANA name or UTC). */
export function isKnownTimeZone(timeZone: string): boolean {
  try {
    formatterFor(timeZone);
    return true;
  } catch {
    // RangeError: Invalid time zone specified
    return false;
  }
}

const formatters = new Map<string, Intl.DateTimeFormat>();
function formatterFor(timeZone: string): Intl.DateTimeFormat {
  let formatter = formatters.get(timeZone);
  if (!formatter) {
    formatter = new Intl.DateTimeFormat('en-US', {
      timeZone,
      hourCycle: 'h23',
      year: 'numeric',
      month: '2-digit',
      day: '2-digit',
      hour: '2-digit',
      minute: '2-digit',
      second: '2-digit',
    });
    formatters.set(timeZone, formatter);
  }
  return formatter;
}

/** The local wall time at `instantMs`, written as if it were a UTC instant (ms, whole seconds). */
function localWallMs(instantMs: number, timeZone: string): number {
  const parts: Record<string, number> = {};
  for (const part of formatterFor(timeZone).formatToParts(new Date(instantMs))) {
    if (part.type !== 'literal') parts[part.type] = Number(part.value);
  }
  return Date.UTC(parts.year!, parts.month! - 1, parts.day!, parts.hour! % 24, parts.minute!, parts.second!);
}

/** The zone's offset from UTC at `instantMs` (ms; whole seconds). */
function offsetMs(instantMs: number, timeZone: string): number {
  const whole = Math.floor(instantMs / 1000) * 1000;
  return localWallMs(whole, timeZone) - whole;
}

const DAY_MS = 86_400_000;

/**
 * The first instant after `nowMs` whose local time of day in `timeZone` reaches `secondOfDay`
 * (a wall time that occurs twice counts at each occurrence; one inside a skipped hour at the jump).
 */
function nextWallTime(secondOfDay: number, timeZone: string, nowMs: number): Date {
  const today = localWallMs(nowMs, timeZone);
  const midnight = today - (today % DAY_MS);
  for (let day = 0; day <= 2; day++) {
    const wall = midnight + day * DAY_MS + secondOfDay * 1000;
    // The offsets in force around that wall time (two on a transition day).
    const offsets = [...new Set([offsetMs(wall - DAY_MS / 2, timeZone), offsetMs(wall, timeZone), offsetMs(wall + DAY_MS / 2, timeZone)])];
    const candidates = offsets.map((offset) => wall - offset).filter((instant) => localWallMs(instant, timeZone) === wall);
    if (candidates.length === 0) {
      // Skipped by a forward jump: the window opens at the jump, between the two readings.
      candidates.push(transitionBetween(Math.min(...offsets.map((o) => wall - o)), Math.max(...offsets.map((o) => wall - o)), timeZone));
    }
    const after = candidates.filter((instant) => instant > nowMs).sort((a, b) => a - b);
    if (after.length > 0) return new Date(after[0]!);
  }
  // Unreachable for any real zone (every day has each time of day, or a jump past it).
  throw new Error(`no local time ${secondOfDay}s in ${timeZone} within two days of ${new Date(nowMs).toISOString()}`);
}

/** The first whole second in (lo, hi] at which the zone's offset differs from its offset at lo. */
function transitionBetween(lo: number, hi: number, timeZone: string): number {
  const before = offsetMs(lo, timeZone);
  let low = Math.floor(lo / 1000);
  let high = Math.ceil(hi / 1000);
  while (high - low > 1) {
    const middle = Math.floor((low + high) / 2);
    if (offsetMs(middle * 1000, timeZone) === before) low = middle;
    else high = middle;
  }
  return high * 1000;
}

/** Whether `window` is open at `now`. */
export function windowIsOpen(window: ScheduleWindow, now: Date): boolean {
  const start = parseTimeOfDay(window.start)!;
  const end = parseTimeOfDay(window.end)!;
  const wall = localWallMs(now.getTime(), window.timeZone);
  const t = Math.floor((wall % DAY_MS) / 1000);
  return start < end ? t >= start && t < end : t >= start || t < end;
}

/** Open (until when) or closed (opening when) at `now`; no window is always open. */
export function windowStateAt(window: ScheduleWindow | undefined, now: Date): WindowState {
  if (!window) return { open: true, closesAt: null };
  if (windowIsOpen(window, now)) return { open: true, closesAt: nextWallTime(parseTimeOfDay(window.end)!, window.timeZone, now.getTime()) };
  return { open: false, opensAt: nextWallTime(parseTimeOfDay(window.start)!, window.timeZone, now.getTime()) };
}

/** "01:00-05:00 Europe/Berlin", for messages. */
export function describeWindow(window: ScheduleWindow): string {
  return `${window.start}-${window.end} ${window.timeZone}`;
}

/** The sentence status, the CLI and the worker print for a closed window. */
export function outsideWindowMessage(window: ScheduleWindow, opensAt: Date): string {
  return `outside window (${describeWindow(window)}), opens at ${opensAt.toISOString()}`;
}
