/**
 * Headers a republished copy of a message keeps. The broker's own bookkeeping (delivery count,
 * death records) and any `drop`ped keys are not ours to copy: a copy carrying a stale
 * x-delivery-count would look redelivered on its first delivery.
 */
const BROKER_HEADERS = ['x-delivery-count', 'x-death', 'x-first-death-exchange', 'x-first-death-queue', 'x-first-death-reason'];

export function headersForRepublish(headers: Record<string, unknown> | undefined, drop: readonly string[] = []): Record<string, unknown> {
  const skipped = new Set([...BROKER_HEADERS, ...drop]);
  return Object.fromEntries(Object.entries(headers ?? {}).filter(([key]) => !skipped.has(key)));
}

/**
 * Header of a delay-tier copy: how many deliveries of the batch failed before it (its earlier
 * copies and their redeliveries). A copy is a new message whose x-delivery-count starts again, so
 * the delivery limit counts this plus the copy's own deliveries. `reaper dlq requeue` drops it.
 */
export const FAILURES_HEADER = 'x-reaper-failures';
