import { mkdirSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { stringify } from 'yaml';
import { parsePolicies } from '../../shared/config/policies';

/**
 * Policies files for the benchmark's reaper processes. Each is validated with the product's own
 * parser before it is written, so a typo fails here, not as a service that will not start.
 */

/** Runs are triggered by the benchmark; this schedule (00:00 UTC on 1 January) never fires during one. */
export const NEVER = '0 0 1 1 *';

export const ROW_POLICY = 'bench-holds';
export const LATENCY_POLICY = 'bench-latency';
export const REMOTE_POLICY = 'bench-media';

export interface RowDeletePolicyInput {
  name: string;
  kind: 'row-delete';
  schedule: string;
  table: string;
  key: string;
  expiresAt: string;
  guard: Record<string, string>;
  batchSize: number;
  /** The global row-delete throttle (absent: adaptive, no rate set; `adaptive: false` and no rate: unthrottled). */
  admission?: { rowsPerSecond?: number; concurrency?: number; adaptive?: boolean };
  /** The audit trail (absent: off). */
  audit?: { enabled: boolean; retainDays: number };
  /** Retire whole partitions (issue 44; absent: the row path only). */
  partitions?: { retire: boolean; quarantineDays: number };
}

export interface RemoteDeletePolicyInput extends Omit<RowDeletePolicyInput, 'kind' | 'admission' | 'audit'> {
  kind: 'remote-delete';
  remote: { baseUrl: string; path: string; timeoutMs: number };
  admission: { ratePerSecond: number; burst: number; concurrency: number };
  retry: { maxAttempts: number };
}

/** An object storage policy (remote.kind s3, docs/guardrails.md "Object storage (S3)"). */
export interface S3PolicyInput extends Omit<RowDeletePolicyInput, 'kind' | 'admission' | 'audit'> {
  kind: 'remote-delete';
  remote: { kind: 's3'; bucket: string; key: string; endpoint: string; forcePathStyle: boolean; region: string; maxKeysPerRequest: number; timeoutMs: number };
  admission: { requestsPerSecond: number; keysPerSecond: number; concurrency: number };
  retry: { maxAttempts: number };
}

export function seatHoldsPolicy(
  name: string,
  batchSize: number,
  schedule = NEVER,
  extra: Pick<RowDeletePolicyInput, 'admission' | 'audit'> = {},
): RowDeletePolicyInput {
  return { name, kind: 'row-delete', schedule, table: 'seat_reservations', key: 'reservation_id', expiresAt: 'expires_at', guard: { status: 'held' }, batchSize, ...extra };
}

export function writePolicies(directory: string, label: string, policies: ReadonlyArray<RowDeletePolicyInput | RemoteDeletePolicyInput | S3PolicyInput>): string {
  const text = stringify({ policies });
  const file = path.join(directory, `policies-${label}.yaml`);
  parsePolicies(text, file, {}); // throws with the product's message when the bench wrote something invalid
  mkdirSync(directory, { recursive: true });
  writeFileSync(file, text);
  return file;
}
