import { createHash } from 'node:crypto';

/**
 * A node-postgres query config for a NAMED statement (issue 18): each connection parses and plans
 * the text once and then only binds and executes it (after five executions PostgreSQL may keep a
 * generic plan), instead of parsing and planning it at every execution. For the statements that
 * run per batch or per window: their text is fixed per policy, so the name is the text's hash and
 * one name never stands for two texts; `label` starts the name, so a trace (or a test's proxy
 * watching the wire, where only the name travels after the first execution) can tell which it is.
 * A connection pooler in transaction mode must support
 * prepared statements (PgBouncer 1.21+ with max_prepared_statements) for these to work through it.
 */
const names = new Map<string, string>();

export function prepared<V extends unknown[]>(label: string, text: string, values: V): { name: string; text: string; values: V } {
  const key = `${label}\n${text}`;
  let name = names.get(key);
  if (name === undefined) {
    // PostgreSQL keeps 63 bytes of a name: a longer one is cut, and two labels could then meet.
    if (!/^[a-z_]{1,31}$/.test(label)) throw new Error(`prepared statement label must be 1-31 of [a-z_], got ${JSON.stringify(label)}`);
    name = `reaper_${label}_${createHash('sha256').update(text).digest('hex').slice(0, 24)}`;
    // Texts are a few per policy; the bound only guards against a caller building texts from data.
    if (names.size < 1_000) names.set(key, name);
  }
  return { name, text, values };
}
