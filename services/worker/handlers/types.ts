import type { Logger } from 'pino';
import type { Env } from '../../../shared/config/env';
import type { BatchV1 } from '../../../shared/contracts/batch';
import type { Pool } from '../../../shared/db/pool';
import type { Metrics } from '../../../shared/observability/metrics';
import type { BatchResult } from '../results';

export interface HandlerContext {
  pool: Pool;
  workerId: string;
  log: Logger;
  metrics: Metrics;
  /** Broker deliveries of this message so far (1 on first delivery): transport, not cleanup, attempts. */
  deliveryCount: number;
  /** Test-only crash points (REAPER_FAILPOINT): kills the process when `name` is the one set. */
  failpoint: (name: NonNullable<Env['failpoint']>) => void;
  failpointArmed: (name: NonNullable<Env['failpoint']>) => boolean;
}

/** A policy handler: a validated batch in, a result out. It never acks, nacks or publishes. */
export type BatchHandler = (batch: BatchV1, context: HandlerContext) => Promise<BatchResult>;
