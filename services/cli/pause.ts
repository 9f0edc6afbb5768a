import { Command, Option } from 'commander';
import { requirePolicy, type AnyRemoteDeletePolicy } from '../../shared/config/policies';
import { admissionSetPaused } from '../../shared/db/queries/admission';
import { context, UsageError, withPool } from './common';
import { printResult } from './output';

/** `reaper pause|resume [policy]`: the remote-delete pause switch (no ledger row is touched). */

async function setPaused(policyName: string | undefined, paused: boolean, json: boolean): Promise<void> {
  const { env, policies } = context();
  const remote = [...policies.values()].filter((policy): policy is AnyRemoteDeletePolicy => policy.kind === 'remote-delete');
  let chosen = remote;
  if (policyName !== undefined) {
    const policy = requirePolicy(policies, policyName);
    if (policy.kind !== 'remote-delete') throw new UsageError(`policy "${policyName}" is ${policy.kind}; pause applies to remote-delete policies`);
    chosen = [policy];
  }
  await withPool(env, async (pool) => {
    const names = chosen.map((policy) => policy.name);
    const changed = await admissionSetPaused(pool, names, paused, new Map(chosen.map((policy) => [policy.name, policy.admission.burst])));
    printResult(json, { paused, policies: names, changed }, () =>
      `${paused ? 'paused' : 'resumed'}: ${names.join(', ') || '(no remote-delete policy)'}${changed.length < names.length ? ` (already ${paused ? 'paused' : 'running'}: ${names.filter((n) => !changed.includes(n)).join(', ')})` : ''}`,
    );
  });
}

/** Registers `reaper pause` and `reaper resume`. */
export function registerPauseCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('pause [policy]')
    .description('stop remote calls for a remote-delete policy (all when omitted); no ledger row is touched')
    .addOption(json())
    .action((policy: string | undefined, options: { json?: boolean }) => setPaused(policy, true, !!options.json));

  program
    .command('resume [policy]')
    .description('resume remote calls; the backlog drains from where it stopped')
    .addOption(json())
    .action((policy: string | undefined, options: { json?: boolean }) => setPaused(policy, false, !!options.json));
}
