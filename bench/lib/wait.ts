export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * Polls `probe` every `everyMs` until it returns a value other than undefined, or the deadline
 * passes (then it returns undefined: the caller decides whether that is a failure or a bounded
 * measurement).
 */
export async function pollUntil<T>(probe: () => Promise<T | undefined>, options: { deadline: number; everyMs: number }): Promise<T | undefined> {
  for (;;) {
    const value = await probe();
    if (value !== undefined) return value;
    if (Date.now() >= options.deadline) return undefined;
    await sleep(options.everyMs);
  }
}
