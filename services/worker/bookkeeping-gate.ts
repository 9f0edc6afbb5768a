import type { Pool } from '../../shared/db/pool';

/**
 * A worker's remote deliveries share its connection pool (REAPER_DB_POOL_SIZE, 4 by default) for
 * two kinds of statement: bookkeeping (recording a batch's operations in the ledger, reading its
 * place in line) and the rate's own path (the admission ask, the outcomes that free a concurrency
 * slot). When a scan's batches arrive together, eight deliveries' bookkeeping took every
 * connection and the batch at the head of the line waited for one to ask for its tokens, while
 * the admission bucket, which holds only what the rate brings in about 50 ms, threw its refill
 * away (bench figure 5 under three busy loops: 120-180 calls/s of 200 in the first seconds, the
 * bucket full in 13-30 % of samples with due operations unclaimed). So bookkeeping runs on at
 * most all but one of the pool's connections at a time: one is always left for the rate's path.
 */
export interface BookkeepingGate {
  run<T>(work: () => Promise<T>): Promise<T>;
}

const gates = new WeakMap<Pool, BookkeepingGate>();

/** The gate of this pool (one per pool: every remote policy's deliveries of a worker share it). */
export function bookkeepingGate(pool: Pool): BookkeepingGate {
  let gate = gates.get(pool);
  if (!gate) {
    gate = makeGate(Math.max(1, (pool.options.max ?? 10) - 1));
    gates.set(pool, gate);
  }
  return gate;
}

/** At most `slots` of the works at once; the others wait in arrival order. */
export function makeGate(slots: number): BookkeepingGate {
  let running = 0;
  const waiting: Array<() => void> = [];
  return {
    async run(work) {
      if (running >= slots) await new Promise<void>((resolve) => waiting.push(resolve));
      else running += 1;
      try {
        return await work();
      } finally {
        // The slot passes to the next waiter as it is, or is given back.
        const next = waiting.shift();
        if (next) next();
        else running -= 1;
      }
    },
  };
}
