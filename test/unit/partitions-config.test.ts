import assert from 'node:assert/strict';
import { test } from 'node:test';
import { parsePolicies, retiresPartitions, type RowDeletePolicy } from '../../shared/config/policies';
import { classifyByCatalog } from '../../shared/partitions/classify';
import type { PartitionInfo } from '../../shared/db/queries/partitions';

const policy = (partitions: string) => `policies:
  - name: day-events
    kind: row-delete
    schedule: "* * * * *"
    table: events_by_day
    key: id
    expiresAt: expires_at
${partitions}`;

test('partitions: quarantineDays defaults to 7; a negative one is refused naming the field and the value', () => {
  const parsed = parsePolicies(policy('    partitions: { retire: true }\n'), 'test', {}).get('day-events') as RowDeletePolicy;
  assert.deepEqual(parsed.partitions, { retire: true, quarantineDays: 7 });
  assert.equal(retiresPartitions(parsed), true);
  assert.throws(() => parsePolicies(policy('    partitions: { retire: true, quarantineDays: -1 }\n'), 'test', {}), /policies\.0\.partitions\.quarantineDays: must be 0 or more .*\(got -1\)/);
  assert.throws(() => parsePolicies(policy('    partitions: { retire: true, keep: 1 }\n'), 'test', {}), /policies\.0\.partitions/);
  const off = parsePolicies(policy(''), 'test', {}).get('day-events')!;
  assert.equal(retiresPartitions(off), false);
});

test('classifyByCatalog: the default partition, a pending detach, a foreign key, the bounds', () => {
  const cutoff = Date.parse('2026-01-10T00:00:00Z');
  const base: PartitionInfo = { qualified: 'public.p', schema: 'public', name: 'p', bound: 'x', isDefault: false, lower: '2026-01-01T00:00:00.000000Z', upper: '2026-01-02T00:00:00.000000Z', detachPending: false, kind: 'table', referencedBy: [] };
  assert.equal(classifyByCatalog(base, cutoff), null, 'decided by its rows');
  assert.equal(classifyByCatalog({ ...base, upper: '2026-01-10T00:00:00.000000Z' }, cutoff), null, 'an upper bound equal to the cutoff: every row is below it');
  assert.equal(classifyByCatalog({ ...base, isDefault: true, lower: null, upper: null }, cutoff)?.class, 'blocked');
  assert.equal(classifyByCatalog({ ...base, detachPending: true }, cutoff)?.class, 'blocked');
  assert.match(classifyByCatalog({ ...base, referencedBy: ['fk on notes'] }, cutoff)!.reason, /fk on notes/);
  assert.equal(classifyByCatalog({ ...base, upper: null }, cutoff)?.class, 'mixed');
  assert.equal(classifyByCatalog({ ...base, upper: '2026-01-10T00:00:00.001000Z' }, cutoff)?.class, 'mixed');
  assert.equal(classifyByCatalog({ ...base, lower: '2026-01-11T00:00:00.000000Z', upper: '2026-01-12T00:00:00.000000Z' }, cutoff)?.class, 'unexpired');
});
