import assert from 'node:assert/strict';
import { test } from 'node:test';
import { formatDuration, humanLogDestination, wrap } from '../../services/cli/output';

/** Issue 42 item 4: output for people (durations, wrapped text, log lines as text). */

test('durations read as 850ms, 4.2s, 42s, 4m05s, 23h51m, 3d04h (not 85864.062s)', () => {
  assert.equal(formatDuration(0), '0s');
  assert.equal(formatDuration(0.85), '850ms');
  assert.equal(formatDuration(0.0004), '1ms', 'never "0ms" for a duration that is not zero');
  assert.equal(formatDuration(4.2), '4.2s');
  assert.equal(formatDuration(4), '4s');
  assert.equal(formatDuration(42.1), '43s', 'whole seconds round up (an ETA is never early)');
  assert.equal(formatDuration(245), '4m05s');
  assert.equal(formatDuration(85_864.062), '23h51m');
  assert.equal(formatDuration(3 * 86_400 + 4 * 3600 + 59), '3d04h');
  assert.equal(formatDuration(Number.NaN), '?');
});

test('wrap breaks at spaces within the width, indents the lines after the first, and loses nothing', () => {
  const text = 'the scan would publish 120000 candidates > limits.maxPerRun 50000 (approve with reaper approve) averyveryveryverylongwordthatcannotbreak';
  const wrapped = wrap(text, 30, 4);
  const lines = wrapped.split('\n');
  assert.ok(lines.length > 3);
  assert.ok(lines.every((line) => line.length <= 30), wrapped);
  assert.ok(lines.slice(1).every((line) => line.startsWith('    ')), wrapped);
  assert.equal(lines.map((line) => line.trim()).join(' ').replace(/\s+/g, ''), text.replace(/\s+/g, ''), 'every character is kept');
  assert.equal(wrap('short', 30), 'short');
  assert.equal(wrap('', 30), '');
});

test('a log line for a person is one line of text with its fields, not JSON', () => {
  const written: string[] = [];
  const destination = humanLogDestination({ write: (text: string) => written.push(text) } as unknown as NodeJS.WritableStream);
  destination.write(`${JSON.stringify({ level: 40, time: '2026-01-01T00:00:00.000Z', pid: 1, hostname: 'h', service: 'cli', workerId: 'cli:x', counted: 1200, reason: 'over limits', msg: 'run over its allowance' })}\n`);
  assert.deepEqual(written, ['reaper: warning: run over its allowance (counted 1200, reason over limits)\n']);
});
