import type { Db } from '../../shared/db/pool';
import { runsFindByIdPrefix, runsIdNeighbours } from '../../shared/db/queries/runs';
import { NotFoundError, UsageError } from './common';

/**
 * Run ids on the command line and on the screen. `reaper runs` shows an id by its first 8 hex
 * digits (more where another run shares them), as git and docker do; every command that takes a
 * run id (`run`, `execute`, `approve`, `reject`, `replay --run`, `audit --run`, `restore --run`)
 * accepts the whole uuid or any prefix of it of at least 8 hex digits that only one run has.
 */

/** Hex digits of a run id that `runs` shows, and that a prefix must have at least. */
export const SHORT_RUN_ID_DIGITS = 8;
/** Matching ids an ambiguous prefix lists. */
const LISTED_MATCHES = 10;

/** A run id as given on the command line, checked: `hex` is its digits, lowercase, hyphens left out. */
export interface RunIdArgument {
  /** `runId` for the positional argument, `--run` for the option: named in every message. */
  argument: string;
  value: string;
  hex: string;
}

/**
 * Checks a run id or prefix before anything connects: 8 to 32 hex digits, with the uuid's
 * hyphens where a uuid has them or with none (`0c2b3a4d`, `0c2b3a4d-91`, the whole uuid). A usage
 * error (exit 2) names the argument and the value otherwise.
 */
export function runIdArgument(argument: string, value: string): RunIdArgument {
  const lower = value.toLowerCase();
  const hex = lower.replace(/-/g, '');
  const laidOut = !lower.includes('-') || lower === asUuid(hex.padEnd(32, '0')).slice(0, lower.length);
  if (!/^[0-9a-f]{8,32}$/.test(hex) || !laidOut) {
    throw new UsageError(`${argument}: "${value}" is not a run id: give the uuid, or at least its first ${SHORT_RUN_ID_DIGITS} hex digits as \`reaper runs\` shows them`);
  }
  return { argument, value, hex };
}

/**
 * The one run `id` names (its whole uuid). No run: the not-found error (exit 1); more than one: a
 * usage error (exit 2) listing them, so the operator can give more digits.
 */
export async function resolveRunId(db: Db, id: RunIdArgument): Promise<string> {
  // A whole id is used as given, looked up by the command itself: a run's audit rows and archive
  // may name a run that cleanup_runs no longer (or never) holds, and `audit --run <uuid>` answered
  // for those before prefixes existed (guardrails-rows reads a batch's audit by its run id).
  if (id.hex.length === 32) return asUuid(id.hex);
  const found = await runsFindByIdPrefix(db, id.hex, LISTED_MATCHES + 1);
  if (found.length === 1) return found[0]!;
  const named = id.argument.startsWith('-') ? `${id.argument}: ` : '';
  if (found.length === 0) throw new NotFoundError(`${named}no run ${id.value}`);
  const listed = found.slice(0, LISTED_MATCHES).join(', ');
  const more = found.length > LISTED_MATCHES ? `, and more` : '';
  throw new UsageError(`${id.argument}: "${id.value}" is the start of more than one run id: ${listed}${more}; give more of the id`);
}

/**
 * For each run id, the shortest prefix of at least 8 hex digits that no other run shares (git's
 * abbreviation rule), from the ids next to it in id order.
 */
export async function shortRunIds(db: Db, runIds: readonly string[]): Promise<Map<string, string>> {
  const shown = new Map<string, string>();
  for (const { runId, before, after } of await runsIdNeighbours(db, runIds)) {
    const shared = Math.max(sharedDigits(runId, before), sharedDigits(runId, after));
    const digits = Math.min(32, Math.max(SHORT_RUN_ID_DIGITS, shared + 1));
    shown.set(runId, asUuid(runId.replace(/-/g, '')).slice(0, uuidLength(digits)));
  }
  return shown;
}

/** How many leading hex digits two ids have in common (0 with none to compare). */
function sharedDigits(a: string, b: string | null): number {
  if (b === null) return 0;
  const x = a.replace(/-/g, '');
  const y = b.replace(/-/g, '');
  let n = 0;
  while (n < x.length && x[n] === y[n]) n += 1;
  return n;
}

/** 32 hex digits in the uuid's 8-4-4-4-12 layout. */
function asUuid(hex: string): string {
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/** Characters of the uuid text that hold its first `digits` hex digits. */
function uuidLength(digits: number): number {
  return digits + [8, 12, 16, 20].filter((boundary) => digits > boundary).length;
}
