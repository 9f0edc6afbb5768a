import assert from 'node:assert/strict';
import { test } from 'node:test';
import { prepared } from '../../shared/db/queries/prepared';

/**
 * PostgreSQL keeps the first 63 bytes of a statement name and cuts the rest silently: two labels
 * that differ only past that point would name one statement, and a connection would execute the
 * other's text with this one's values. The label is bounded so that every name fits.
 */
test('prepared statement names: every allowed label makes a name PostgreSQL keeps whole; a longer or odd label is refused naming it', () => {
  const longest = 'a'.repeat(31);
  const { name } = prepared(longest, 'SELECT 1', []);
  assert.ok(Buffer.byteLength(name) <= 63, `${name} is ${Buffer.byteLength(name)} bytes`);
  assert.ok(name.startsWith(`reaper_${longest}_`), 'the label starts the name, so a trace can tell which statement it is');
  assert.notEqual(prepared(longest, 'SELECT 2', []).name, name, 'another text, another name');
  assert.throws(() => prepared('a'.repeat(32), 'SELECT 1', []), /1-31 of \[a-z_\], got "a{32}"/);
  assert.throws(() => prepared('', 'SELECT 1', []), /got ""/);
  assert.throws(() => prepared('Take-1', 'SELECT 1', []), /got "Take-1"/);
});
