import nodeTest = require('node:test');

/**
 * On Node 20, preloaded into every test file's process by test/run.js (`--require`: Node's runner
 * passes its execArgv on to the process it starts for each file). It gives every test and every
 * hook a timeout, so a test that waits forever fails with its own name.
 *
 * Why: on Node 20 `--test-timeout` bounds each FILE (the file is killed and reported as one
 * failure, without the name of the test that hung, and without its `after` hooks). From Node 22 it
 * bounds each test and hook, and run.js passes it instead of this preload (which would make the
 * wrapper, not the test file, the `location` Node reports for a test). An explicit `timeout` wins.
 *
 * Suites (`describe`) get none on purpose: a suite's timeout bounds all of its tests together.
 */
export const DEFAULT_TEST_TIMEOUT_MS = 120_000;

export function testTimeoutMs(env: NodeJS.ProcessEnv = process.env): number {
  const text = env.REAPER_TEST_TIMEOUT_MS;
  if (text === undefined || text === '') return DEFAULT_TEST_TIMEOUT_MS;
  const value = Number(text);
  if (!Number.isInteger(value) || value <= 0) throw new Error(`REAPER_TEST_TIMEOUT_MS must be a positive whole number of milliseconds, got ${JSON.stringify(text)}`);
  return value;
}

type AnyFunction = (...args: unknown[]) => unknown;

/** `options` with the timeout added when it has none (an explicit timeout wins). */
function withTimeout(options: unknown, timeout: number): object {
  if (options === null || typeof options !== 'object') return { timeout };
  return 'timeout' in options && options.timeout !== undefined ? options : { ...options, timeout };
}

/**
 * test([name][, options][, fn]): the options (made or completed) go before the function, and the
 * function is reached through contextual() so the context's own t.test / t.after are bounded too.
 */
function testArgs(args: unknown[], timeout: number): unknown[] {
  const fnAt = args.findIndex((arg) => typeof arg === 'function');
  const head = fnAt >= 0 ? args.slice(0, fnAt) : args;
  const tail = fnAt >= 0 ? [contextual(args[fnAt] as AnyFunction, timeout), ...args.slice(fnAt + 1)] : [];
  const optionsAt = head.findIndex((arg) => arg !== null && typeof arg === 'object');
  const options = withTimeout(head[optionsAt], timeout);
  return [...(optionsAt >= 0 ? head.map((arg, index) => (index === optionsAt ? options : arg)) : [...head, options]), ...tail];
}

function wrapTest(original: AnyFunction, timeout: number): AnyFunction {
  const wrapped = function (this: unknown, ...args: unknown[]) {
    return original.apply(this, testArgs(args, timeout));
  };
  // test.skip / test.todo / test.only keep working, bounded too (a todo test runs).
  for (const key of ['skip', 'todo', 'only'] as const) {
    const variant = (original as unknown as Record<string, AnyFunction | undefined>)[key];
    if (typeof variant === 'function') Object.assign(wrapped, { [key]: (...args: unknown[]) => variant(...testArgs(args, timeout)) });
  }
  return wrapped;
}

/** before/after/beforeEach/afterEach(fn[, options]), as functions or as the context's methods. */
function wrapHook(original: AnyFunction, timeout: number): AnyFunction {
  return function (this: unknown, fn: unknown, options?: unknown) {
    return original.call(this, typeof fn === 'function' ? contextual(fn as AnyFunction, timeout) : fn, withTimeout(options, timeout));
  };
}

/**
 * A test's or hook's function that, when called, first bounds the methods of the context it is
 * given (TestContext is not exported: its prototype is reached through the first context seen).
 * The length stays the original's: Node calls a function of two parameters with a `done` callback.
 */
function contextual(fn: AnyFunction, timeout: number): AnyFunction {
  const wrapped = function (this: unknown, ...args: unknown[]) {
    const context = args[0];
    if (context !== null && typeof context === 'object') boundContextMethods(Object.getPrototypeOf(context) as Record<string, unknown>, timeout);
    return fn.apply(this, args);
  };
  Object.defineProperty(wrapped, 'length', { value: fn.length });
  return wrapped;
}

const bounded = new WeakSet<object>();
function boundContextMethods(prototype: Record<string, unknown>, timeout: number): void {
  if (bounded.has(prototype)) return;
  bounded.add(prototype);
  if (typeof prototype.test === 'function') prototype.test = wrapTest(prototype.test as AnyFunction, timeout);
  for (const hook of ['before', 'after', 'beforeEach', 'afterEach'] as const) {
    if (typeof prototype[hook] === 'function') prototype[hook] = wrapHook(prototype[hook] as AnyFunction, timeout);
  }
}

/**
 * Replaces test/it and the four hooks on node:test's exports. Compiled test files call them as
 * properties (`(0, node_test_1.test)(...)`), so the replacement is what they call.
 */
export function installTestTimeouts(timeout = testTimeoutMs()): void {
  const exports = nodeTest as unknown as Record<string, AnyFunction>;
  if ((exports as { reaperTimeout?: number }).reaperTimeout !== undefined) return;
  const originals = { test: exports.test!, it: exports.it!, before: exports.before!, after: exports.after!, beforeEach: exports.beforeEach!, afterEach: exports.afterEach! };
  exports.test = wrapTest(originals.test, timeout);
  exports.it = wrapTest(originals.it, timeout);
  for (const hook of ['before', 'after', 'beforeEach', 'afterEach'] as const) exports[hook] = wrapHook(originals[hook], timeout);
  Object.assign(exports, { reaperTimeout: timeout });
}

installTestTimeouts();
