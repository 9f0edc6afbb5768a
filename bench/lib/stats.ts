/** The median of the finite values (the mean of the middle two for an even count); NaN when there are none. */
export function median(values: readonly number[]): number {
  const sorted = [...values].filter((value) => Number.isFinite(value)).sort((a, b) => a - b);
  if (sorted.length === 0) return Number.NaN;
  const middle = Math.floor(sorted.length / 2);
  return sorted.length % 2 === 1 ? sorted[middle]! : (sorted[middle - 1]! + sorted[middle]!) / 2;
}

/**
 * The mean of the samples ([at ms, value]) in each whole second of [fromMs, toMs), in order; a
 * second with no sample has no mean and is left out (counted as 0 it would read as the best second
 * when a sample took longer than the second: the harm-signals probe's round trips).
 */
export function meansBySecond(samples: ReadonlyArray<readonly [number, number]>, fromMs: number, toMs: number): number[] {
  const means: number[] = [];
  for (let start = fromMs; start + 1000 <= toMs; start += 1000) {
    const slice = samples.filter(([at]) => at >= start && at < start + 1000);
    if (slice.length > 0) means.push(slice.reduce((sum, [, value]) => sum + value, 0) / slice.length);
  }
  return means;
}
