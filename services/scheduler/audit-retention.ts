import type { Logger } from 'pino';
import type { PolicySet } from '../../shared/config/policies';
import type { Pool } from '../../shared/db/pool';
import { auditPrune } from '../../shared/db/queries/audit';

/** How often each scheduler trims the audit trail, and how much one statement may delete. */
export const AUDIT_PRUNE_INTERVAL_MS = 5 * 60_000;
export const AUDIT_PRUNE_BATCH = 10_000;
/** Statements per policy per pass: a huge backlog of old rows is worked off over several passes. */
const AUDIT_PRUNE_MAX_STATEMENTS = 10;

/**
 * Keeps each audited policy's cleanup_audit rows to its `audit.retainDays`. Several schedulers may
 * prune at once: each statement deletes a bounded set of old rows, so they only share the work.
 */
export function startAuditRetention(deps: { pool: Pool; policies: PolicySet; log: Logger; intervalMs?: number }): { stop(): Promise<void> } {
  const audited = [...deps.policies.values()].filter((policy) => policy.audit?.enabled);
  let running: Promise<void> | null = null;
  const pass = async (): Promise<void> => {
    for (const policy of audited) {
      let pruned = 0;
      for (let statement = 0; statement < AUDIT_PRUNE_MAX_STATEMENTS; statement++) {
        const deleted = await auditPrune(deps.pool, policy.name, policy.audit!.retainDays, AUDIT_PRUNE_BATCH);
        pruned += deleted;
        if (deleted < AUDIT_PRUNE_BATCH) break;
      }
      if (pruned > 0) deps.log.info({ policy: policy.name, pruned, retainDays: policy.audit!.retainDays }, 'audit rows past retention deleted');
    }
  };
  const tick = (): void => {
    if (running || audited.length === 0) return;
    running = pass()
      .catch((error: Error) => deps.log.warn({ err: error.message }, 'audit retention pass failed; the next pass retries'))
      .finally(() => {
        running = null;
      });
  };
  const timer = setInterval(tick, deps.intervalMs ?? AUDIT_PRUNE_INTERVAL_MS);
  tick();
  return {
    async stop() {
      clearInterval(timer);
      await running;
    },
  };
}
