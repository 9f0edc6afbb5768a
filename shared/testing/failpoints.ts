/**
 * Test-only crash points. A crash test names ONE point in the environment variable
 * REAPER_TEST_FAILPOINT; when a process reaches that point it kills itself with SIGKILL, exactly as
 * a machine dying there would. Nothing else changes: an unarmed point (every point in production)
 * is a comparison of two strings and returns, and an armed one never returns. So the code path a
 * crash test exercises is the one production runs, up to the kill.
 *
 * Read here and nowhere else, once per process, and deliberately NOT part of the validated
 * production configuration (shared/config/env.ts): it is not an operator setting. A name that is
 * not a known point is refused at the first check, so a typo in a test fails loudly instead of
 * silently never firing.
 */
export const TEST_FAILPOINT_VARIABLE = 'REAPER_TEST_FAILPOINT';

/** The worker's points (services/worker/handlers). */
export const WORKER_FAILPOINTS = [
  /** row-delete: the group's statement ran inside its transaction; COMMIT is not sent yet. */
  'before-commit',
  /** row-delete: COMMIT answered; the messages are not acked yet. */
  'after-commit',
  /** remote-delete: the remote answered; the outcome is not recorded yet. */
  'after-remote-call',
] as const;

/** The scheduler's points, in the order a window reaches them (services/scheduler/run-executor.ts). */
export const SCHEDULER_FAILPOINTS = [
  /** The window's batches are handed to the broker and the first confirm came back; the window is not confirmed as a whole. */
  'scheduler-after-publish',
  /** Every batch of the window is confirmed by the broker; the checkpoint (cursor, batch ids) is not written. */
  'scheduler-after-confirm',
  /** The window's checkpoint is committed; the next window is not scanned yet. */
  'scheduler-after-checkpoint',
] as const;

export type FailpointName = (typeof WORKER_FAILPOINTS)[number] | (typeof SCHEDULER_FAILPOINTS)[number];

const KNOWN: ReadonlySet<string> = new Set<string>([...WORKER_FAILPOINTS, ...SCHEDULER_FAILPOINTS]);

let armed: string | null | undefined;

function armedPoint(): string | null {
  if (armed === undefined) {
    const value = process.env[TEST_FAILPOINT_VARIABLE];
    armed = value === undefined || value === '' ? null : value;
    if (armed !== null && !KNOWN.has(armed)) {
      throw new Error(`${TEST_FAILPOINT_VARIABLE}=${JSON.stringify(armed)} names no failpoint (known: ${[...KNOWN].join(', ')})`);
    }
  }
  return armed;
}

/** Kills this process (SIGKILL) when `name` is the armed point; otherwise returns at once. */
export function failpoint(name: FailpointName): void {
  if (armedPoint() !== name) return;
  // Written synchronously: a SIGKILLed process loses what an asynchronous logger still buffers.
  process.stderr.write(`${JSON.stringify({ level: 40, msg: 'failpoint reached: killing this process', failpoint: name })}\n`);
  process.kill(process.pid, 'SIGKILL');
}
