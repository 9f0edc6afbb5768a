import { randomBytes } from 'node:crypto';
import type { Channel } from 'amqplib';
import type { Registry } from 'prom-client';
import { promClient } from '../../shared/lazy-modules';
import type { Logger } from 'pino';
import { policyVersion, type PolicySet } from '../../shared/config/policies';
import type { BatchVersion } from '../../shared/contracts/batch';

/**
 * The worker's side of the batch contract's versions, kept out of the consumer loop: what it
 * announces (consumer tags; the heartbeat row is written by shared/observability/heartbeat.ts) and
 * what it counts about the versions it receives.
 */

/**
 * A consumer tag that says which version this consumer accepts, for operators looking at the
 * broker (`rabbitmqctl list_consumers`, the management UI): `reaper-worker v2 <worker id> <policy> <random>`.
 * Unique per consume (a tag may not repeat on a channel); at most 255 bytes (AMQP shortstr).
 */
export function consumerTagFor(workerId: string, policy: string, highestAccepted: BatchVersion): string {
  const tag = `reaper-worker v${highestAccepted} ${workerId} ${policy}`;
  return `${Buffer.from(tag).subarray(0, 230).toString('utf8')} ${randomBytes(4).toString('hex')}`;
}

/**
 * Proves to the batch-version gate that this process consumes a policy's work queue NOW, under
 * the identity its heartbeat row announces (the row's instance id is in the queue's name). A
 * heartbeat row alone stays fresh for 15 s after a SIGKILL and would hide another, older consumer
 * from a count; this proof goes with the consumer: the queue is auto-delete, consumed on the
 * channel of the work consumer, so the broker deletes it when that channel or connection dies,
 * and the worker cancels it BEFORE its work consumer (and takes it AFTER): at every moment a
 * proof stands for a work consumer that exists. No message is ever published to it.
 */
export async function announcePresence(channel: Channel, queue: string): Promise<string> {
  await channel.assertQueue(queue, { durable: false, autoDelete: true, arguments: { 'x-queue-type': 'classic' } });
  const { consumerTag } = await channel.consume(queue, () => undefined, { noAck: true }); // nothing arrives; a cancel is the gate's business
  return consumerTag;
}

/**
 * Counts decoded batches by version, and batches whose scan ran under another definition of the
 * policy than this worker's (version 2 carries the scan's policyVersion): during a change of a
 * policy's rule, `reaper_batches_other_policy_version_total` shows how much work was selected by the
 * other rule. The DELETE still re-checks the row with the worker's own guard; this is a signal, not
 * a gate. Logged once per (policy, version) seen, not per batch.
 */
export function makeBatchVersionCounter(options: { policies: PolicySet; registry: Registry; log: Logger }) {
  const { Counter } = promClient();
  const ownVersions = new Map([...options.policies.values()].map((policy) => [policy.name, policyVersion(policy)]));
  const byVersion = new Counter({
    name: 'reaper_batches_by_version_total',
    help: 'Decoded batches by contract version',
    labelNames: ['policy', 'version'],
    registers: [options.registry],
  });
  const otherRule = new Counter({
    name: 'reaper_batches_other_policy_version_total',
    help: "Version-2 batches whose scan used another definition of the policy than this worker's",
    labelNames: ['policy'],
    registers: [options.registry],
  });
  const warned = new Set<string>();
  return (decoded: { policy: string; version: BatchVersion; policyVersion: string | null }): void => {
    const own = ownVersions.get(decoded.policy);
    if (own === undefined) return; // unknown policy: dead-lettered and counted as such elsewhere
    byVersion.inc({ policy: decoded.policy, version: String(decoded.version) });
    if (decoded.policyVersion === null || decoded.policyVersion === own) return;
    otherRule.inc({ policy: decoded.policy });
    const key = `${decoded.policy}:${decoded.policyVersion}`;
    if (!warned.has(key)) {
      warned.add(key);
      options.log.warn(
        { policy: decoded.policy, scannedUnder: decoded.policyVersion, workerPolicyVersion: own },
        'batch scanned under another definition of the policy (rows are still re-checked with this worker\'s guard)',
      );
    }
  };
}
