import type { Logger } from 'pino';

/** /readyz: how often the database is asked, and how long an answer may take. */
export const DATABASE_PROBE_MS = 1_000;
export const DATABASE_PROBE_TIMEOUT_MS = 2_000;

export interface DatabaseProbe {
  /** Whether the latest question was answered in time (false until the first answer). */
  answers(): boolean;
  stop(): void;
}

/**
 * The database's part of /readyz ("database reachable"), asked in the background every
 * DATABASE_PROBE_MS so that /readyz answers at once from the latest probe: `ask` must answer within
 * DATABASE_PROBE_TIMEOUT_MS. One question at a time; the scheduler and the relay ask it.
 */
export function startDatabaseProbe(ask: () => Promise<unknown>, log: Logger): DatabaseProbe {
  let answers = false;
  let probing = false;
  const probe = (): void => {
    if (probing) return;
    probing = true;
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no answer within ${DATABASE_PROBE_TIMEOUT_MS} ms`)), DATABASE_PROBE_TIMEOUT_MS);
    });
    Promise.race([ask(), timeout])
      .then(() => {
        if (!answers) log.info('database answers');
        answers = true;
      })
      .catch((error: Error) => {
        if (answers) log.warn({ err: error.message }, 'database does not answer; not ready');
        answers = false;
      })
      .finally(() => {
        clearTimeout(timer);
        probing = false;
      });
  };
  probe();
  const interval = setInterval(probe, DATABASE_PROBE_MS);
  return { answers: () => answers, stop: () => clearInterval(interval) };
}
