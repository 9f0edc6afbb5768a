import { z } from 'zod';
import { parseVariables } from './variables';

/**
 * Test-only timings (issue 43): fixed waits of the services that a test may shorten, so it waits
 * on the event it checks rather than on a production timer. Read from the environment once per
 * process and validated with zod (an error names the variable and its value); unset, each is the
 * production value, which stays the constant beside the code that uses it. Like the failpoints,
 * every service refuses to start with one of them set in the runtime image (TEST_ONLY_VARIABLES
 * in shared/observability/failpoint-hook.ts). Never set in production.
 *
 * - REAPER_TEST_RELAY_CLAIM_MS: how long a relay pass's claim keeps other relays off its outbox
 *   rows (production RELAY_CLAIM_MS, 15 s): how long a killed relay's rows wait for another relay.
 * - REAPER_TEST_RELAY_UNROUTABLE_MAX_MS: the longest wait of the relay before it tries a routing
 *   key whose events were unroutable again (production RELAY_UNROUTABLE_MAX_MS, 30 s; the wait starts at
 *   2 s, or at this value when shorter, and doubles up to it).
 * - REAPER_TEST_RELAY_EVENTS_PER_PASS: the events one relay pass claims (production
 *   RELAY_EVENTS_PER_PASS, 2,000): a test whose bound is in passes (a row committed behind a pass,
 *   an unroutable key's wait per pass) sees ten passes in 2,000 events instead of 20,000.
 * - REAPER_TEST_OUTBOX_FULL_RETRY_MS: the delay a batch of a policy paused by its full outbox waits
 *   before it asks again (production OUTBOX_FULL_RETRY_MS, 10 s).
 * - REAPER_TEST_BREAKER_RESET_MS: how long an HTTP remote's open circuit refuses calls before a
 *   trial call (production DEFAULT_BREAKER.resetTimeoutMs in shared/remote/client.ts, 10 s).
 * - REAPER_TEST_RUN_RETRY_MAX_MS: the longest wait of a scheduler's backoff after a retryable run
 *   error (production RETRY_MAX_MS in services/scheduler/run-executor.ts, 10 s; the backoff starts
 *   at 0.5 s and doubles up to it).
 * - REAPER_TEST_CONFIRM_TIMEOUT_MS: how long a publish waits for the broker's confirm before it
 *   fails and its window is retried (production CONFIRM_TIMEOUT_MS in shared/amqp/publisher.ts,
 *   10 s): a test of a blocked broker sees the timeout and the retry without sitting out 10 s.
 */
const timingsSchema = z.object({
  REAPER_TEST_RELAY_CLAIM_MS: z.coerce.number().int().min(500).max(3_600_000).optional(),
  REAPER_TEST_RELAY_UNROUTABLE_MAX_MS: z.coerce.number().int().min(100).max(600_000).optional(),
  REAPER_TEST_RELAY_EVENTS_PER_PASS: z.coerce.number().int().min(1).max(1_000_000).optional(),
  REAPER_TEST_OUTBOX_FULL_RETRY_MS: z.coerce.number().int().min(100).max(600_000).optional(),
  REAPER_TEST_BREAKER_RESET_MS: z.coerce.number().int().min(100).max(600_000).optional(),
  REAPER_TEST_RUN_RETRY_MAX_MS: z.coerce.number().int().min(500).max(600_000).optional(),
  REAPER_TEST_CONFIRM_TIMEOUT_MS: z.coerce.number().int().min(500).max(600_000).optional(),
});

/** The variables (each also in TEST_ONLY_VARIABLES, shared/observability/failpoint-hook.ts: the runtime image refuses them). */
export const TEST_TIMING_VARIABLES = Object.keys(timingsSchema.shape) as ReadonlyArray<keyof typeof timingsSchema.shape>;

export interface TestTimings {
  /** undefined: the production value. */
  relayClaimMs: number | undefined;
  relayUnroutableMaxMs: number | undefined;
  relayEventsPerPass: number | undefined;
  outboxFullRetryMs: number | undefined;
  breakerResetMs: number | undefined;
  runRetryMaxMs: number | undefined;
  confirmTimeoutMs: number | undefined;
}

export function loadTestTimings(source: NodeJS.ProcessEnv = process.env): TestTimings {
  const values = parseVariables(timingsSchema, source);
  return {
    relayClaimMs: values.REAPER_TEST_RELAY_CLAIM_MS,
    relayUnroutableMaxMs: values.REAPER_TEST_RELAY_UNROUTABLE_MAX_MS,
    relayEventsPerPass: values.REAPER_TEST_RELAY_EVENTS_PER_PASS,
    outboxFullRetryMs: values.REAPER_TEST_OUTBOX_FULL_RETRY_MS,
    breakerResetMs: values.REAPER_TEST_BREAKER_RESET_MS,
    runRetryMaxMs: values.REAPER_TEST_RUN_RETRY_MAX_MS,
    confirmTimeoutMs: values.REAPER_TEST_CONFIRM_TIMEOUT_MS,
  };
}

let loaded: TestTimings | undefined;

/** This process's test timings, read once (a service reads them at start: services/cli/services.ts). */
export function testTimings(): TestTimings {
  loaded ??= loadTestTimings();
  return loaded;
}
