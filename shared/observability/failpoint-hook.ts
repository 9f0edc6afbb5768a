import type { FailpointName } from '../testing/failpoints';

/**
 * The product's side of the test-only crash points (shared/testing/failpoints.ts). The runtime
 * image leaves shared/testing out (infra/Dockerfile), so product code must not import it
 * statically: this hook is a no-op while REAPER_TEST_FAILPOINT is unset (every production
 * process) and loads the test module only when a test arms a point, then delegates every check to
 * it (its semantics: an unknown name is refused at every check, the armed one kills the process).
 * The variable set in an image without the module is refused loudly, never ignored.
 */
const VARIABLE = 'REAPER_TEST_FAILPOINT';

let check: ((name: FailpointName) => void) | undefined;

export function failpoint(name: FailpointName): void {
  if (check === undefined) {
    const value = process.env[VARIABLE];
    if (value === undefined || value === '') {
      check = () => {};
    } else {
      try {
        // Lazy on purpose: the module exists in the source tree and test runs, not in the runtime image.
        check = (require('../testing/failpoints') as typeof import('../testing/failpoints')).failpoint;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code !== 'MODULE_NOT_FOUND') throw error;
        throw new Error(`${VARIABLE} is test-only; this image has no failpoints (${VARIABLE}=${JSON.stringify(value)})`);
      }
    }
  }
  check(name);
}

/**
 * The test-only variables a process may be given only where the test module exists: the failpoint,
 * the batch-version cap and the test timings (shared/config/test-timings.ts; named here rather than
 * imported, so this hook loads no dependency: its unit test checks the two lists agree).
 */
export const TEST_ONLY_VARIABLES = [VARIABLE, 'REAPER_TEST_MAX_BATCH_VERSION', 'REAPER_TEST_RELAY_CLAIM_MS', 'REAPER_TEST_RELAY_UNROUTABLE_MAX_MS', 'REAPER_TEST_RELAY_EVENTS_PER_PASS', 'REAPER_TEST_OUTBOX_FULL_RETRY_MS', 'REAPER_TEST_BREAKER_RESET_MS', 'REAPER_TEST_RUN_RETRY_MAX_MS', 'REAPER_TEST_CONFIRM_TIMEOUT_MS'] as const;

/** Whether shared/testing is present (the source tree, test runs), not the runtime image. */
function testModulePresent(): boolean {
  try {
    require.resolve('../testing/failpoints');
    return true;
  } catch {
    return false;
  }
}

/**
 * At a service's start (issue 40): a test-only variable set where the test module is absent (the
 * runtime image) stops the process at once, naming it. Before, REAPER_TEST_FAILPOINT there failed
 * every batch a ready worker took (20 redeliveries in 35 ms, then dead-lettered), and
 * REAPER_TEST_MAX_BATCH_VERSION capped a production worker's batch versions.
 */
export function refuseTestOnlyVariables(environment: NodeJS.ProcessEnv = process.env, present: () => boolean = testModulePresent): void {
  const set = TEST_ONLY_VARIABLES.filter((name) => (environment[name] ?? '') !== '');
  if (set.length > 0 && !present()) {
    throw new Error(`${set.map((name) => `${name}=${JSON.stringify(environment[name])}`).join(', ')}: test-only, and this image has no test support: unset ${set.length > 1 ? 'them' : 'it'}`);
  }
}
