import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import fc from 'fast-check';
import { admitAndClaim, blockAdmission, bucketShape, type AdmissionGrant } from '../../shared/admission/controller';
import { parsePolicies, type RemoteDeletePolicy } from '../../shared/config/policies';
import { withTransaction } from '../../shared/db/pool';
import { admissionSetPaused } from '../../shared/db/queries/admission';
import { type ExpiringItem } from '../../shared/db/queries/expiring-rows';
import { targetResolve, type ResolvedTarget } from '../../shared/db/queries/target';
import { holdsAdd, holdsRemove } from '../../shared/db/queries/holds';
import {
  ledgerFinish,
  ledgerRecordCandidates,
  ledgerReschedule,
  ledgerReturnExpiredLeases,
  targetSettleConfirmed,
  type ClaimToken,
  type LedgerOutcome,
} from '../../shared/db/queries/ledger';
import { MEDIA_POLICY, mediaPolicyYaml } from '../support/remote-helpers';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * A property test of the remote-delete ledger (issue 7, "A property test of the ledger"), against
 * the real PostgreSQL and the real statements: fast-check's model-based `fc.commands` drives random
 * sequences of recording (scan deliveries, duplicate deliveries at once, webhooks), claims under
 * admission (one worker, or two at once), call outcomes (confirmed, 429 with Retry-After,
 * uncertain, rejected, the worker dying), lease expiry and the reclaimer, renewal / restore /
 * re-expiry of the asset's row, legal holds, pause and resume. A small model predicts what each
 * statement must answer (which keys a delivery records, what a claim may take and must supersede,
 * whether a fenced completion applies). After each sequence everything left open is drained through
 * the same statements, and the database's own history (a trigger on cleanup_ledger, stamped with
 * clock_timestamp()) is checked:
 *  - one operation key never had two live leases at once;
 *  - no claim (hence no call) for a row renewed, changed or held before the claim;
 *  - every operation ends `done`, finished exactly once (a `held` or `superseded` end may be
 *    re-opened by a later scan once its row holds the decision again without a hold, and then
 *    finishes once more; a confirmation whose row was held meanwhile ends `held`, row kept);
 *  - the grants in any one-second window never exceed rate + burst.
 *
 * REAPER_PROPERTY_RUNS (default 250) sets the number of runs; REAPER_PROPERTY_SEED replays one
 * (the seed is printed on failure, with the shrunk command sequence).
 */

const RUNS = Number(process.env.REAPER_PROPERTY_RUNS ?? 250);
/**
 * A fixed amount of work whose time depends on the machine: 250 sequences took 137 s on a 2-core
 * machine with both cores busy (CI's stress run), over the suite's 120 s per test. Time is not
 * what this test measures; it is bounded only against a hang.
 */
const PROPERTY_TIMEOUT_MS = 600_000;
const SEED = process.env.REAPER_PROPERTY_SEED !== undefined ? Number(process.env.REAPER_PROPERTY_SEED) : (Date.now() ^ (Math.random() * 0x7fffffff)) | 0;
const MAX_ATTEMPTS = 3;
/** A reschedule is either due at once or far away (an hour); "time passes" makes the far ones due. */
const FAR_MS = 3_600_000;
const LEASE_MS = 60_000;
const OWNERS = ['worker-1', 'worker-2', 'worker-3'] as const;

// ----- the model ---------------------------------------------------------------------------------

interface AssetModel {
  id: string;
  /** Current retention_expires_at as reaper_iso() prints it. */
  expiry: string;
  /** The first expiry: a restore puts it back. */
  original: string;
  /** Expiry in the future (renewed): not eligible. */
  future: boolean;
  /** 'archived': the guard (status = active) no longer holds; a restore brings it back. */
  status: 'active' | 'deleted' | 'archived';
  held: boolean;
}

interface OperationModel {
  key: string;
  assetId: string;
  observed: string;
  state: 'pending' | 'in_flight' | 'done';
  outcome: LedgerOutcome | null;
  /** Pending and not_before reached (or in flight under an expired lease). */
  due: boolean;
  attempt: number;
  owner: string | null;
  leaseExpired: boolean;
}

interface BatchModel {
  batchId: string;
  cutoff: string;
  items: ExpiringItem[];
  /** Keys the last delivery answered as known (null: never delivered). */
  known: string[] | null;
}

interface ClaimInHand {
  token: ClaimToken;
  assetId: string;
  observed: string;
  /** The model's verdict when the claim was made: the row held the decision, no hold. */
  rowMatchedAtClaim: boolean;
}

interface Model {
  assets: AssetModel[];
  ops: Map<string, OperationModel>;
  batches: BatchModel[];
  hand: ClaimInHand[];
  paused: boolean;
  calls: number;
}

interface Real {
  bed: TestBed;
  policy: RemoteDeletePolicy;
  target: ResolvedTarget;
}

/** What the runs exercised (printed with the result, so a change that makes the commands toothless shows). */
const stats = { runs: 0, claims: 0, calls: 0, superseded: 0, held: 0, reopened: 0, reopenedSuperseded: 0, settleHeld: 0, staleCompletions: 0, refusedForRate: 0, pausedGrants: 0, mostInOneSecond: 0 };

const keyOf = (policy: string, id: string, observed: string) => `${policy}:${id}:${observed}`;

function rowHoldsDecision(model: Model, op: { assetId: string; observed: string }): boolean {
  const asset = model.assets.find((a) => a.id === op.assetId)!;
  return asset.status === 'active' && !asset.future && asset.expiry === op.observed;
}

function isHeld(model: Model, assetId: string): boolean {
  return model.assets.find((a) => a.id === assetId)!.held;
}

const isCurrent = (model: Model, token: ClaimToken): boolean => {
  const op = model.ops.get(token.operationKey);
  return !!op && op.state === 'in_flight' && op.attempt === token.attempt && op.owner === token.owner;
};

async function dbNow(real: Real): Promise<string> {
  return (await real.bed.pool.query<{ now: string }>(`SELECT reaper_iso(clock_timestamp()) AS now`)).rows[0]!.now;
}

// ----- what every claim must satisfy -------------------------------------------------------------

/**
 * Applies grants (one, or several made at once over overlapping batches) to the model and checks
 * them: every key claimed was due and its row still held the decision with no hold; the due keys
 * whose row changed were superseded and the held ones finished 'held' (by one grant or another);
 * nothing claimed while paused; claims of one round are disjoint; the attempt number is the
 * model's plus one; live leases never exceed the concurrency cap.
 */
function applyGrants(model: Model, policy: RemoteDeletePolicy, grants: ReadonlyArray<{ keys: readonly string[]; owner: string; grant: AdmissionGrant }>): void {
  const asked = new Set(grants.flatMap((g) => g.keys));
  const due = [...asked].map((key) => model.ops.get(key)).filter((op): op is OperationModel => !!op && op.due && op.state !== 'done');
  const mustSupersede = due.filter((op) => !rowHoldsDecision(model, op));
  const mustHold = due.filter((op) => rowHoldsDecision(model, op) && isHeld(model, op.assetId));
  const claimable = new Set(due.filter((op) => rowHoldsDecision(model, op) && !isHeld(model, op.assetId)).map((op) => op.key));
  assert.equal(grants.reduce((n, g) => n + g.grant.superseded, 0), mustSupersede.length, `superseded: expected ${mustSupersede.map((op) => op.key).join(', ')}`);
  assert.equal(grants.reduce((n, g) => n + g.grant.held, 0), mustHold.length, `held: expected ${mustHold.map((op) => op.key).join(', ')}`);
  stats.superseded += mustSupersede.length;
  stats.held += mustHold.length;
  for (const { grant } of grants) {
    if (grant.verdict === 'no-token') stats.refusedForRate += 1;
    if (grant.verdict === 'paused') stats.pausedGrants += 1;
  }
  for (const op of mustSupersede) Object.assign(op, { state: 'done', outcome: 'superseded', due: false, owner: null, leaseExpired: false });
  for (const op of mustHold) Object.assign(op, { state: 'done', outcome: 'held', due: false, owner: null, leaseExpired: false });
  const seen = new Set<string>();
  for (const { owner, grant } of grants) {
    if (model.paused) assert.equal(grant.claimed.length, 0, 'nothing is claimed while paused');
    for (const claimed of grant.claimed) {
      assert.ok(claimable.has(claimed.operationKey), `claimed ${claimed.operationKey}: it must be due, its row unchanged and not held`);
      assert.ok(!seen.has(claimed.operationKey), `${claimed.operationKey} claimed twice in one round`);
      seen.add(claimed.operationKey);
      stats.claims += 1;
      const op = model.ops.get(claimed.operationKey)!;
      assert.equal(claimed.attemptCount, op.attempt + 1, `attempt number of ${op.key}`);
      Object.assign(op, { state: 'in_flight', attempt: claimed.attemptCount, owner, due: false, leaseExpired: false });
      model.hand.push({ token: { operationKey: op.key, owner, attempt: claimed.attemptCount }, assetId: op.assetId, observed: op.observed, rowMatchedAtClaim: true });
    }
  }
  const live = [...model.ops.values()].filter((op) => op.state === 'in_flight' && !op.leaseExpired).length;
  assert.ok(live <= policy.admission.concurrency, `live leases ${live} above the cap ${policy.admission.concurrency}`);
}

async function deliver(model: Model, real: Real, batch: BatchModel, source: 'scan' | 'webhook', copies: number): Promise<void> {
  const expected = new Set<string>();
  let inserted = 0;
  for (const item of batch.items) {
    const key = keyOf(real.policy.name, item.id, item.observedExpiry);
    const op = model.ops.get(key);
    const eligible = rowHoldsDecision(model, { assetId: item.id, observed: item.observedExpiry });
    if (!op && eligible) {
      inserted += 1;
      model.ops.set(key, { key, assetId: item.id, observed: item.observedExpiry, state: 'pending', outcome: null, due: true, attempt: 0, owner: null, leaseExpired: false });
    } else if (op && eligible && (op.outcome === 'held' || op.outcome === 'superseded')) {
      // A later scan re-opens an operation a legal hold stopped, or one superseded while its row
      // had changed, once the row holds the decision again (the hold is re-checked at the claim).
      if (op.outcome === 'superseded') stats.reopenedSuperseded += 1;
      Object.assign(op, { state: 'pending', outcome: null, due: true });
      stats.reopened += 1;
    }
    if (model.ops.has(key)) expected.add(key);
  }
  const record = () =>
    ledgerRecordCandidates(real.bed.pool, real.target, {
      policy: real.policy.name,
      runId: null,
      cutoff: batch.cutoff,
      items: batch.items,
      source,
      batchId: source === 'scan' ? batch.batchId : null,
    });
  const answers = await Promise.all(Array.from({ length: copies }, record));
  assert.equal(answers.reduce((n, a) => n + a.inserted, 0), inserted, 'operations inserted by the deliveries together');
  for (const answer of answers) assert.deepEqual([...answer.known].sort(), [...expected].sort(), 'keys the delivery knows');
  batch.known = [...expected];
}

async function claim(model: Model, real: Real, requests: ReadonlyArray<{ batch: BatchModel; owner: string }>, policy = real.policy): Promise<void> {
  const grants = await Promise.all(
    requests.map(async ({ batch, owner }) => {
      const keys = batch.known ?? [];
      const grant = await admitAndClaim(real.bed.pool, policy, real.target, { keys, owner, cutoff: batch.cutoff, batchId: batch.batchId });
      return { keys, owner, grant };
    }),
  );
  applyGrants(model, policy, grants);
}

type CallAnswer = 'confirmed' | 'rejected' | 'uncertain' | 'rate-limited' | 'worker-died';

async function answerCall(model: Model, real: Real, inHand: ClaimInHand, answer: CallAnswer, delayMs: number, retryAfterMs: number): Promise<void> {
  model.hand.splice(model.hand.indexOf(inHand), 1);
  assert.ok(inHand.rowMatchedAtClaim, 'a call is made only for a claim whose row held the decision when claimed');
  model.calls += 1;
  stats.calls += 1;
  if (answer === 'worker-died') return; // the lease stays until it expires; nothing is recorded
  const current = isCurrent(model, inHand.token);
  if (!current) stats.staleCompletions += 1;
  const op = model.ops.get(inHand.token.operationKey)!;
  const { pool } = real.bed;
  // The model moves first: while this completion is on its way, a concurrent claim (Hammer) may
  // already see its effect in the database, and the model must never be behind on a release.
  const finishing = answer === 'confirmed' || answer === 'rejected' || (answer === 'uncertain' && inHand.token.attempt >= MAX_ATTEMPTS);
  const outcome: LedgerOutcome = answer === 'confirmed' ? 'confirmed' : answer === 'rejected' ? 'rejected' : 'gave-up';
  if (current && finishing) Object.assign(op, { state: 'done', outcome, owner: null, due: false, leaseExpired: false });
  if (current && !finishing) Object.assign(op, { state: 'pending', owner: null, due: delayMs === 0, leaseExpired: false });
  let applied: boolean;
  if (answer === 'confirmed') {
    const asset = model.assets.find((a) => a.id === inHand.assetId)!;
    if (current && asset.status === 'active' && asset.expiry === inHand.observed) {
      // The settle step re-checks holds: a held row is kept and the operation ends 'held'.
      if (asset.held) {
        Object.assign(op, { outcome: 'held' });
        stats.settleHeld += 1;
      }
      else asset.status = 'deleted';
    }
    applied = await withTransaction(pool, async (client) => {
      const finished = await ledgerFinish(client, { ...inHand.token, outcome: 'confirmed', lastResult: 'HTTP 204' });
      if (finished) await targetSettleConfirmed(client, real.target, { assetId: inHand.assetId, observedExpiry: inHand.observed, markConfirmed: real.policy.markConfirmed });
      return finished;
    });
  } else if (finishing) {
    applied = await ledgerFinish(pool, { ...inHand.token, outcome, lastResult: answer });
  } else {
    applied = await ledgerReschedule(pool, { ...inHand.token, delayMs, lastResult: answer });
    if (answer === 'rate-limited') await blockAdmission(pool, real.policy.name, retryAfterMs);
  }
  assert.equal(applied, current, `completion of ${inHand.token.operationKey} attempt ${inHand.token.attempt} applies only for the current claim`);
}

// ----- commands ----------------------------------------------------------------------------------

type Cmd = fc.AsyncCommand<Model, Real>;

const pick = <T>(list: readonly T[], n: number): T => list[n % list.length]!;

class Scan implements Cmd {
  constructor(readonly mask: number) {}
  check = () => true;
  async run(model: Model, real: Real) {
    // What a scan reads: active, expired, not held (holds are left out of scans).
    const rows = model.assets.filter((a, i) => (this.mask >> i) & 1 && a.status === 'active' && !a.future && !a.held);
    if (rows.length === 0) return;
    model.batches.push({ batchId: `scan:${randomUUID()}`, cutoff: await dbNow(real), items: rows.map((a) => ({ id: a.id, observedExpiry: a.expiry })), known: null });
  }
  toString = () => `scan(${this.mask})`;
}

class Deliver implements Cmd {
  constructor(readonly batch: number, readonly copies: 1 | 2) {}
  check = (model: Readonly<Model>) => model.batches.some((b) => b.batchId.startsWith('scan:'));
  async run(model: Model, real: Real) {
    await deliver(model, real, pick(model.batches.filter((b) => b.batchId.startsWith('scan:')), this.batch), 'scan', this.copies);
  }
  toString = () => `deliver(${this.batch}${this.copies > 1 ? ', twice at once' : ''})`;
}

class Webhook implements Cmd {
  constructor(readonly asset: number) {}
  check = () => true;
  async run(model: Model, real: Real) {
    const asset = pick(model.assets, this.asset);
    // A webhook reports the asset's current expiry; the sweeper would carry it in a batch of its own.
    const batch: BatchModel = { batchId: `ledger:${randomUUID()}`, cutoff: await dbNow(real), items: [{ id: asset.id, observedExpiry: asset.expiry }], known: null };
    await deliver(model, real, batch, 'webhook', 1);
    model.batches.push(batch);
  }
  toString = () => `webhook(${this.asset})`;
}

class Claim implements Cmd {
  constructor(readonly batch: number, readonly owner: number, readonly other: number | null) {}
  check = (model: Readonly<Model>) => model.batches.some((b) => b.known !== null);
  async run(model: Model, real: Real) {
    const delivered = model.batches.filter((b) => b.known !== null);
    const requests = [{ batch: pick(delivered, this.batch), owner: pick(OWNERS, this.owner) }];
    if (this.other !== null) requests.push({ batch: pick(delivered, this.other), owner: pick(OWNERS, this.owner + 1) });
    await claim(model, real, requests);
  }
  toString = () => `claim(${this.batch}, ${OWNERS[this.owner % OWNERS.length]}${this.other !== null ? `, and batch ${this.other} at once` : ''})`;
}

class Call implements Cmd {
  constructor(readonly which: number, readonly answer: CallAnswer, readonly far: boolean, readonly retryAfterMs: number) {}
  check = (model: Readonly<Model>) => model.hand.length > 0;
  async run(model: Model, real: Real) {
    await answerCall(model, real, pick(model.hand, this.which), this.answer, this.far ? FAR_MS : 0, this.retryAfterMs);
  }
  toString = () => `call(${this.which}) -> ${this.answer}${this.answer === 'rate-limited' ? ` Retry-After ${this.retryAfterMs} ms` : ''}${this.far ? ', due in an hour' : ''}`;
}

/**
 * Three workers at once, each claiming from every delivered batch's keys in a loop and finishing
 * what it claimed (confirmed or rejected), until none of them is granted anything: grants from
 * several processes meet at the admission row, as in production, and the bucket alone bounds them.
 */
class Hammer implements Cmd {
  constructor(readonly rejectEvery: number) {}
  check = (model: Readonly<Model>) => model.batches.some((b) => b.known !== null);
  async run(model: Model, real: Real) {
    const keys = [...new Set(model.batches.flatMap((b) => b.known ?? []))];
    const batch: BatchModel = { batchId: `hammer:${randomUUID()}`, cutoff: await dbNow(real), items: [], known: keys };
    // One claim alone first: it supersedes (or finishes 'held') whatever no longer holds its decision.
    let answered = 0;
    const work = async (owner: string, rounds: number): Promise<void> => {
      for (let round = 0; round < rounds; round++) {
        const grant = await admitAndClaim(real.bed.pool, real.policy, real.target, { keys, owner, cutoff: batch.cutoff, batchId: batch.batchId });
        applyGrants(model, real.policy, [{ keys, owner, grant }]);
        const mine = model.hand.filter((h) => h.token.owner === owner && grant.claimed.some((c) => c.operationKey === h.token.operationKey && c.attemptCount === h.token.attempt));
        await Promise.all(mine.map((h) => answerCall(model, real, h, ++answered % this.rejectEvery === 0 ? 'rejected' : 'confirmed', 0, 0)));
        if (grant.claimed.length === 0 && grant.verdict !== 'concurrency') return;
      }
    };
    await work(OWNERS[0], 1);
    await Promise.all(OWNERS.map((owner) => work(owner, 30)));
  }
  toString = () => `hammer(reject every ${this.rejectEvery})`;
}

class ExpireLease implements Cmd {
  constructor(readonly which: number) {}
  check = (model: Readonly<Model>) => [...model.ops.values()].some((op) => op.state === 'in_flight' && !op.leaseExpired);
  async run(model: Model, real: Real) {
    const op = pick([...model.ops.values()].filter((o) => o.state === 'in_flight' && !o.leaseExpired), this.which);
    // The holder froze or died: its lease runs out (moved into the past rather than waited for).
    const moved = await real.bed.pool.query(
      `UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 millisecond' WHERE operation_key = $1 AND state = 'in_flight'`,
      [op.key],
    );
    assert.equal(moved.rowCount, 1);
    Object.assign(op, { leaseExpired: true, due: true });
  }
  toString = () => `expire-lease(${this.which})`;
}

/**
 * A worker froze past its lease and a second process started with the SAME REAPER_WORKER_ID claims
 * the operation again: the frozen one's answer must then change nothing (the attempt number fences it).
 */
class SameIdReclaim implements Cmd {
  constructor(readonly which: number) {}
  check = (model: Readonly<Model>) => model.hand.some((h) => isCurrent(model as Model, h.token));
  async run(model: Model, real: Real) {
    const frozen = pick(model.hand.filter((h) => isCurrent(model, h.token)), this.which);
    const op = model.ops.get(frozen.token.operationKey)!;
    await real.bed.pool.query(`UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 millisecond' WHERE operation_key = $1 AND state = 'in_flight'`, [op.key]);
    Object.assign(op, { leaseExpired: true, due: true });
    const batch: BatchModel = { batchId: `same-id:${randomUUID()}`, cutoff: await dbNow(real), items: [], known: [op.key] };
    await claim(model, real, [{ batch, owner: frozen.token.owner }]);
  }
  toString = () => `same-id-reclaim(${this.which})`;
}

class ReturnExpiredLeases implements Cmd {
  check = () => true;
  async run(model: Model, real: Real) {
    const expired = [...model.ops.values()].filter((op) => op.state === 'in_flight' && op.leaseExpired);
    assert.equal(await ledgerReturnExpiredLeases(real.bed.pool), expired.length, 'the reclaimer returns exactly the expired leases');
    for (const op of expired) Object.assign(op, { state: 'pending', owner: null, due: true, leaseExpired: false });
  }
  toString = () => 'return-expired-leases';
}

class ChangeRow implements Cmd {
  constructor(readonly asset: number, readonly change: 'renew' | 'restore' | 're-expire' | 'archive') {}
  check = () => true;
  async run(model: Model, real: Real) {
    const asset = pick(model.assets, this.asset);
    // renew: a client extends retention; restore: the original decision (and an undeleted row) is
    // back; re-expire: a new, different expiry in the past (a new decision, a new key); archive:
    // the guard stops holding, same expiry (a restore makes it hold again: the same decision).
    if (this.change === 'archive') {
      await real.bed.pool.query(`UPDATE media_assets SET status = 'archived' WHERE asset_id = $1 AND status = 'active'`, [asset.id]);
      if (asset.status === 'active') asset.status = 'archived';
      return;
    }
    const expression = {
      renew: `clock_timestamp() + interval '30 days'`,
      restore: `$2::timestamptz`,
      're-expire': `clock_timestamp() - interval '2 minutes' - random() * interval '1 minute'`,
    }[this.change];
    const row = await real.bed.pool.query<{ e: string }>(
      `UPDATE media_assets SET retention_expires_at = ${expression}, status = CASE WHEN $2::timestamptz IS NOT NULL THEN 'active' ELSE status END
       WHERE asset_id = $1 RETURNING reaper_iso(retention_expires_at) AS e`,
      [asset.id, this.change === 'restore' ? asset.original : null],
    );
    asset.expiry = row.rows[0]!.e;
    asset.future = this.change === 'renew';
    if (this.change === 'restore') asset.status = 'active';
  }
  toString = () => `${this.change}(${this.asset})`;
}

class Hold implements Cmd {
  constructor(readonly asset: number, readonly on: boolean) {}
  check = () => true;
  async run(model: Model, real: Real) {
    const asset = pick(model.assets, this.asset);
    if (this.on) await holdsAdd(real.bed.pool, real.target, { ids: [asset.id], reason: 'litigation', until: null, createdBy: 'property-test' });
    else await holdsRemove(real.bed.pool, real.target, [asset.id]);
    asset.held = this.on;
  }
  toString = () => `${this.on ? 'hold' : 'release'}(${this.asset})`;
}

class Pause implements Cmd {
  constructor(readonly on: boolean) {}
  check = () => true;
  async run(model: Model, real: Real) {
    await admissionSetPaused(real.bed.pool, [real.policy.name], this.on, new Map([[real.policy.name, capacityOf(real.policy)]]));
    model.paused = this.on;
  }
  toString = () => (this.on ? 'pause' : 'resume');
}

class TimePasses implements Cmd {
  check = () => true;
  async run(model: Model, real: Real) {
    await makeEverythingDue(real);
    for (const op of model.ops.values()) if (op.state === 'pending') op.due = true;
  }
  toString = () => 'an-hour-passes';
}

const capacityOf = (policy: RemoteDeletePolicy) => bucketShape(policy.admission.ratePerSecond, policy.admission.burst).capacity;

/** "An hour passes" for the ledger: every pending operation's turn comes. */
async function makeEverythingDue(real: Real): Promise<void> {
  await real.bed.pool.query(`UPDATE cleanup_ledger SET not_before = clock_timestamp() WHERE policy = $1 AND state = 'pending' AND not_before > clock_timestamp()`, [
    real.policy.name,
  ]);
}

const scan = fc.integer({ min: 1, max: 0xffff }).map((mask): Cmd => new Scan(mask));
const deliverCmd = fc.tuple(fc.nat(20), fc.constantFrom<1 | 2>(1, 1, 2)).map(([batch, copies]): Cmd => new Deliver(batch, copies));
const claimCmd = fc.tuple(fc.nat(20), fc.nat(2), fc.option(fc.nat(20), { freq: 3 })).map(([batch, owner, other]): Cmd => new Claim(batch, owner, other));
const callCmd = fc
  .tuple(fc.nat(20), fc.constantFrom<CallAnswer>('confirmed', 'confirmed', 'rejected', 'uncertain', 'rate-limited', 'worker-died'), fc.boolean(), fc.constantFrom(0, 20, 100))
  .map(([which, answer, far, retryAfterMs]): Cmd => new Call(which, answer, far, retryAfterMs));
/** Weighted by repetition: the work itself (record, claim, answer) is most of what happens. */
const commands: Array<fc.Arbitrary<Cmd>> = [
  scan,
  scan,
  deliverCmd,
  deliverCmd,
  deliverCmd,
  fc.nat(20).map((asset): Cmd => new Webhook(asset)),
  claimCmd,
  claimCmd,
  claimCmd,
  claimCmd,
  callCmd,
  callCmd,
  callCmd,
  callCmd,
  fc.nat(20).map((which): Cmd => new ExpireLease(which)),
  fc.nat(20).map((which): Cmd => new SameIdReclaim(which)),
  fc.constant<Cmd>(new ReturnExpiredLeases()),
  fc.tuple(fc.nat(20), fc.constantFrom<'renew' | 'restore' | 're-expire' | 'archive'>('renew', 'restore', 're-expire', 'archive')).map(([asset, change]): Cmd => new ChangeRow(asset, change)),
  fc.tuple(fc.nat(20), fc.boolean()).map(([asset, on]): Cmd => new Hold(asset, on)),
  fc.constantFrom(true, false, false).map((on): Cmd => new Pause(on)),
  fc.constant<Cmd>(new TimePasses()),
  fc.integer({ min: 2, max: 5 }).map((n): Cmd => new Hammer(n)),
];

// ----- the checks on the database's own history ---------------------------------------------------

interface HistoryRow {
  operation_key: string;
  state: string;
  outcome: string | null;
  owner: string | null;
  attempt: number;
  lease_ms: number | null;
  at_ms: number;
}

/** Claim instants (ms, database clock) found in the history; checks leases and single completion per key. */
function checkHistory(history: readonly HistoryRow[]): number[] {
  const claims: number[] = [];
  const byKey = new Map<string, HistoryRow[]>();
  for (const row of history) byKey.set(row.operation_key, [...(byKey.get(row.operation_key) ?? []), row]);
  for (const [key, rows] of byKey) {
    let previous: HistoryRow | null = null;
    /** The current claim: who, and until when its lease was live (released earlier, or its expiry). */
    let lease: { owner: string | null; attempt: number; liveUntil: number } | null = null;
    let finishes = 0;
    for (const row of rows) {
      const wasInFlight = previous?.state === 'in_flight';
      if (row.state === 'in_flight') {
        const newClaim = !wasInFlight || row.attempt !== lease?.attempt || row.owner !== lease?.owner;
        if (newClaim) {
          if (lease) assert.ok(lease.liveUntil <= row.at_ms, `${key}: attempt ${row.attempt} (${row.owner}) claimed while attempt ${lease.attempt} (${lease.owner}) still held a live lease`);
          claims.push(row.at_ms);
          lease = { owner: row.owner, attempt: row.attempt, liveUntil: row.lease_ms! };
        } else {
          lease!.liveUntil = row.lease_ms!; // moved (the test expiring it), never extended past a newer claim
        }
      } else if (wasInFlight && lease) {
        lease.liveUntil = Math.min(lease.liveUntil, row.at_ms);
      }
      if (row.state === 'done' && (previous?.state !== 'done' || previous.outcome !== row.outcome)) {
        // A re-openable end ('held', 'superseded', or a confirmation whose row was held) starts over.
        if (row.outcome === 'held' || row.outcome === 'superseded') finishes = 0;
        else finishes += 1;
      }
      if (previous?.state === 'done' && row.state !== 'done') {
        assert.ok(
          previous.outcome === 'held' || previous.outcome === 'superseded',
          `${key}: only an operation stopped by a legal hold or superseded is ever re-opened (was ${previous.outcome})`,
        );
      }
      previous = row;
    }
    assert.equal(previous?.state, 'done', `${key} ends done (is ${previous?.state})`);
    const reopenable = previous?.outcome === 'held' || previous?.outcome === 'superseded';
    assert.equal(finishes, reopenable ? 0 : 1, reopenable ? `${key}: ended ${previous?.outcome}, not finished since` : `${key}: finished exactly once`);
  }
  return claims;
}

function maxInOneSecond(instantsMs: readonly number[]): number {
  const sorted = [...instantsMs].sort((a, b) => a - b);
  let most = 0;
  for (let start = 0, end = 0; start < sorted.length; start++) {
    while (end < sorted.length && sorted[end]! < sorted[start]! + 1000) end++;
    most = Math.max(most, end - start);
  }
  return most;
}

// ----- the property ------------------------------------------------------------------------------

describe('property: the remote-delete ledger under random interleavings (real PostgreSQL)', () => {
  let bed: TestBed;
  let base: RemoteDeletePolicy;
  let baseTarget: ResolvedTarget;
  let runNumber = 0;

  before(async () => {
    bed = await makeTestBed('ledger_property');
    base = parsePolicies(
      mediaPolicyYaml({ baseUrl: 'http://127.0.0.1:9', ratePerSecond: 10, burst: 5, concurrency: 4, maxAttempts: MAX_ATTEMPTS, leaseMs: LEASE_MS }),
      'property.yaml',
      {},
    ).get(MEDIA_POLICY) as RemoteDeletePolicy;
    baseTarget = await targetResolve(bed.pool, base);
    // The history the invariants are checked on: every insert or update of an operation, stamped by
    // the database clock. Observation only: the statements under test are unchanged.
    await bed.pool.query(`
      CREATE TABLE property_ledger_history (
        id bigserial PRIMARY KEY, operation_key text NOT NULL, policy text NOT NULL, state text NOT NULL, outcome text,
        owner text, attempt int NOT NULL, lease_expires_at timestamptz, at timestamptz NOT NULL DEFAULT clock_timestamp());
      CREATE FUNCTION property_ledger_log() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
      BEGIN
        INSERT INTO property_ledger_history (operation_key, policy, state, outcome, owner, attempt, lease_expires_at)
        VALUES (NEW.operation_key, NEW.policy, NEW.state, NEW.outcome, NEW.lease_owner, NEW.attempt_count, NEW.lease_expires_at);
        RETURN NEW;
      END $$;
      CREATE TRIGGER property_ledger_log AFTER INSERT OR UPDATE ON cleanup_ledger FOR EACH ROW EXECUTE FUNCTION property_ledger_log();`);
  });

  after(async () => {
    await bed?.close();
  });

  test(`${RUNS} random command sequences keep the ledger's promises (seed ${SEED})`, { timeout: PROPERTY_TIMEOUT_MS }, async (t) => {
    const property = fc.asyncProperty(
      fc.record({ ratePerSecond: fc.constantFrom(2, 5, 20), burst: fc.integer({ min: 2, max: 6 }), concurrency: fc.integer({ min: 1, max: 8 }), assets: fc.integer({ min: 2, max: 16 }) }),
      fc.commands(commands, { maxCommands: 40, size: 'large' }),
      async (shape, sequence) => {
        runNumber += 1;
        const name = `prop-${runNumber}`;
        const policy: RemoteDeletePolicy = { ...base, name, admission: { ratePerSecond: shape.ratePerSecond, burst: shape.burst, concurrency: shape.concurrency } };
        const real: Real = { bed, policy, target: { ...baseTarget, policy: name } };
        const seeded = await bed.pool.query<{ id: string; e: string }>(
          `INSERT INTO media_assets (asset_id, status, retention_expires_at, url)
           SELECT $1 || '-' || i, 'active', now() - interval '1 hour' + i * interval '1 second' + random() * interval '1 millisecond', 'https://media.example/' || i
           FROM generate_series(1, $2) i RETURNING asset_id AS id, reaper_iso(retention_expires_at) AS e`,
          [name, shape.assets],
        );
        const model: Model = {
          assets: seeded.rows.map((row) => ({ id: row.id, expiry: row.e, original: row.e, future: false, status: 'active', held: false })),
          ops: new Map(),
          batches: [],
          hand: [],
          paused: false,
          calls: 0,
        };
        await fc.asyncModelRun(() => ({ model, real }), sequence);
        const commandsEnded = (await bed.pool.query<{ ms: number }>(`SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8 AS ms`)).rows[0]!.ms;

        // Drain through the same statements: resume, the workers holding claims die, their leases
        // run out, every wait ends; then claim (at a rate that does not slow the test) and confirm
        // until every operation is done. Holds stay: a held asset must end 'held', never called.
        await admissionSetPaused(bed.pool, [name], false, new Map([[name, capacityOf(policy)]]));
        model.paused = false;
        model.hand.length = 0;
        await bed.pool.query(`UPDATE cleanup_ledger SET lease_expires_at = clock_timestamp() - interval '1 millisecond' WHERE policy = $1 AND state = 'in_flight'`, [name]);
        for (const op of model.ops.values()) if (op.state === 'in_flight') Object.assign(op, { leaseExpired: true, due: true });
        await makeEverythingDue(real);
        for (const op of model.ops.values()) if (op.state === 'pending') op.due = true;
        const fast: RemoteDeletePolicy = { ...policy, admission: { ratePerSecond: 10_000, burst: 1_000, concurrency: 1_000 } };
        for (let round = 0; [...model.ops.values()].some((op) => op.state !== 'done'); round++) {
          assert.ok(round < 200, 'the drain finishes');
          const open = [...model.ops.values()].filter((op) => op.state !== 'done').map((op) => op.key);
          const batch: BatchModel = { batchId: `drain:${name}`, cutoff: await dbNow(real), items: [], known: open };
          const before = model.hand.length;
          await claim(model, real, [{ batch, owner: 'drainer' }], fast);
          for (const inHand of model.hand.splice(before)) {
            model.hand.push(inHand);
            await answerCall(model, real, inHand, 'confirmed', 0, 0);
          }
          // A 429 block (at most 100 ms) may still be running.
          if ([...model.ops.values()].some((op) => op.state !== 'done')) await new Promise((resolve) => setTimeout(resolve, 10));
        }

        const rows = await bed.pool.query<{ operation_key: string; state: string }>(`SELECT operation_key, state FROM cleanup_ledger WHERE policy = $1`, [name]);
        assert.deepEqual(rows.rows.map((row) => row.operation_key).sort(), [...model.ops.keys()].sort(), 'the ledger holds exactly the operations the model expects');
        assert.ok(rows.rows.every((row) => row.state === 'done'), 'every operation is done');
        const history = await bed.pool.query<HistoryRow>(
          `SELECT operation_key, state, outcome, owner, attempt,
                  (extract(epoch FROM lease_expires_at) * 1000)::float8 AS lease_ms, (extract(epoch FROM at) * 1000)::float8 AS at_ms
           FROM property_ledger_history WHERE policy = $1 ORDER BY id`,
          [name],
        );
        const claimsAt = checkHistory(history.rows);
        const limit = policy.admission.ratePerSecond + policy.admission.burst;
        const most = maxInOneSecond(claimsAt.filter((at) => at < commandsEnded));
        assert.ok(most <= limit, `${most} grants in one second, above rate + burst = ${limit}`);
        stats.runs += 1;
        stats.mostInOneSecond = Math.max(stats.mostInOneSecond, most / limit);
      },
    );
    try {
      await fc.assert(property, { numRuns: RUNS, seed: SEED });
    } catch (error) {
      throw new Error(`ledger property failed; replay with REAPER_PROPERTY_SEED=${SEED}\n${(error as Error).message}`);
    }
    t.diagnostic(`exercised: ${JSON.stringify(stats)}`);
  });
});
