import type { Db } from '../pool';

/**
 * Webhook signatures already used (cleanup_webhook_signatures). Called inside the transaction that
 * records the webhook's work, so a request that fails (and is rolled back) can be sent again,
 * while one that took effect is never taken twice. Returns false when the signature was seen.
 */
export async function webhookSignaturesRecordIfNew(
  db: Db,
  seen: { signature: string; policy: string; timestampSeconds: number; keepSeconds: number },
): Promise<boolean> {
  const result = await db.query(
    `INSERT INTO cleanup_webhook_signatures (signature, policy, expires_at)
     VALUES ($1, $2, to_timestamp($3::float8) + make_interval(secs => $4::float8))
     ON CONFLICT (signature) DO NOTHING`,
    [seen.signature, seen.policy, seen.timestampSeconds, seen.keepSeconds],
  );
  return result.rowCount === 1;
}

/**
 * Removes up to `limit` signatures whose window has closed. Rows another transaction is pruning
 * are skipped, not waited for: pruning never delays a webhook. Returns how many were removed.
 */
export async function webhookSignaturesDeleteExpired(db: Db, limit = 100): Promise<number> {
  const result = await db.query(
    `DELETE FROM cleanup_webhook_signatures WHERE signature IN (
       SELECT signature FROM cleanup_webhook_signatures WHERE expires_at < now()
       ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)`,
    [limit],
  );
  return result.rowCount ?? 0;
}
