import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { validate as cronIsValid } from 'node-cron';
import { parse as parseYaml } from 'yaml';
import { z } from 'zod';
import { ConfigError } from './errors';
import { isKnownTimeZone, parseTimeOfDay } from '../schedule/window';

/**
 * The policies file: which tables reaper expires, how often it looks, and (for remote-delete) how
 * hard it may press the remote API. Validated once at start-up; unknown keys are refused so a typo
 * never silently turns a guard off.
 */

const identifier = z
  .string()
  .regex(/^[A-Za-z_][A-Za-z0-9_]*$/, 'must be a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*)');
const tableName = z
  .string()
  .regex(/^([A-Za-z_][A-Za-z0-9_]*\.)?[A-Za-z_][A-Za-z0-9_]*$/, 'must be "table" or "schema.table" of plain identifiers');
const cron = z
  .string()
  .refine((value) => [5, 6].includes(value.trim().split(/\s+/).length) && cronIsValid(value), {
    message: 'must be a valid cron expression of 5 fields, or 6 with seconds first',
  });
const guardValue = z.union([z.string(), z.number(), z.boolean()]);
const timeOfDay = z.string().refine((value) => parseTimeOfDay(value) !== null, { message: 'must be a time of day "HH:MM" (or "HH:MM:SS"), 00:00 to 23:59' });
/**
 * Schedule window (shared/schedule/window.ts): runs start and workers delete only while the local
 * time in `timeZone` is in [start, end); start > end crosses midnight. Absent: always open.
 */
const scheduleWindow = z
  .strictObject({
    start: timeOfDay,
    end: timeOfDay,
    timeZone: z.string().refine(isKnownTimeZone, { message: 'must be an IANA time zone Intl knows (e.g. "Europe/Berlin", "UTC")' }),
  })
  .refine((window) => window.start !== window.end, { message: 'start and end must differ (an empty or 24-hour window: leave `window` out)', path: ['end'] });

const common = {
  name: z.string().regex(/^[a-z0-9-]+$/, 'must match [a-z0-9-]+').max(100),
  schedule: cron,
  table: tableName,
  key: identifier,
  expiresAt: identifier,
  guard: z.record(identifier, guardValue).default({}),
  // 500 by the batch-size sweep (bench/): 1.6-1.8x the rows/s of 100, a message of about 47 KB.
  batchSize: z.number().int().min(1).max(1000).default(500),
  /**
   * Blast-radius brake: a run whose scan finds more candidates than either limit publishes nothing
   * and waits for `reaper approve`. Absent: no brake (docs/guardrails.md "Guardrails" says why).
   */
  limits: z
    .strictObject({
      maxPerRun: z.number().int().min(1).optional(),
      /** Of the rows that satisfy the guard (expired or not). */
      maxFractionPerRun: z.number().gt(0).max(1).optional(),
      /**
       * How far past the approved count an approved run may publish (0.1: 10 % more) before it
       * goes back to awaiting approval with the new count. Absent: DEFAULT_APPROVAL_TOLERANCE
       * (absent, not defaulted here, so the policy version of existing files is unchanged).
       */
      approvalTolerance: z.number().min(0).max(10).optional(),
    })
    .optional(),
  /** When the policy may run and delete: outside it no run starts and workers admit no deletion. */
  window: scheduleWindow.optional(),
  /** Audit trail: one cleanup_audit row per deletion, in the deleting statement; kept retainDays. */
  audit: z
    .strictObject({
      enabled: z.boolean().default(true),
      retainDays: z.number().int().min(1).max(3650).default(90),
    })
    .optional(),
  /**
   * Expiry events through the transactional outbox (docs/guardrails.md "Expiry events"): one event per
   * deletion (one cleanup_outbox row per batch holds them), in the deleting transaction, published by `reaper relay`. `maxOutbox`: past this
   * many unpublished events the policy's deletions pause (a broker outage only lets the outbox grow
   * up to here). Optional, not defaulted at the top: an absent key keeps the policy version unchanged.
   */
  events: z
    .strictObject({
      enabled: z.boolean().default(true),
      maxOutbox: z.number().int().min(1).max(100_000_000).default(100_000),
    })
    .optional(),
};

const rowDeletePolicy = z.strictObject({
  ...common,
  kind: z.literal('row-delete'),
  /**
   * Archive: the deleting statement copies each deleted row (to_jsonb) into cleanup_archive, kept
   * retainDays, so `reaper restore --run` can put a bad run back (README "Archive and restore").
   * Absent, not defaulted: existing files keep their policy version hash.
   */
  archive: z
    .strictObject({
      enabled: z.boolean().default(true),
      retainDays: z.number().int().min(1).max(3650).default(30),
    })
    .optional(),
  /**
   * Partition retirement (issue 44; docs/guardrails.md "Retiring partitions"): on a table range-
   * partitioned by `expiresAt` alone, a partition whose every row may be deleted under the run's
   * cutoff (expired, guard, no hold) is detached and kept in schema `reaper_retired` for
   * `quarantineDays`, then dropped by the scheduler; every other partition is left to the row path.
   * Whether the table is partitioned that way is checked against the catalog at start-up
   * (shared/db/queries/target.ts). Optional, not defaulted: an absent key keeps the policy version.
   */
  partitions: z
    .strictObject({
      retire: z.boolean(),
      quarantineDays: z.number().int('must be a whole number of days').min(0, 'must be 0 or more (days a retired partition is kept before it is dropped)').max(3650).default(7),
    })
    .optional(),
  /**
   * The global throttle: rows deleted per second across every worker together, and row-delete
   * statements running at once, held by the PostgreSQL admission controller (a batch takes tokens
   * for its item count), so adding workers never adds load. `burst`: rows the bucket holds
   * (default: one batch). Absent: unthrottled. Live changes: `reaper admission set`.
   * `adaptive` (issue 18; absent means true): the rate adapts to how PostgreSQL answers reaper's own
   * statements (shared/admission/adaptive.ts), at most rowsPerSecond when that is set; false: the
   * fixed rate only (or none). `law` (issue 41): which law steps the adaptive rate, 'load' (the
   * default: the others' presence and load) or 'harm' (the others' statement durations against
   * their own before reaper deleted, shared/admission/adaptive-harm.ts). Optional, not defaulted: an
   * absent key keeps the policy version.
   */
  admission: z
    .strictObject({
      rowsPerSecond: z.number().positive().max(10_000_000).optional(),
      concurrency: z.number().int().min(1).max(1000).optional(),
      burst: z.number().int().min(1).max(10_000_000).optional(),
      adaptive: z.boolean().optional(),
      law: z.enum(['load', 'harm']).optional(),
    })
    .optional(),
  /**
   * Replica-lag brake: no row-delete admission while a physical standby's replay lag is over
   * `maxReplicationLagSeconds`, or has been unknown (disconnected, not reporting) for longer than
   * `unknownLagGraceSeconds` (default 30). `standbys`: the application_names that count (default:
   * every physical walsender plus every inactive physical slot); a listed one not connected is
   * unknown. Logical walsenders (CDC) never count. See shared/db/queries/replication.ts.
   */
  brake: z
    .strictObject({
      maxReplicationLagSeconds: z.number().positive().max(86_400),
      standbys: z.array(z.string().min(1).max(63)).max(64).optional(),
      // Optional, not defaulted here: an absent key keeps the policy's version hash what it was.
      unknownLagGraceSeconds: z.number().min(0).max(86_400).optional(),
    })
    .optional(),
});

const remotePolicy = z.strictObject({
  ...common,
  kind: z.literal('remote-delete'),
  remote: z.strictObject({
    /** Absent for an HTTP API (remote.kind s3 is read by s3Policy). */
    kind: z.undefined().optional(),
    baseUrl: z.url({ protocol: /^https?$/ }),
    path: z.string().startsWith('/').includes('{id}', { message: 'must contain {id}' }),
    timeoutMs: z.number().int().min(1).max(120_000).default(5000),
    headers: z.record(z.string(), z.string()).default({}),
  }),
  admission: z
    .strictObject({
      ratePerSecond: z.number().positive().max(100_000),
      burst: z.number().int().min(1).max(100_000),
      concurrency: z.number().int().min(1).max(10_000),
    }),
  retry: z
    .strictObject({
      maxAttempts: z.number().int().min(1).max(1000).default(10),
    })
    .default({ maxAttempts: 10 }),
  /** After the remote confirms: set these columns on the row. Absent: the row is deleted. */
  markConfirmed: z.record(identifier, guardValue).optional(),
  /** How long a claimed operation belongs to one worker before another may take it over. */
  leaseMs: z.number().int().min(1000).max(3_600_000).default(30_000),
});

/**
 * Object storage as a remote (docs/guardrails.md "Object storage (S3)"): a remote-delete policy whose
 * `remote.kind` is `s3` deletes objects with DeleteObjects requests of up to `maxKeysPerRequest`
 * keys, credentials from the AWS SDK's default chain (never in this file, never logged).
 * `admission` counts requests AND keys (S3 guides 3,500 DELETE requests per second per prefix).
 * The parsed policy's admission also carries `ratePerSecond` (= keysPerSecond: the ledger's unit is
 * one key) and `burst` (= requestKeys: the keys one request carries at most), so the parts every
 * remote-delete policy shares (sweeper, pause, plan, `reaper admission set --rate`) read keys.
 */
export const S3_MAX_KEYS_PER_REQUEST = 1000; // DeleteObjects takes at most 1,000 keys (S3 API)
const s3Remote = z.strictObject({
  kind: z.literal('s3'),
  bucket: z
    .string()
    .regex(/^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/, 'must be an S3 bucket name: 3 to 63 of a-z 0-9 . - starting and ending with a letter or digit'),
  /** The object key of a row: `{id}` is the row's key text (not encoded: S3 keys are UTF-8 strings). */
  key: z.string().min(1).max(1024).includes('{id}', { message: 'must contain {id}' }),
  region: z.string().regex(/^[a-z0-9-]+$/, 'must be a region name such as "eu-west-1"').optional(),
  endpoint: z.url({ protocol: /^https?$/ }).optional(),
  forcePathStyle: z.boolean().optional(),
  maxKeysPerRequest: z.number().int().min(1).max(S3_MAX_KEYS_PER_REQUEST).default(S3_MAX_KEYS_PER_REQUEST),
  /** current: delete the current version (a delete marker on a versioned bucket); all: every version of the key. */
  versions: z.enum(['current', 'all']).default('current'),
  /** Bounds one whole request (with `versions: all`: the listing too). */
  timeoutMs: z.number().int().min(1).max(120_000).default(10_000),
});
const s3Policy = z
  .strictObject({
    ...common,
    kind: z.literal('remote-delete'),
    remote: s3Remote,
    admission: z.strictObject({
      requestsPerSecond: z.number().positive().max(100_000),
      keysPerSecond: z.number().positive().max(10_000_000),
      /** DeleteObjects requests in flight across every worker together. */
      concurrency: z.number().int().min(1).max(10_000),
    }),
    retry: z.strictObject({ maxAttempts: z.number().int().min(1).max(1000).default(10) }).default({ maxAttempts: 10 }),
    markConfirmed: z.record(identifier, guardValue).optional(),
    leaseMs: z.number().int().min(1000).max(3_600_000).default(30_000),
  })
  .superRefine((policy, ctx) => {
    if (policy.admission.requestsPerSecond > policy.admission.keysPerSecond) {
      ctx.addIssue({
        code: 'custom',
        path: ['admission', 'requestsPerSecond'],
        message: `must not exceed admission.keysPerSecond (${policy.admission.keysPerSecond}): every request carries at least one key; got ${policy.admission.requestsPerSecond}`,
      });
    }
  })
  .transform((policy) => ({
    ...policy,
    admission: { ...policy.admission, ratePerSecond: policy.admission.keysPerSecond, burst: s3RequestKeys(policy.admission.keysPerSecond, policy.remote.maxKeysPerRequest) },
  }));

/**
 * Keys one request carries at most: maxKeysPerRequest, but never more than a second's worth of
 * keys, and split evenly when a second holds more than one full request (keysPerSecond 1500 with
 * 1000 keys a request: 750, two requests a second, not 1000 + 500).
 */
export function s3RequestKeys(keysPerSecond: number, maxKeysPerRequest: number): number {
  const perSecond = Math.max(1, Math.floor(keysPerSecond));
  return Math.max(1, Math.floor(perSecond / Math.ceil(perSecond / maxKeysPerRequest)));
}

/**
 * A policies-file entry: a remote-delete policy whose remote.kind is `s3` is read as an object
 * storage policy, every other entry by kind. (Not one discriminated union: both remote-delete
 * shapes share `kind`; dispatching here keeps each shape's errors its own.)
 */
const policyEntry = z.unknown().transform((entry, ctx): Policy => {
  const remoteKind = isRecord(entry) && entry.kind === 'remote-delete' && isRecord(entry.remote) ? entry.remote.kind : undefined;
  if (remoteKind !== undefined && remoteKind !== 's3') {
    ctx.addIssue({ code: 'custom', path: ['remote', 'kind'], message: `must be "s3" (or absent for an HTTP API); got ${JSON.stringify(remoteKind)}` });
    return z.NEVER;
  }
  const parsed = (remoteKind === 's3' ? s3Policy : policySchema).safeParse(entry);
  if (parsed.success) return parsed.data;
  for (const issue of parsed.error.issues) ctx.addIssue({ ...issue });
  return z.NEVER;
});

function isRecord(value: unknown): value is Record<string, unknown> {
  return value !== null && typeof value === 'object' && !Array.isArray(value);
}

/** limits.approvalTolerance when the file does not set it: an approved run publishes at most 10 % more than was counted. */
export const DEFAULT_APPROVAL_TOLERANCE = 0.1;

/** Whether a policy retires whole partitions (partitions.retire; off when the key is absent). */
export function retiresPartitions(policy: Policy): policy is RowDeletePolicy & { partitions: { retire: true; quarantineDays: number } } {
  return policy.kind === 'row-delete' && policy.partitions?.retire === true;
}

/** Whether a policy writes expiry events (events.enabled; off when the key is absent). */
export function eventsEnabled(policy: Policy): boolean {
  return policy.events?.enabled === true;
}

/** leaseMs >= remote.timeoutMs + this (docs/configuration.md "Configuration"): the margin a claim needs beyond the request itself. */
export const LEASE_MARGIN_MS = 10_000;

const policySchema = z.discriminatedUnion('kind', [rowDeletePolicy, remotePolicy]);

const policiesFileSchema = z
  .strictObject({ policies: z.array(policyEntry).min(1) })
  .superRefine((file, ctx) => {
    const seen = new Set<string>();
    file.policies.forEach((policy, index) => {
      if (seen.has(policy.name)) {
        ctx.addIssue({ code: 'custom', path: ['policies', index, 'name'], message: `duplicate policy name "${policy.name}"` });
      }
      seen.add(policy.name);
      if (policy.kind === 'remote-delete' && policy.leaseMs < policy.remote.timeoutMs + LEASE_MARGIN_MS) {
        // The lease must cover the whole claim, not only the request: the wait for a late grant's
        // token, a pool checkout, the request (up to timeoutMs), the commit and the ledger write.
        // A lease that can run out while the call is still live would count it as free concurrency
        // and hand the operation to a second worker while the first still waits for its answer.
        ctx.addIssue({
          code: 'custom',
          path: ['policies', index, 'leaseMs'],
          message: `must be at least remote.timeoutMs (${policy.remote.timeoutMs}) + ${LEASE_MARGIN_MS} ms = ${policy.remote.timeoutMs + LEASE_MARGIN_MS}; got ${policy.leaseMs}`,
        });
      }
    });
  });

export type Policy = z.infer<typeof policySchema> | S3DeletePolicy;
export type RowDeletePolicy = z.infer<typeof rowDeletePolicy>;
export type RemoteDeletePolicy = z.infer<typeof remotePolicy>;
/** A remote-delete policy against object storage (remote.kind s3). */
export type S3DeletePolicy = z.output<typeof s3Policy>;
/** Either remote-delete shape: what the ledger, the sweeper and admission share. */
export type AnyRemoteDeletePolicy = RemoteDeletePolicy | S3DeletePolicy;
/** True for a remote-delete policy against object storage. */
export function isS3Policy(policy: Policy): policy is S3DeletePolicy {
  return policy.kind === 'remote-delete' && policy.remote.kind === 's3';
}
export type PolicySet = ReadonlyMap<string, Policy>;

/**
 * The version of a policy's definition: a short hash of its validated form (keys sorted), stored
 * on each run and each audit row, so "which version of the rule deleted this" has an answer.
 */
export function policyVersion(policy: Policy): string {
  const canonical = (value: unknown): unknown =>
    Array.isArray(value)
      ? value.map(canonical)
      : value !== null && typeof value === 'object'
        ? Object.fromEntries(Object.keys(value).sort().map((key) => [key, canonical((value as Record<string, unknown>)[key])]))
        : value;
  // Headers carry credentials: rotating a token is not a change of the rule.
  const rule = policy.kind === 'remote-delete' && policy.remote.kind !== 's3' ? { ...policy, remote: { ...policy.remote, headers: Object.keys(policy.remote.headers).sort() } } : policy;
  return createHash('sha256').update(JSON.stringify(canonical(rule))).digest('hex').slice(0, 16);
}

/** Reads a secret file named by `${file:/path}`; tests pass their own. */
export type SecretFileReader = (filePath: string) => string;
const readSecretFile: SecretFileReader = (filePath) => readFileSync(filePath, 'utf8');

/**
 * Replaces `${NAME}` in every string value with the environment's value, and `${file:/path}` with
 * the content of that file without its trailing newline (a mounted Secret: the remote API's token
 * never passes through the environment, like every other secret). A missing variable or an
 * unreadable file is an error naming the key.
 */
function substituteEnvironment(value: unknown, source: NodeJS.ProcessEnv, where: string, readFile: SecretFileReader = readSecretFile): unknown {
  if (typeof value === 'string') {
    return value.replace(/\$\{(?:file:([^}]+)|([A-Za-z_][A-Za-z0-9_]*))\}/g, (_match, file: string | undefined, name: string | undefined) => {
      if (file !== undefined) {
        if (!file.startsWith('/')) throw new ConfigError(`${where}: \${file:${file}} must name an absolute path`);
        try {
          return readFile(file).replace(/\r?\n$/, '');
        } catch (error) {
          throw new ConfigError(`${where}: cannot read \${file:${file}} (${(error as Error).message})`);
        }
      }
      const found = source[name!];
      if (found === undefined) throw new ConfigError(`${where}: environment variable ${name} is not set`);
      return found;
    });
  }
  if (Array.isArray(value)) return value.map((item, index) => substituteEnvironment(item, source, `${where}[${index}]`, readFile));
  if (value !== null && typeof value === 'object') {
    return Object.fromEntries(
      Object.entries(value).map(([key, item]) => [key, substituteEnvironment(item, source, `${where}.${key}`, readFile)]),
    );
  }
  return value;
}

/** Parses policies from YAML text. `origin` names the file in error messages. */
export function parsePolicies(text: string, origin: string, source: NodeJS.ProcessEnv = process.env, readFile?: SecretFileReader): PolicySet {
  let document: unknown;
  try {
    document = parseYaml(text);
  } catch (error) {
    throw new ConfigError(`${origin}: not valid YAML (${(error as Error).message})`);
  }
  const substituted = substituteEnvironment(document, source, origin, readFile);
  const parsed = policiesFileSchema.safeParse(substituted);
  if (!parsed.success) {
    const lines = parsed.error.issues.map((issue) => {
      const at = issue.path.length > 0 ? issue.path.join('.') : '(top level)';
      const value = valueAt(substituted, issue.path);
      const shown = value === undefined ? '' : ` (got ${JSON.stringify(value)})`;
      return `${at}: ${issue.message}${shown}`;
    });
    throw new ConfigError(`${origin}: invalid policies file:\n  ${lines.join('\n  ')}`);
  }
  return new Map(parsed.data.policies.map((policy) => [policy.name, policy]));
}

export function loadPolicies(filePath: string, source: NodeJS.ProcessEnv = process.env): PolicySet {
  return parsePolicies(readPoliciesFile(filePath), filePath, source);
}

function readPoliciesFile(filePath: string): string {
  try {
    return readFileSync(filePath, 'utf8');
  } catch (error) {
    throw new ConfigError(`REAPER_POLICIES=${filePath}: cannot read the file (${(error as Error).message})`);
  }
}

/**
 * The policy names a policies file declares, validated as at start-up but with every `${NAME}` and
 * `${file:...}` answered by a placeholder: what depends on the names alone (`reaper topology`, its
 * KEDA triggers and definitions) runs where the deployment's variables and secret files are not,
 * e.g. on the machine that renders its overlay.
 */
export function loadPolicyNames(filePath: string): string[] {
  const placeholder = 'http://placeholder.invalid';
  const anyVariable = new Proxy({}, { get: () => placeholder }) as NodeJS.ProcessEnv;
  return [...parsePolicies(readPoliciesFile(filePath), filePath, anyVariable, () => placeholder).keys()];
}

/** Looks a policy up by name, with an error that lists the known ones. */
export function requirePolicy(policies: PolicySet, name: string): Policy {
  const policy = policies.get(name);
  if (!policy) {
    throw new ConfigError(`unknown policy "${name}"; known: ${[...policies.keys()].join(', ') || '(none)'}`);
  }
  return policy;
}

function valueAt(document: unknown, at: readonly PropertyKey[]): unknown {
  let current: unknown = document;
  for (const step of at) {
    if (current === null || typeof current !== 'object') return undefined;
    current = (current as Record<PropertyKey, unknown>)[step];
  }
  return typeof current === 'object' && current !== null ? undefined : current;
}
