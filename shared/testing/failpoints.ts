/**
 * Test-only crash points. A crash test names ONE point in the environment variable
 * REAPER_TEST_FAILPOINT; when a process reaches that point it kills itself with SIGKILL, exactly as
 * a machine dying there would. Nothing else changes: an unarmed point (every point in production)
 * is a comparison of two strings and returns, and an armed one never returns. So the code path a
 * crash test exercises is the one production runs, up to the kill.
 *
 * Read here and nowhere else, once per process, and deliberately NOT part of the validated
 * production configuration (shared/config/env.ts): it is not an operator setting. A name that is
 * not a known point is refused at every check, so a typo in a test fails loudly instead of
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
  /** Partition retirement (services/scheduler/partition-retirement.ts): the 'detaching' row is committed; nothing is detached yet. */
  'partition-after-begin',
  /** DETACH ... CONCURRENTLY returned; the table is not re-checked, moved nor recorded yet. */
  'partition-after-detach',
  /** A retirement's transaction (plain detach or re-check, the move, the audit) ran and retires the partition; COMMIT is not sent yet. */
  'partition-before-commit',
  /** The drop of a retired partition whose quarantine is over ran (state dropped, DROP TABLE); COMMIT is not sent yet. */
  'partition-drop-before-commit',
] as const;

/** `reaper relay`'s points, in the order a batch of outbox rows reaches them (services/relay/relay.ts). */
export const RELAY_FAILPOINTS = [
  /** The batch of outbox rows is taken (locked); nothing of it is published yet. */
  'relay-before-publish',
  /** Every event of the batch is confirmed by the broker; the outbox rows are not deleted yet. */
  'relay-after-confirm',
] as const;

/** The CLI's points (services/cli). */
export const CLI_FAILPOINTS = [
  /** `reaper restore`: a batch of rows is restored and committed; the next batch is not started. */
  'restore-after-batch',
] as const;

export type FailpointName = (typeof WORKER_FAILPOINTS)[number] | (typeof SCHEDULER_FAILPOINTS)[number] | (typeof RELAY_FAILPOINTS)[number] | (typeof CLI_FAILPOINTS)[number];

const KNOWN: ReadonlySet<string> = new Set<string>([...WORKER_FAILPOINTS, ...SCHEDULER_FAILPOINTS, ...RELAY_FAILPOINTS, ...CLI_FAILPOINTS]);

/** The variable as read once: null when unarmed; `unknown` holds the refusal of a name that is no point. */
let armed: { point: string | null; unknown: Error | null } | undefined;

function armedPoint(): string | null {
  if (armed === undefined) {
    const value = process.env[TEST_FAILPOINT_VARIABLE];
    const point = value === undefined || value === '' ? null : value;
    const unknown =
      point !== null && !KNOWN.has(point)
        ? new Error(`${TEST_FAILPOINT_VARIABLE}=${JSON.stringify(point)} names no failpoint (known: ${[...KNOWN].join(', ')})`)
        : null;
    armed = { point, unknown };
  }
  // Thrown at EVERY check, not only the first: a caller that caught the first refusal (a
  // handler's catch-all, a retry) must not run on as if no point were armed.
  if (armed.unknown) throw armed.unknown;
  return armed.point;
}

/** Kills this process (SIGKILL) when `name` is the armed point; otherwise returns at once. */
export function failpoint(name: FailpointName): void {
  if (armedPoint() !== name) return;
  // Written synchronously: a SIGKILLed process loses what an asynchronous logger still buffers.
  process.stderr.write(`${JSON.stringify({ level: 40, msg: 'failpoint reached: killing this process', failpoint: name })}\n`);
  process.kill(process.pid, 'SIGKILL');
}
