import { Command, Option } from 'commander';
import { admissionViews, type AdmissionView } from '../../shared/admission/overrides';
import { requirePolicy } from '../../shared/config/policies';
import { admissionOverrideReset, admissionOverrideSet } from '../../shared/db/queries/admission';
import { context, operatorName, UsageError, withPool } from './common';
import { printResult, table } from './output';

/**
 * `reaper admission set|show|reset`: live admission control. An override is stored in PostgreSQL
 * with who and when; every worker reads it within a second (shared/admission/overrides.ts) and
 * uses it from its next grant, without a restart. remote-delete: --rate is calls/s, --burst the
 * bucket, --concurrency calls at once. row-delete: --rate is rows/s, --burst rows the bucket
 * holds, --concurrency delete statements at once (setting one on an unthrottled policy throttles it).
 */
export function registerAdmissionCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');
  const admission = program.command('admission').description('live admission control: rate, burst and concurrency per policy, without a restart');

  admission
    .command('set <policy>')
    .description('override the file\'s admission values for <policy>; every worker uses them within a second')
    .option('--rate <r>', 'remote-delete: calls per second; row-delete: rows per second')
    .option('--burst <b>', 'tokens the bucket holds (calls, or rows)')
    .option('--concurrency <c>', 'remote calls (or row-delete statements) at once, across all workers')
    .addOption(json())
    .action(async (policyName: string, options: { rate?: string; burst?: string; concurrency?: string; json?: boolean }) => {
      const { env, policies } = context();
      const policy = requirePolicy(policies, policyName);
      const rate = options.rate === undefined ? undefined : positive('--rate', options.rate, false);
      const burst = options.burst === undefined ? undefined : positive('--burst', options.burst, true);
      const concurrency = options.concurrency === undefined ? undefined : positive('--concurrency', options.concurrency, true);
      if (rate === undefined && burst === undefined && concurrency === undefined) throw new UsageError('give at least one of --rate, --burst, --concurrency');
      const view = await withPool(env, async (pool) => {
        await admissionOverrideSet(pool, { policy: policy.name, rate, burst, concurrency, setBy: operatorName() });
        return (await admissionViews(pool, [policy]))[0]!;
      });
      printResult(!!options.json, view, () => `${policy.name}: in force ${describe(view.inForce, view.rateUnit)} (set by ${view.override?.setBy} at ${view.override?.setAt}); workers use it within a second`);
    });

  admission
    .command('show')
    .description('per policy: the file\'s values, the override (who, when) and what is in force')
    .option('--policy <policy>', 'only this policy')
    .addOption(json())
    .action(async (options: { policy?: string; json?: boolean }) => {
      const { env, policies } = context();
      const chosen = options.policy === undefined ? [...policies.values()] : [requirePolicy(policies, options.policy)];
      const views = await withPool(env, (pool) => admissionViews(pool, chosen));
      printResult(!!options.json, views, () => table(views.map(viewRow), ['policy', 'kind', 'file', 'override', 'inForce', 'setBy', 'setAt']));
    });

  admission
    .command('reset <policy>')
    .description('drop the override: the file\'s values are in force again (within a second on every worker)')
    .addOption(json())
    .action(async (policyName: string, options: { json?: boolean }) => {
      const { env, policies } = context();
      const policy = requirePolicy(policies, policyName);
      const { removed, view } = await withPool(env, async (pool) => ({ removed: await admissionOverrideReset(pool, policy.name), view: (await admissionViews(pool, [policy]))[0]! }));
      printResult(!!options.json, { removed, ...view }, () => (removed ? `${policy.name}: back to the file's values, ${describe(view.inForce, view.rateUnit)}` : `${policy.name}: had no override; in force ${describe(view.inForce, view.rateUnit)}`));
      if (!removed) process.exitCode = 1;
    });
}

function positive(option: string, value: string, integer: boolean): number {
  const number = Number(value);
  if (!Number.isFinite(number) || number <= 0 || (integer && !Number.isInteger(number)) || number > 10_000_000) {
    throw new UsageError(`${option}: must be a positive ${integer ? 'integer' : 'number'} up to 10000000 (got "${value}")`);
  }
  return number;
}

/** "rate 50 rows/s, burst 500, concurrency 2" (an absent limit: "unlimited"). */
export function describe(values: AdmissionView['inForce'], unit: AdmissionView['rateUnit']): string {
  return `rate ${values.rate === null ? 'unlimited' : `${values.rate} ${unit}`}, burst ${values.burst ?? '-'}, concurrency ${values.concurrency ?? 'unlimited'}`;
}

export function viewRow(view: AdmissionView): Record<string, unknown> {
  const override = view.override;
  return {
    policy: view.policy,
    kind: view.kind,
    file: describe(view.file, view.rateUnit),
    override: override ? [override.rate !== null && `rate ${override.rate}`, override.burst !== null && `burst ${override.burst}`, override.concurrency !== null && `concurrency ${override.concurrency}`].filter(Boolean).join(', ') : null,
    inForce: describe(view.inForce, view.rateUnit),
    setBy: override?.setBy ?? null,
    setAt: override?.setAt ?? null,
  };
}
