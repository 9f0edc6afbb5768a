import type { Db } from '../pool';

/**
 * Batch receipts (cleanup_batches) for handlers that do not write theirs inside the deleting
 * statement (remote-delete writes it once every operation of the batch is finished). Returns
 * false when the receipt existed: the batch had been completed before.
 */
export async function batchesRecordReceipt(
  db: Db,
  receipt: { batchId: string; runId: string; policy: string; items: number; deleted: number; workerId: string },
): Promise<boolean> {
  const result = await db.query(
    `INSERT INTO cleanup_batches (batch_id, run_id, policy, items, deleted, noop, worker_id)
     VALUES ($1, $2, $3, $4::int, $5::int, $4::int - $5::int, $6) ON CONFLICT (batch_id) DO NOTHING`,
    [receipt.batchId, receipt.runId, receipt.policy, receipt.items, receipt.deleted, receipt.workerId],
  );
  return result.rowCount === 1;
}
