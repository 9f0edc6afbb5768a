import type { ObjectIdentifier, S3Client, S3ClientConfig } from '@aws-sdk/client-s3';
import type { S3DeletePolicy } from '../config/policies';
import { parseRetryAfter } from './client';

/**
 * The SDK, loaded on first use: about a third of a second of CPU (the SDK and its @smithy
 * dependencies) at the start of every process that imports this module and never talks to object
 * storage: each row-delete worker, each `reaper` CLI command.
 */
function sdk(): typeof import('@aws-sdk/client-s3') {
  return require('@aws-sdk/client-s3') as typeof import('@aws-sdk/client-s3');
}

/**
 * Object storage as a remote (docs/guardrails.md "Object storage (S3)"): DeleteObjects requests of many keys,
 * sent with @aws-sdk/client-s3. Credentials come from the SDK's default chain (environment, web
 * identity / IRSA, shared files, instance metadata): nothing here reads, stores or logs them.
 *
 * The SDK's own retries are off (maxAttempts 1): every retry is the ledger's, after the claim's
 * re-check, counted in attempt_count. A request never throws: every failure is an outcome.
 *
 * Classification (docs/design.md "Object storage calls"):
 *  - per key, in a 200 answer: Deleted -> deleted; Errors with a retryable code (InternalError,
 *    SlowDown, ...) -> retryable; any other code (AccessDenied, an Object Lock refusal) -> rejected;
 *  - whole request: 503 SlowDown or 429 -> throttled (the policy-wide block); other 5xx, timeouts,
 *    network errors -> uncertain (retried with the same keys: deleting an absent key succeeds);
 *    other 4xx (NoSuchBucket, AccessDenied on the bucket) -> rejected for every key.
 */

export type S3KeyResult =
  /** Every version asked for is gone; `versionIds` are those deleted (null: the current version of `versions: current`). */
  | { kind: 'deleted'; versionIds: Array<string | null> }
  /** Kept for review, never retried (AccessDenied, Object Lock). `deletedVersionIds`: versions that went before the refusal. */
  | { kind: 'rejected'; code: string; message: string; deletedVersionIds: string[] }
  /** Retried with the same operation after a backoff. */
  | { kind: 'retryable'; code: string; message: string; deletedVersionIds: string[] };

export type S3RequestOutcome =
  | { kind: 'answered'; results: Map<string, S3KeyResult>; requests: number }
  | { kind: 'throttled'; status: number; code: string; retryAfterMs: number | null }
  | { kind: 'uncertain'; reason: string }
  | { kind: 'rejected'; status: number; code: string; reason: string };

export interface ObjectStorageClient {
  /**
   * Deletes the given object keys (distinct) in one DeleteObjects request (more with `versions: all`: see below).
   * `onSend` is called once, as the first DeleteObjects is handed to the HTTP handler: after the
   * SDK has serialized, checksummed and signed it. A caller pacing requests holds the request there
   * until its moment (the request leaves when the returned promise resolves) and learns when it
   * really left; a throw or rejection fails the request as uncertain before anything is sent.
   */
  deleteKeys(objectKeys: readonly string[], options?: { onSend?: () => Promise<void> | void }): Promise<S3RequestOutcome>;
  /**
   * At start-up: resolves the region and the credentials through the SDK's chain (a missing region
   * or credentials is a start-up error, not a failure of every request), so the first request is
   * not slowed by it (a late first request would bunch with the next at the store). Never logs them.
   */
  warmUp(): Promise<void>;
}

/** Per-key error codes that are worth the same operation again (S3 "Error responses"); any other is rejected. */
export const RETRYABLE_KEY_CODES: ReadonlySet<string> = new Set(['InternalError', 'SlowDown', 'ServiceUnavailable', 'RequestTimeout', 'OperationAborted', 'NoResult', 'RequestFailed']);

/** Whole-request answers that block the policy (S3 asks to slow down). */
const THROTTLING_CODES: ReadonlySet<string> = new Set(['SlowDown', 'Throttling', 'ThrottlingException', 'TooManyRequests', 'TooManyRequestsException', 'RequestLimitExceeded']);

/** What the DeleteObjects requests of one exchange answered (deleteEntries). */
interface EntriesAnswer {
  deleted: Array<{ key: string; versionId: string | null }>;
  errors: Array<{ key: string; versionId: string | null; code: string; message: string }>;
  /** A request after the first failed: the object keys of its entries and of those after it, and how it failed. */
  unsent: { keys: ReadonlySet<string>; failure: Exclude<S3RequestOutcome, { kind: 'answered' }> } | null;
}

/** DeleteObjects takes at most this many entries (S3 API limit): `versions: all` splits beyond it. */
const ENTRIES_PER_DELETE = 1000;
/** ListObjectVersions calls of one request running at once (`versions: all`). */
const LIST_CONCURRENCY = 8;

/** The object key for a row's key text: `remote.key` with `{id}` replaced (S3 keys are UTF-8, sent as they are). */
export function objectKeyFor(template: string, id: string): string {
  return template.replaceAll('{id}', id);
}

interface SdkErrorShape {
  name?: string;
  Code?: string;
  message?: string;
  $metadata?: { httpStatusCode?: number };
  $response?: { headers?: Record<string, string | undefined> };
  code?: string;
}

/** A thrown SDK or network error as an outcome of the whole request. */
export function classifyRequestError(error: unknown, now = Date.now()): Exclude<S3RequestOutcome, { kind: 'answered' }> {
  const e = (error ?? {}) as SdkErrorShape;
  const status = e.$metadata?.httpStatusCode;
  const code = e.Code ?? e.name ?? 'Error';
  if (status === 429 || (status === 503 && THROTTLING_CODES.has(code)) || (status !== undefined && THROTTLING_CODES.has(code))) {
    const header = e.$response?.headers?.['retry-after'] ?? null;
    return { kind: 'throttled', status, code, retryAfterMs: parseRetryAfter(header, now) };
  }
  if (status === undefined || status >= 500 || status === 408) {
    // No HTTP answer (a timeout, a reset, DNS) or a server error: the request may or may not have run.
    const detail = e.code ? `${e.code}: ` : '';
    return { kind: 'uncertain', reason: status === undefined ? `${code}: ${detail}${e.message ?? ''}`.slice(0, 300) : `HTTP ${status} ${code}` };
  }
  return { kind: 'rejected', status, code, reason: `HTTP ${status} ${code}: ${e.message ?? ''}`.slice(0, 300) };
}

/** The SDK client for a policy: region, endpoint and path style from the file, credentials from the default chain. */
export function makeS3Client(remote: S3DeletePolicy['remote'], extra: Partial<S3ClientConfig> = {}): S3Client {
  return new (sdk().S3Client)({
    ...(remote.region !== undefined ? { region: remote.region } : remote.endpoint !== undefined && !process.env.AWS_REGION ? { region: 'us-east-1' } : {}),
    ...(remote.endpoint !== undefined ? { endpoint: remote.endpoint } : {}),
    ...(remote.forcePathStyle !== undefined ? { forcePathStyle: remote.forcePathStyle } : {}),
    maxAttempts: 1,
    ...extra,
  });
}

/**
 * The ObjectStorageClient of a policy. `versions: current`: one DeleteObjects of the keys (on a
 * versioned bucket S3 adds a delete marker, as lifecycle expiration does). `versions: all`: each
 * key's versions and delete markers are listed (ListObjectVersions, exact key), then every one is
 * deleted by version id, in DeleteObjects requests of at most 1,000 entries; a key is deleted only
 * when all of its versions are. The whole exchange is bounded by remote.timeoutMs.
 */
export function makeObjectStorageClient(remote: S3DeletePolicy['remote'], client: S3Client = makeS3Client(remote)): ObjectStorageClient {
  /**
   * The DeleteObjects requests of the entries, ENTRIES_PER_DELETE at a time. The first failing
   * throws (nothing was answered: a whole-request outcome). A later one ends the exchange with what
   * the earlier ones answered: those versions are gone and must be reported (audited), and the
   * entries from the failed request on are `unsent` with the failure's class.
   */
  async function deleteEntries(entries: ObjectIdentifier[], signal: AbortSignal, onSend: (() => Promise<void> | void) | undefined): Promise<EntriesAnswer> {
    const deleted: Array<{ key: string; versionId: string | null }> = [];
    const errors: Array<{ key: string; versionId: string | null; code: string; message: string }> = [];
    for (let at = 0; at < entries.length; at += ENTRIES_PER_DELETE) {
      const chunk = entries.slice(at, at + ENTRIES_PER_DELETE);
      const command = new (sdk().DeleteObjectsCommand)({ Bucket: remote.bucket, Delete: { Objects: chunk, Quiet: false } });
      if (at === 0 && onSend) {
        // The innermost step: its `next` is the HTTP handler (signing, checksums and retries run outside it).
        command.middlewareStack.add(
          (next) => async (args) => {
            await onSend();
            return next(args);
          },
          { step: 'deserialize', priority: 'low', name: 'reaperBeforeSend' },
        );
      }
      let answer;
      try {
        answer = await client.send(command, { abortSignal: signal });
      } catch (error) {
        if (at === 0) throw error;
        return { deleted, errors, unsent: { keys: new Set(entries.slice(at).map((entry) => entry.Key!)), failure: classifyRequestError(error) } };
      }
      for (const item of answer.Deleted ?? []) if (item.Key !== undefined) deleted.push({ key: item.Key, versionId: item.VersionId ?? null });
      for (const item of answer.Errors ?? []) {
        if (item.Key !== undefined) errors.push({ key: item.Key, versionId: item.VersionId ?? null, code: item.Code ?? 'Error', message: item.Message ?? '' });
      }
    }
    return { deleted, errors, unsent: null };
  }

  async function listVersions(key: string, signal: AbortSignal): Promise<string[]> {
    const versionIds: string[] = [];
    let keyMarker: string | undefined;
    let versionIdMarker: string | undefined;
    for (;;) {
      const page = await client.send(
        new (sdk().ListObjectVersionsCommand)({ Bucket: remote.bucket, Prefix: key, KeyMarker: keyMarker, VersionIdMarker: versionIdMarker, MaxKeys: 1000 }),
        { abortSignal: signal },
      );
      // Prefix matches longer keys too ("media/1" and "media/10"): only the exact key counts.
      for (const version of [...(page.Versions ?? []), ...(page.DeleteMarkers ?? [])]) {
        if (version.Key === key && version.VersionId !== undefined) versionIds.push(version.VersionId);
      }
      if (!page.IsTruncated) return versionIds;
      keyMarker = page.NextKeyMarker;
      versionIdMarker = page.NextVersionIdMarker;
      // Past our key (the listing is in key order): nothing more of it can follow.
      if (keyMarker !== undefined && keyMarker > key && !keyMarker.startsWith(key)) return versionIds;
    }
  }

  async function listAll(keys: readonly string[], signal: AbortSignal): Promise<Map<string, string[]>> {
    const found = new Map<string, string[]>();
    let next = 0;
    const lane = async (): Promise<void> => {
      while (next < keys.length) {
        const key = keys[next++]!;
        found.set(key, await listVersions(key, signal));
      }
    };
    await Promise.all(Array.from({ length: Math.min(LIST_CONCURRENCY, keys.length) }, lane));
    return found;
  }

  return {
    async warmUp() {
      try {
        await client.config.region();
      } catch (error) {
        throw new Error(`remote.region: none set and none found by the SDK (AWS_REGION, the shared config file): ${(error as Error).message}`);
      }
      try {
        await client.config.credentials();
      } catch (error) {
        // The chain's own message names the sources it tried; it never contains a secret.
        throw new Error(`no credentials from the AWS SDK's default chain (environment, web identity, shared files, instance metadata): ${(error as Error).message}`);
      }
    },
    async deleteKeys(objectKeys, options = {}) {
      const signal = AbortSignal.timeout(remote.timeoutMs);
      const results = new Map<string, S3KeyResult>();
      try {
        let entries: ObjectIdentifier[];
        let listed: Map<string, string[]> | null = null;
        if (remote.versions === 'all') {
          listed = await listAll(objectKeys, signal);
          entries = objectKeys.flatMap((key) => listed!.get(key)!.map((versionId) => ({ Key: key, VersionId: versionId })));
        } else {
          entries = objectKeys.map((key) => ({ Key: key }));
        }
        const answer: EntriesAnswer = entries.length > 0 ? await deleteEntries(entries, signal, options.onSend) : { deleted: [], errors: [], unsent: null };
        const deletedByKey = new Map<string, Array<string | null>>();
        for (const item of answer.deleted) deletedByKey.set(item.key, [...(deletedByKey.get(item.key) ?? []), remote.versions === 'all' ? item.versionId : null]);
        const errorsByKey = new Map<string, Array<{ code: string; message: string }>>();
        for (const item of answer.errors) errorsByKey.set(item.key, [...(errorsByKey.get(item.key) ?? []), { code: item.code, message: item.message }]);
        for (const key of objectKeys) {
          const versions = deletedByKey.get(key) ?? [];
          const errors = errorsByKey.get(key) ?? [];
          const deletedVersionIds = versions.filter((id): id is string => id !== null);
          if (errors.length > 0) {
            // One refusal of any version rejects the key (an Object Lock on one version is a decision to review).
            const refusal = errors.find((error) => !RETRYABLE_KEY_CODES.has(error.code));
            const first = refusal ?? errors[0]!;
            results.set(key, { kind: refusal ? 'rejected' : 'retryable', code: first.code, message: first.message, deletedVersionIds });
          } else if (answer.unsent?.keys.has(key)) {
            // A later request of the exchange failed with some of the key's versions in it: what went is reported.
            const { failure } = answer.unsent;
            results.set(
              key,
              failure.kind === 'rejected'
                ? { kind: 'rejected', code: failure.code, message: failure.reason, deletedVersionIds }
                : { kind: 'retryable', code: failure.kind === 'throttled' ? failure.code : 'RequestFailed', message: failure.kind === 'throttled' ? `HTTP ${failure.status} ${failure.code}` : failure.reason, deletedVersionIds },
            );
          } else if (listed !== null) {
            // versions: all -- every listed version must be reported deleted (none listed: nothing is there).
            const wanted = listed.get(key)!.length;
            results.set(key, versions.length >= wanted ? { kind: 'deleted', versionIds: versions } : { kind: 'retryable', code: 'NoResult', message: `${wanted - versions.length} versions without a result`, deletedVersionIds });
          } else if (versions.length > 0) {
            results.set(key, { kind: 'deleted', versionIds: [null] });
          } else {
            results.set(key, { kind: 'retryable', code: 'NoResult', message: 'the answer named neither a deletion nor an error', deletedVersionIds: [] });
          }
        }
        return { kind: 'answered', results, requests: Math.max(1, Math.ceil(entries.length / ENTRIES_PER_DELETE)) };
      } catch (error) {
        return classifyRequestError(error);
      }
    },
  };
}
