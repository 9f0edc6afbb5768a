import { AssertionError } from 'node:assert';

/**
 * Polls `probe` until it returns a value that is not undefined/false, or fails after `timeoutMs`
 * with `what` and the last value seen. The alternative to sleeping in a test.
 *
 * A probe says "not yet" by returning undefined or false. An assertion failing inside the probe
 * (node:assert's AssertionError) is a verdict, not "not yet": it fails the wait at once with its
 * own message, rather than being retried until the deadline and reported as a late timeout. Any
 * other error (a connection refused while a server restarts, a fetch before a port listens) is
 * retried, and the last one is named if the deadline passes.
 */
export async function eventually<T>(
  what: string,
  probe: () => Promise<T | undefined | false> | T | undefined | false,
  options: { timeoutMs?: number; intervalMs?: number; describe?: () => Promise<unknown> | unknown } = {},
): Promise<T> {
  const timeoutMs = options.timeoutMs ?? 20_000;
  const intervalMs = options.intervalMs ?? 100;
  const deadline = Date.now() + timeoutMs;
  let lastError: unknown;
  for (;;) {
    try {
      const value = await probe();
      if (value !== undefined && value !== false) return value;
    } catch (error) {
      if (error instanceof AssertionError) throw error;
      lastError = error;
    }
    if (Date.now() > deadline) {
      const state = options.describe ? JSON.stringify(await options.describe()) : '';
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${state ? `; state: ${state}` : ''}${lastError ? `; last error: ${String(lastError)}` : ''}`);
    }
    await new Promise((resolve) => setTimeout(resolve, intervalMs));
  }
}
