import type { RowDeletePolicy } from '../../../shared/config/policies';
import { withTransaction } from '../../../shared/db/pool';
import { expiringRowsDeleteIfStillExpired, type ResolvedTarget } from '../../../shared/db/queries/expiring-rows';
import type { BatchHandler } from './types';

/**
 * row-delete: one transaction, one conditional DELETE over every item of the batch plus the batch
 * receipt. The database decides what is still expired; a renewed or confirmed row is a no-op.
 */
export function makeRowDeleteHandler(_policy: RowDeletePolicy, target: ResolvedTarget): BatchHandler {
  return async (batch, context) => {
    const outcome = await withTransaction(
      context.pool,
      (client) =>
        expiringRowsDeleteIfStillExpired(client, target, {
          batchId: batch.batchId,
          runId: batch.runId,
          policy: batch.policy,
          cutoff: batch.cutoff,
          items: batch.items,
          workerId: context.workerId,
        }),
      { beforeCommit: () => context.failpoint('before-commit') },
    );
    context.failpoint('after-commit');
    return {
      kind: 'done',
      deleted: outcome.deleted,
      noop: batch.items.length - outcome.deleted,
      duplicate: !outcome.receiptWritten,
    };
  };
}
