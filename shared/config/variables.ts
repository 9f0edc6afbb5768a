import type { z } from 'zod';
import { ConfigError } from './errors';

/**
 * Reads the variables of `schema` (a zod object of environment variables) from `source`, an empty
 * value counting as unset, and validates them once; an error names each variable and its value.
 * The small settings groups (scheduler tuning, batch versions, test timings) share it.
 */
export function parseVariables<Shape extends z.ZodRawShape>(schema: z.ZodObject<Shape>, source: NodeJS.ProcessEnv): z.output<z.ZodObject<Shape>> {
  const raw: Record<string, string | undefined> = {};
  for (const key of Object.keys(schema.shape)) raw[key] = source[key] === '' ? undefined : source[key];
  const parsed = schema.safeParse(raw);
  if (!parsed.success) {
    const lines = parsed.error.issues.map((issue) => `${String(issue.path[0])}=${JSON.stringify(raw[String(issue.path[0])])}: ${issue.message}`);
    throw new ConfigError(`invalid environment:\n  ${lines.join('\n  ')}`);
  }
  return parsed.data;
}
