import type { Logger } from 'pino';
import type { PolicySet } from '../../shared/config/policies';
import type { Pool } from '../../shared/db/pool';
import { archivePrune } from '../../shared/db/queries/archive';
import { auditPrune } from '../../shared/db/queries/audit';

/** How often each scheduler trims the audit trail, and how much one statement may delete. */
export const AUDIT_PRUNE_INTERVAL_MS = 5 * 60_000;
export const AUDIT_PRUNE_BATCH = 10_000;
/** Statements per policy per pass: a huge backlog of old rows is worked off over several passes. */
const AUDIT_PRUNE_MAX_STATEMENTS = 10;

/** One kept trail of one policy: cleanup_audit (audit.retainDays) or cleanup_archive (archive.retainDays). */
interface Trail {
  what: 'audit' | 'archive';
  policy: string;
  retainDays: number;
  prune: typeof auditPrune;
}

function trailsOf(policies: PolicySet): Trail[] {
  return [...policies.values()].flatMap((policy) => [
    ...(policy.audit?.enabled ? [{ what: 'audit' as const, policy: policy.name, retainDays: policy.audit.retainDays, prune: auditPrune }] : []),
    ...(policy.kind === 'row-delete' && policy.archive?.enabled
      ? [{ what: 'archive' as const, policy: policy.name, retainDays: policy.archive.retainDays, prune: archivePrune }]
      : []),
  ]);
}

/**
 * Keeps each audited policy's cleanup_audit rows to its `audit.retainDays`, and each archived
 * policy's cleanup_archive rows to its `archive.retainDays`. Several schedulers may prune at once:
 * each statement deletes a bounded set of old rows, so they only share the work.
 */
export function startAuditRetention(deps: { pool: Pool; policies: PolicySet; log: Logger; intervalMs?: number }): { stop(): Promise<void> } {
  const trails = trailsOf(deps.policies);
  let running: Promise<void> | null = null;
  const pass = async (): Promise<void> => {
    for (const trail of trails) {
      let pruned = 0;
      for (let statement = 0; statement < AUDIT_PRUNE_MAX_STATEMENTS; statement++) {
        const deleted = await trail.prune(deps.pool, trail.policy, trail.retainDays, AUDIT_PRUNE_BATCH);
        pruned += deleted;
        if (deleted < AUDIT_PRUNE_BATCH) break;
      }
      if (pruned > 0) deps.log.info({ policy: trail.policy, pruned, retainDays: trail.retainDays }, `${trail.what} rows past retention deleted`);
    }
  };
  const tick = (): void => {
    if (running || trails.length === 0) return;
    running = pass()
      .catch((error: Error) => deps.log.warn({ err: error.message }, 'audit/archive retention pass failed; the next pass retries'))
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
