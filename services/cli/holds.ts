import { Command, Option } from 'commander';
import { requirePolicy } from '../../shared/config/policies';
import { targetResolve } from '../../shared/db/queries/target';
import { holdsAdd, holdsList, holdsRemove } from '../../shared/db/queries/holds';
import { ISO_INPUT, context, operatorName, UsageError, withPool } from './common';
import { printResult, table } from './output';

/** A value the key's type refuses (e.g. not a uuid) is the operator's mistake: exit 2 naming it. */
function refusedKey(error: { code?: string; message: string }): never {
  if (String(error.code).startsWith('22')) throw new UsageError(`<id>: ${error.message}`);
  throw error;
}

/** `reaper hold add|remove|list`: legal holds, re-checked by every deleting statement. */
export function registerHoldCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');
  const hold = program.command('hold').description('legal holds: keys reaper must not delete, whatever their expiry');

  hold
    .command('add <policy> <ids...>')
    .description('hold these keys of <policy>: no run deletes them (or calls the remote) while held')
    .requiredOption('--reason <text>', 'why (kept with the hold)')
    .option('--until <iso>', 'the hold ends at this instant (default: until removed)')
    .addOption(json())
    .action(async (policyName: string, ids: string[], options: { reason: string; until?: string; json?: boolean }) => {
      if (options.reason.trim() === '') throw new UsageError('--reason: must not be empty');
      if (options.until !== undefined && !ISO_INPUT.test(options.until)) {
        throw new UsageError(`--until: "${options.until}" is not an ISO 8601 timestamp with a time zone`);
      }
      const { env, policies } = context();
      const policy = requirePolicy(policies, policyName);
      const held = await withPool(env, async (pool) => {
        const target = await targetResolve(pool, policy);
        return holdsAdd(pool, target, { ids, reason: options.reason.trim(), until: options.until ?? null, createdBy: operatorName() }).catch(refusedKey);
      });
      const ended = held.filter((entry) => !entry.active);
      if (ended.length > 0) process.stderr.write(`reaper: note: --until ${options.until} is already past; ${ended.length} hold(s) are not active\n`);
      printResult(!!options.json, held, () => `held ${held.length} key(s) of ${policy.name}${options.until ? ` until ${held[0]?.heldUntil}` : ''}`);
    });

  hold
    .command('remove <policy> <ids...>')
    .description('remove holds; the next run may delete those keys again if they are still expired')
    .addOption(json())
    .action(async (policyName: string, ids: string[], options: { json?: boolean }) => {
      const { env, policies } = context();
      const policy = requirePolicy(policies, policyName);
      const removed = await withPool(env, async (pool) => holdsRemove(pool, await targetResolve(pool, policy), ids).catch(refusedKey));
      printResult(!!options.json, { removed, notHeld: ids.length - removed.length }, () =>
        `removed ${removed.length} hold(s)${removed.length < ids.length ? `; ${ids.length - removed.length} key(s) had none` : ''}`,
      );
      if (removed.length === 0) process.exitCode = 1;
    });

  hold
    .command('list')
    .description('active holds (with --all also those whose --until has passed)')
    .option('--policy <policy>', 'only this policy')
    .option('--all', 'include holds that have ended')
    .addOption(json())
    .action(async (options: { policy?: string; all?: boolean; json?: boolean }) => {
      const { env, policies } = context();
      if (options.policy !== undefined) requirePolicy(policies, options.policy);
      const holds = await withPool(env, (pool) => holdsList(pool, { policy: options.policy, includeExpired: !!options.all }));
      printResult(!!options.json, holds, () => table(holds, ['policy', 'key', 'reason', 'heldUntil', 'createdBy', 'createdAt', 'active']));
    });
}
