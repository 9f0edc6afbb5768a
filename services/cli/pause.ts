import { Command, Option } from 'commander';
import { requirePolicy, type Policy } from '../../shared/config/policies';
import { admissionSetPaused } from '../../shared/db/queries/admission';
import { context, withPool } from './common';
import { printResult } from './output';

/**
 * `reaper pause|resume [policy]`: stops (and resumes) a policy's deletions in an incident, any kind:
 * remote-delete makes no call (no ledger row is touched), row-delete admits no statement (its
 * batches go to a delay tier until resumed). Every worker sees it within OVERRIDE_REFRESH_MS.
 */

/** The bucket a paused policy's admission row starts with when it has none yet (its burst). */
function initialTokens(policy: Policy): number {
  return policy.kind === 'remote-delete' ? policy.admission.burst : (policy.admission?.burst ?? policy.batchSize);
}

async function setPaused(policyName: string | undefined, paused: boolean, json: boolean): Promise<void> {
  const { env, policies } = context();
  const chosen = policyName !== undefined ? [requirePolicy(policies, policyName)] : [...policies.values()];
  await withPool(env, async (pool) => {
    const names = chosen.map((policy) => policy.name);
    const changed = await admissionSetPaused(pool, names, paused, new Map(chosen.map((policy) => [policy.name, initialTokens(policy)])));
    printResult(json, { paused, policies: names, changed }, () =>
      `${paused ? 'paused' : 'resumed'}: ${names.join(', ') || '(no policy)'}${changed.length < names.length ? ` (already ${paused ? 'paused' : 'running'}: ${names.filter((n) => !changed.includes(n)).join(', ')})` : ''}`,
    );
  });
}

/** Registers `reaper pause` and `reaper resume`. */
export function registerPauseCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');

  program
    .command('pause [policy]')
    .description('stop a policy\'s deletions (all policies when omitted): remote calls or row statements; nothing is lost, `resume` goes on')
    .addOption(json())
    .action((policy: string | undefined, options: { json?: boolean }) => setPaused(policy, true, !!options.json));

  program
    .command('resume [policy]')
    .description('resume a paused policy; the backlog drains from where it stopped')
    .addOption(json())
    .action((policy: string | undefined, options: { json?: boolean }) => setPaused(policy, false, !!options.json));
}
