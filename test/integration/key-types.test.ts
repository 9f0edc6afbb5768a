import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { targetResolve } from '../../shared/db/queries/target';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 40 (smaller items): a key's text names its row in the ledger, the audit, holds and event
 * ids, so one value must always read the same. numeric without a scale keeps what was typed (1.0
 * and 1.00 are one value, two texts), timestamptz prints by the session's TimeZone and a date by
 * its DateStyle: such keys were accepted, and are refused at start-up now, naming column and type.
 */
let bed: TestBed;

before(async () => {
  bed = await makeTestBed('key_types');
});

after(async () => {
  await bed?.close();
});

const spec = (table: string) => ({ name: table, table, key: 'k', expiresAt: 'expires_at', guard: {} });

test('keys whose text is not one per value are refused, naming the column and the type', async () => {
  for (const [table, type] of [
    ['key_numeric', 'numeric'],
    ['key_timestamptz', 'timestamp with time zone'],
    ['key_date', 'date'],
    ['key_float', 'double precision'],
  ] as const) {
    await bed.pool.query(`CREATE TABLE ${table} (k ${type} PRIMARY KEY, expires_at timestamptz NOT NULL)`);
    await assert.rejects(targetResolve(bed.pool, spec(table)), new RegExp(`key column "k" of table "${table}" is ${type}, whose text is not one per value`), table);
  }
});

test('integers, text, varchar, char, uuid and numeric with a scale are accepted', async () => {
  for (const [table, type] of [
    ['key_int', 'integer'],
    ['key_bigint', 'bigint'],
    ['key_text', 'text'],
    ['key_varchar', 'varchar(40)'],
    ['key_char', 'char(8)'],
    ['key_uuid', 'uuid'],
    ['key_scaled', 'numeric(12,2)'],
  ] as const) {
    await bed.pool.query(`CREATE TABLE ${table} (k ${type} PRIMARY KEY, expires_at timestamptz NOT NULL)`);
    const target = await targetResolve(bed.pool, spec(table));
    assert.ok(target.keyType.length > 0, table);
  }
});
