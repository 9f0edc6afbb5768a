import { z } from 'zod';
import { parseVariables } from '../../shared/config/variables';

/**
 * Scheduler timings that operators (and tests) may change, read from the environment once at
 * start-up and validated with zod; an error names the variable and its value.
 *
 * - REAPER_RUN_LEASE_MS (default 30000): how long a run belongs to one scheduler without a
 *   checkpoint or lease extension before another replica may take it over.
 * - REAPER_RUN_INCOMPLETE_AFTER_SECONDS (default 3600): a published run still missing receipts
 *   with no receipt written for this long ends `incomplete` (a batch was dead-lettered or lost).
 *   Long enough for a paused or rate-limited remote-delete backlog to keep making progress.
 * - REAPER_RUN_UNROUTABLE_FAIL_AFTER_SECONDS (default 60): a run whose publishes come back
 *   unroutable (work queue deleted, binding removed) for this long without a break fails.
 */
const tuningSchema = z.object({
  REAPER_RUN_LEASE_MS: z.coerce.number().int().min(500).max(3_600_000).default(30_000),
  REAPER_RUN_INCOMPLETE_AFTER_SECONDS: z.coerce.number().min(0.1).max(30 * 86_400).default(3_600),
  REAPER_RUN_UNROUTABLE_FAIL_AFTER_SECONDS: z.coerce.number().min(0.1).max(86_400).default(60),
});

export interface SchedulerTuning {
  runLeaseMs: number;
  incompleteAfterMs: number;
  unroutableFailAfterMs: number;
}

export function loadSchedulerTuning(source: NodeJS.ProcessEnv = process.env): SchedulerTuning {
  const values = parseVariables(tuningSchema, source);
  return {
    runLeaseMs: values.REAPER_RUN_LEASE_MS,
    incompleteAfterMs: values.REAPER_RUN_INCOMPLETE_AFTER_SECONDS * 1000,
    unroutableFailAfterMs: values.REAPER_RUN_UNROUTABLE_FAIL_AFTER_SECONDS * 1000,
  };
}
