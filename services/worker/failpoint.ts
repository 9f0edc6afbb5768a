/**
 * Test-only crash points. The crash tests set REAPER_FAILPOINT on a worker process they mean to
 * kill; this is the one place that reads it, and it is not part of the production configuration
 * (shared/config/env.ts does not know it: a deployment cannot set it by accident through a
 * validated setting, and infra tests check no manifest sets it).
 *
 * A failpoint only kills the process where the production code already is. It never changes
 * what runs: the code around a failpoint is the same whether it is armed or not.
 */
export type FailpointName = 'before-commit' | 'after-commit' | 'after-remote-call';

const NAMES: readonly FailpointName[] = ['before-commit', 'after-commit', 'after-remote-call'];

/** Read once, at start-up. An unknown name is refused so a typo in a test never silently passes. */
export function readFailpoint(source: NodeJS.ProcessEnv = process.env): FailpointName | undefined {
  const value = source['REAPER_FAILPOINT'];
  if (value === undefined || value === '') return undefined;
  if (!(NAMES as readonly string[]).includes(value)) throw new Error(`REAPER_FAILPOINT=${JSON.stringify(value)}: must be one of ${NAMES.join(', ')}`);
  return value as FailpointName;
}

/** A function that SIGKILLs this process at the armed failpoint and does nothing at the others. */
export function makeFailpoint(armed: FailpointName | undefined, onReached: (name: FailpointName) => void): (name: FailpointName) => void {
  return (name) => {
    if (armed !== name) return;
    onReached(name);
    process.kill(process.pid, 'SIGKILL');
  };
}
