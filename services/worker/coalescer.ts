/**
 * Gathers work items that arrive close together into groups (issue 12, coalesced deletes). A
 * submitted item waits for the current turn of the event loop to end (every message amqplib
 * parsed from the same socket read arrives in that turn) and, while `maxGroups` groups are already
 * running, for one of them to finish: so under load, the deliveries a worker has in hand (within
 * its prefetch) go out together, and with nothing else in hand a single item goes out at once.
 * Beside a running group a new one starts only with `minItemsBeside` items in hand: when work
 * trickles in (a queue the workers keep empty), two groups side by side would otherwise each carry
 * a few items, paying a statement and a transaction for each few; fewer wait for the running group
 * to end and then go out together.
 *
 * `run` answers one result per item, in order; if it throws, every item of its group gets that
 * error (the caller's safe path). It is also told when the group's oldest item was submitted
 * (performance.now()): the time spent queued here counts toward that item's bounded hold
 * (docs/design.md invariant 18). The coalescer knows nothing of SQL or AMQP.
 */
export interface Coalescer<T, R> {
  submit(item: T): Promise<R>;
}

export function makeCoalescer<T, R>(options: {
  maxGroups: number;
  maxItems: number;
  /**
   * Beside a running group, a new one starts only with at least this many items; fewer wait for a
   * group to finish (they never wait for anything else). Default 1.
   */
  minItemsBeside?: number;
  run: (items: T[], oldestSubmittedAt: number) => Promise<R[]>;
}): Coalescer<T, R> {
  const minItemsBeside = Math.max(1, options.minItemsBeside ?? 1);
  const pending: Array<{ item: T; submittedAt: number; resolve: (result: R) => void; reject: (error: unknown) => void }> = [];
  let running = 0;
  let scheduled = false;

  function schedule(): void {
    if (scheduled) return;
    scheduled = true;
    setImmediate(pump);
  }

  function pump(): void {
    scheduled = false;
    while (pending.length > 0 && running < options.maxGroups) {
      if (running > 0 && pending.length < minItemsBeside) return; // the running group's end pumps again
      const group = pending.splice(0, options.maxItems);
      running += 1;
      options
        .run(group.map((entry) => entry.item), group[0]!.submittedAt)
        .then(
          (results) => {
            if (results.length !== group.length) throw new Error(`group of ${group.length} answered ${results.length} results (a bug)`);
            group.forEach((entry, index) => entry.resolve(results[index]!));
          },
          (error: unknown) => group.forEach((entry) => entry.reject(error)),
        )
        .catch((error: unknown) => group.forEach((entry) => entry.reject(error)))
        .finally(() => {
          running -= 1;
          if (pending.length > 0) schedule();
        });
    }
  }

  return {
    submit(item) {
      return new Promise<R>((resolve, reject) => {
        pending.push({ item, submittedAt: performance.now(), resolve, reject });
        schedule();
      });
    },
  };
}
