import { z } from 'zod';

/**
 * The batch message, versions 1 and 2 (docs/design.md). A consumer of version N accepts every
 * version up to N. Decoding runs the checks in a fixed order so every rejection has exactly one reason.
 *
 * Version 2 adds `policyVersion`: the hash of the policy definition the scan used
 * (shared/config/policies.ts policyVersion), so a worker can tell, and count, batches scanned under
 * a rule other than the one it runs. Nothing else changed: both decode to the same body.
 */
export type BatchVersion = 1 | 2;
/** Every version this code can decode (and encode). */
export const KNOWN_BATCH_VERSIONS: readonly BatchVersion[] = [1, 2];
export const NEWEST_BATCH_VERSION: BatchVersion = 2;
/**
 * What a scheduler publishes when REAPER_BATCH_VERSION is not set: the newest version the whole
 * fleet accepts. The previous release's workers accept only 1, so 1 until every worker runs a
 * release that knows 2 (docs/operating.md "Operating": the upgrade runbook); then the next release raises it.
 */
export const FLEET_BATCH_VERSION: BatchVersion = 1;
export const MAX_BATCH_ITEMS = 1000;
export const MAX_MESSAGE_BYTES = 1024 * 1024;
/** Longest id a message may carry: 1000 items of this size still fit in MAX_MESSAGE_BYTES. */
export const MAX_ID_LENGTH = 512;

/** ISO 8601 in UTC with exactly six fractional digits: microseconds survive the trip. */
const MICROSECOND_ISO = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$/;
const isoMicros = z
  .string()
  .regex(MICROSECOND_ISO, 'must be UTC ISO 8601 with six fractional digits, e.g. 2026-11-29T20:00:00.000000Z')
  .refine((value) => isRealInstant(value), 'is not a real date and time');

/**
 * 2026-13-45 matches the pattern but is no date. Checked with arithmetic, not a Date round trip:
 * this runs for every item of every batch (a Date per item was half of decoding time).
 */
function isRealInstant(value: string): boolean {
  const year = Number(value.slice(0, 4));
  const month = Number(value.slice(5, 7));
  const day = Number(value.slice(8, 10));
  const hour = Number(value.slice(11, 13));
  const minute = Number(value.slice(14, 16));
  const second = Number(value.slice(17, 19));
  if (month < 1 || month > 12 || day < 1 || hour > 23 || minute > 59 || second > 59) return false;
  const leap = (year % 4 === 0 && year % 100 !== 0) || year % 400 === 0;
  const daysInMonth = [31, leap ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][month - 1]!;
  return day <= daysInMonth;
}

export const batchItemSchema = z.strictObject({
  id: z.string().min(1).max(MAX_ID_LENGTH),
  observedExpiry: isoMicros,
});

const batchBody = {
  runId: z.uuid(),
  batchId: z.string().min(1).max(200),
  policy: z.string().regex(/^[a-z0-9-]+$/),
  cutoff: isoMicros,
  items: z.array(batchItemSchema).min(1).max(MAX_BATCH_ITEMS),
};

export const batchV1Schema = z.strictObject({ version: z.literal(1), ...batchBody });
/** Version 2: version 1 plus the hash of the policy definition the scan used (16 hex digits). */
export const batchV2Schema = z.strictObject({
  version: z.literal(2),
  ...batchBody,
  policyVersion: z.string().regex(/^[0-9a-f]{16}$/, 'must be 16 lower-case hex digits (the policy definition hash)'),
});

export type BatchV1 = z.infer<typeof batchV1Schema>;
export type BatchV2 = z.infer<typeof batchV2Schema>;
/** A batch as it travels, in any known version. */
export type Batch = BatchV1 | BatchV2;
export type BatchItem = z.infer<typeof batchItemSchema>;

/** Why a message was dead-lettered; the exact strings of the `x-reaper-reason` header. */
export type DeadLetterReason =
  | 'invalid-json'
  | 'invalid-message'
  | 'unsupported-version'
  | 'unknown-policy'
  | 'too-large'
  | 'delivery-limit'
  | 'rejected';

/**
 * A decoded batch: `batch` is the version-1 body every handler takes, whatever version arrived
 * (a handler that keeps and re-publishes a batch, like the remote ledger's carriers, so always
 * re-publishes version 1, which every worker accepts); what a newer version adds travels beside it.
 */
export type DecodeResult =
  | { ok: true; batch: BatchV1; version: BatchVersion; policyVersion: string | null }
  | { ok: false; reason: DeadLetterReason; detail: string };

/**
 * Checks, in order: size, JSON, envelope (an object with an integer version), version, schema,
 * each id at most once. `highestVersion` is the newest version this consumer accepts (default:
 * every version this code knows); a newer one is `unsupported-version`, whatever else is wrong.
 * The policy is checked by the caller, which knows the configured policies.
 */
export function decodeBatch(content: Buffer, options: { highestVersion?: BatchVersion } = {}): DecodeResult {
  const highest = options.highestVersion ?? NEWEST_BATCH_VERSION;
  if (content.length > MAX_MESSAGE_BYTES) {
    return { ok: false, reason: 'too-large', detail: `message is ${content.length} bytes; the limit is ${MAX_MESSAGE_BYTES}` };
  }
  let document: unknown;
  try {
    document = JSON.parse(content.toString('utf8'));
  } catch (error) {
    return { ok: false, reason: 'invalid-json', detail: (error as Error).message };
  }
  if (document === null || typeof document !== 'object' || Array.isArray(document)) {
    return { ok: false, reason: 'invalid-message', detail: 'message must be a JSON object' };
  }
  const version = (document as { version?: unknown }).version;
  if (typeof version !== 'number' || !Number.isInteger(version) || version < 1) {
    return { ok: false, reason: 'invalid-message', detail: `version: must be a positive integer (got ${JSON.stringify(version)})` };
  }
  if (version > highest) {
    return {
      ok: false,
      reason: 'unsupported-version',
      detail: `version ${version} is newer than this worker understands (${highest})`,
    };
  }
  const parsed = (version === 2 ? batchV2Schema : batchV1Schema).safeParse(document);
  if (!parsed.success) {
    const detail = parsed.error.issues
      .slice(0, 5)
      .map((issue) => `${issue.path.join('.') || '(message)'}: ${issue.message}`)
      .join('; ');
    return { ok: false, reason: 'invalid-message', detail };
  }
  const duplicate = firstDuplicateId(parsed.data.items);
  if (duplicate) {
    return {
      ok: false,
      reason: 'invalid-message',
      detail: `items.${duplicate.second}.id: ${JSON.stringify(duplicate.id)} appears more than once (also items.${duplicate.first}); one batch names each row once`,
    };
  }
  if (parsed.data.version === 2) {
    const { policyVersion, ...body } = parsed.data;
    return { ok: true, batch: { ...body, version: 1 }, version: 2, policyVersion };
  }
  return { ok: true, batch: parsed.data, version: 1, policyVersion: null };
}

/**
 * An id named twice in one batch is no batch the scheduler makes (keys are unique), and downstream
 * it would act twice on one row in one statement (PostgreSQL refuses that with 21000 on every
 * delivery, until the delivery limit): it is invalid, said once, at decode.
 */
function firstDuplicateId(items: readonly BatchItem[]): { id: string; first: number; second: number } | null {
  const seen = new Map<string, number>();
  for (const [index, item] of items.entries()) {
    const first = seen.get(item.id);
    if (first !== undefined) return { id: item.id, first, second: index };
    seen.set(item.id, index);
  }
  return null;
}

/**
 * At least the encoded size of any batch of these items for this policy, whatever its run id,
 * batch id (at most 200 characters) and version, without encoding it: the scheduler measures a
 * page exactly (JSON.stringify) only when this is over MAX_MESSAGE_BYTES, which with ordinary keys
 * it never is (encoding every page twice was 6% of the scheduler's CPU; issue 18). Each item is
 * `{"id":"…","observedExpiry":"…"},` (30 bytes) plus at most 6 bytes per UTF-16 unit of its two
 * strings (an escaped control character, `\u001f`, is the longest form of one unit; a surrogate
 * pair is 4 bytes of UTF-8 for two units). The envelope's field names and fixed-size values
 * (version, run id, cutoff, batch id, policy version) take under 512 bytes.
 */
export function batchBytesAtMost(policy: string, items: readonly BatchItem[]): number {
  let bytes = 512 + 6 * policy.length;
  for (const item of items) bytes += 30 + 6 * (item.id.length + item.observedExpiry.length);
  return bytes;
}

/** Encodes a batch in its own version: a v1 batch is written exactly as before version 2 existed. */
export function encodeBatch(batch: Batch): Buffer {
  return Buffer.from(JSON.stringify(batch), 'utf8');
}

/**
 * Batch ids are the run id plus a zero-padded sequence, and, when a scheduler took the run over
 * from one that died, the claim number: the new owner's pages may differ from what the old one
 * published after its last checkpoint, and an id must never name two different sets of rows.
 */
export function makeBatchId(runId: string, sequence: number, claim = 1): string {
  return `${runId}:${String(sequence).padStart(6, '0')}${claim > 1 ? `-c${claim}` : ''}`;
}
