import { z } from 'zod';
import { FLEET_BATCH_VERSION, NEWEST_BATCH_VERSION, type BatchVersion } from '../contracts/batch';
import { parseVariables } from './variables';

/**
 * Which batch versions a process publishes and accepts, read from the environment once at start-up
 * (validated with zod; an error names the variable and its value). The ONE place both variables are read.
 *
 * - REAPER_BATCH_VERSION (schedulers and `--execute`): the version to publish, 1 or 2; default the
 *   newest the whole fleet accepts (FLEET_BATCH_VERSION). A version above 1 is published only while
 *   every consumer connected to the work queue announces it accepts it (services/scheduler/batch-version-gate.ts).
 * - REAPER_TEST_MAX_BATCH_VERSION (workers; tests only): caps the newest version this worker accepts
 *   and announces. `1` makes a worker of this release behave as the previous release did (it knew
 *   only version 1): the rolling-upgrade test starts its "old" workers with it. Never set in production.
 */
const versionSchema = z.coerce
  .number()
  .int()
  .min(1)
  .max(NEWEST_BATCH_VERSION, `this release knows batch versions 1 to ${NEWEST_BATCH_VERSION}`)
  .transform((value) => value as BatchVersion);

const batchVersionSchema = z.object({
  REAPER_BATCH_VERSION: versionSchema.default(FLEET_BATCH_VERSION),
  REAPER_TEST_MAX_BATCH_VERSION: versionSchema.default(NEWEST_BATCH_VERSION),
});

export interface BatchVersionConfig {
  /** What schedulers want to publish (the gate may hold them at an older one). */
  publish: BatchVersion;
  /** The newest version a worker accepts and announces. */
  highestAccepted: BatchVersion;
}

export function loadBatchVersionConfig(source: NodeJS.ProcessEnv = process.env): BatchVersionConfig {
  const values = parseVariables(batchVersionSchema, source);
  return { publish: values.REAPER_BATCH_VERSION, highestAccepted: values.REAPER_TEST_MAX_BATCH_VERSION };
}
