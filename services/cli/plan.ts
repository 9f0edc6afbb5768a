import { Command, Option } from 'commander';
import { requirePolicy } from '../../shared/config/policies';
import { withReadOnlyTransaction } from '../../shared/db/pool';
import { databaseNow } from '../../shared/db/queries/clock';
import { targetResolve } from '../../shared/db/queries/target';
import { planCount, planRecentRowsPerSecond, planSample } from '../../shared/db/queries/plan';
import { runsLatestDecided } from '../../shared/db/queries/runs';
import { partitionRetirementsList } from '../../shared/db/queries/partitions';
import { partitionsClassify } from '../../shared/partitions/classify';
import { context, pastCutoff, UsageError, withPool } from './common';
import { partitionsReport, partitionsTable, type PartitionsReport } from './partitions';
import { formatDuration, printResult } from './output';

/** What `reaper plan` answers (the JSON field names are the contract). */
export interface Plan {
  policy: string;
  cutoff: string;
  candidates: number;
  batches: number;
  held: number;
  oldestExpiry: string | null;
  newestExpiry: string | null;
  sample: string[];
  estimatedSeconds: number | null;
  /** How the estimate was made. */
  estimateBasis: string;
  /** Rows satisfying the guard (expired or not) and those with a '-infinity' expiry, for context. */
  guarded: number;
  nonFinite: number;
  /**
   * The policy's run an operator decided or must decide about (awaiting approval, or approved and
   * not finished): the count it was approved for, the brake's latest count, what it published.
   * Null when there is none.
   */
  decision: { runId: string; state: string; approved: number | null; counted: number | null; published: number; reason: string | null } | null;
  /**
   * A row-delete policy on a partitioned table: its partitions classified under the same cutoff
   * (`reaper partitions`). `candidates` counts every eligible row, the retirable partitions' too:
   * the brake counts them alike. Null for a table that is not partitioned.
   */
  partitions: PartitionsReport | null;
}

/**
 * `reaper plan <policy>`: what a run would do now or at a past cutoff, in a READ ONLY transaction,
 * so it deletes, publishes and writes nothing.
 */
export function registerPlanCommand(program: Command): void {
  program
    .command('plan <policy>')
    .description('dry run: what a run of <policy> would delete now, or at --cutoff; changes nothing')
    .option('--cutoff <iso>', 'as of this past instant (ISO 8601 with a time zone)')
    .option('--sample <n>', 'show this many candidate keys', '10')
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (policyName: string, options: { cutoff?: string; sample: string; json?: boolean }) => {
      const sample = Number(options.sample);
      if (!Number.isInteger(sample) || sample < 0 || sample > 10_000) throw new UsageError(`--sample: must be an integer from 0 to 10000 (got "${options.sample}")`);
      const { env, policies } = context();
      const policy = requirePolicy(policies, policyName);
      const plan = await withPool(env, async (pool) => {
        const cutoff = options.cutoff ? await pastCutoff(pool, options.cutoff) : await databaseNow(pool);
        const target = await targetResolve(pool, policy);
        return withReadOnlyTransaction(pool, async (client): Promise<Plan> => {
          // One predicate for the count and the sample: remote-delete leaves out what the ledger already decided.
          const candidates = { unrecordedFor: policy.kind === 'remote-delete' ? policy.name : undefined };
          const counts = await planCount(client, target, cutoff, candidates);
          let estimatedSeconds: number | null;
          let estimateBasis: string;
          if (policy.kind === 'remote-delete') {
            estimatedSeconds = counts.candidates / policy.admission.ratePerSecond;
            estimateBasis = `admission rate ${policy.admission.ratePerSecond}/s`;
          } else {
            const rate = await planRecentRowsPerSecond(client, policy.name);
            estimatedSeconds = rate ? counts.candidates / rate : null;
            estimateBasis = rate ? `recent runs: ${Math.round(rate)} rows/s` : 'no completed run yet';
          }
          return {
            policy: policy.name,
            cutoff,
            candidates: counts.candidates,
            batches: Math.ceil(counts.candidates / policy.batchSize),
            held: counts.held,
            oldestExpiry: counts.oldestExpiry,
            newestExpiry: counts.newestExpiry,
            sample: sample > 0 ? await planSample(client, target, cutoff, sample, candidates) : [],
            estimatedSeconds: estimatedSeconds === null ? null : Math.round(estimatedSeconds * 10) / 10,
            estimateBasis,
            guarded: counts.guarded,
            nonFinite: counts.nonFinite,
            partitions: target.partitioned
              ? partitionsReport(policy, cutoff, await partitionsClassify(client, target, cutoff), await partitionRetirementsList(client, { policy: policy.name, states: ['quarantined'] }))
              : null,
            decision: await runsLatestDecided(client, policy.name).then((run) =>
              run ? { runId: run.runId, state: run.state, approved: run.approvedCandidates, counted: run.countedCandidates, published: run.candidates, reason: run.error } : null,
            ),
          };
        });
      });
      printResult(!!options.json, plan, () =>
        [
          `policy      ${plan.policy} (cutoff ${plan.cutoff})`,
          `candidates  ${plan.candidates} in ${plan.batches} batch(es) of ${policy.batchSize}`,
          `held        ${plan.held} expired row(s) under a legal hold, left alone`,
          `expiries    ${plan.oldestExpiry ?? '-'} .. ${plan.newestExpiry ?? '-'}`,
          `estimate    ${plan.estimatedSeconds === null ? 'unknown' : formatDuration(plan.estimatedSeconds)} (${plan.estimateBasis})`,
          ...(plan.nonFinite > 0 ? [`note        ${plan.nonFinite} row(s) expire at '-infinity' and are never published`] : []),
          `sample      ${plan.sample.join(', ') || '(none)'}`,
          ...(plan.decision
            ? [
                `run         ${plan.decision.runId} ${plan.decision.state}: approved ${plan.decision.approved ?? '-'}, counted ${plan.decision.counted ?? '-'}, published ${plan.decision.published}`,
              ]
            : []),
          ...(plan.partitions
            ? [
                `partitions  ${plan.partitions.partitions.filter((entry) => entry.class === 'retirable').length} retirable (${plan.partitions.retirableRows} of the candidates)${plan.partitions.retire ? '' : '; partitions.retire is off: the row path deletes them'}`,
                partitionsTable(plan.partitions.partitions),
              ]
            : []),
        ].join('\n'),
      );
    });
}
