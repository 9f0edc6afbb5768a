import type { DeadLetterReason } from '../../shared/contracts/batch';

/**
 * What a policy handler says happened to a batch. The handler never touches the broker; `settle`
 * turns this into broker actions (docs/design.md invariant 4: ack only after commit).
 */
export type BatchResult =
  /** Committed. `duplicate`: this batch had been committed before (a redelivery), counted apart. */
  | { kind: 'done'; deleted: number; noop: number; duplicate: boolean; detail?: Record<string, number> }
  /** Durable state says "later": publish a copy to the delay tier for `delayMs`, then ack. */
  | { kind: 'retry'; delayMs: number; reason: string }
  /** The batch itself is wrong: publish it to the dead-letter queue with the reason, then ack. */
  | { kind: 'dead-letter'; reason: DeadLetterReason; detail: string }
  /** Outcome unknown (database or transport trouble): settle.ts backs off through a delay tier (acked after the copy's confirm), or gives it back to the broker while consumption pauses for an unreachable database. */
  | { kind: 'unknown'; reason: string; databaseUnavailable: boolean };
