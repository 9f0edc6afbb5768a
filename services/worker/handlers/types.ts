import type { Logger } from 'pino';
import type { BatchV1 } from '../../../shared/contracts/batch';
import type { Pool } from '../../../shared/db/pool';
import type { Metrics } from '../../../shared/observability/metrics';
import type { FailpointName } from '../../../shared/testing/failpoints';
import type { BatchResult } from '../results';

export interface HandlerContext {
  pool: Pool;
  workerId: string;
  log: Logger;
  metrics: Metrics;
  /** Broker deliveries of this message so far (1 on first delivery): transport, not cleanup, attempts. */
  deliveryCount: number;
  /** Test-only crash points (shared/testing/failpoints.ts): kills the process when `name` is the armed one, else does nothing. */
  failpoint: (name: FailpointName) => void;
}

/** A policy handler: a validated batch in, a result out. It never acks, nacks or publishes. */
export type BatchHandler = (batch: BatchV1, context: HandlerContext) => Promise<BatchResult>;
