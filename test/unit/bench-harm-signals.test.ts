/**
 * The harm-signals probe (bench/probes/harm-signals.ts, issue 41): its per-second reading of the
 * round trip (bench/lib/stats.ts meansBySecond), and its settings refused with a clear error, naming
 * the setting and the value, before it touches the database.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import path from 'node:path';
import { meansBySecond } from '../../bench/lib/stats';

test('meansBySecond: the mean of each whole second of the window, in order; a second with no sample is left out, not read as 0', () => {
  // Seconds [0, 1000), [1000, 2000), [2000, 3000): two samples, none (a round trip sent at 900 ms took
  // 1.5 s), one. The probe's first version read the empty second as a mean of 0 (the best second of
  // all), so a stall lowered the per-second reading it should raise.
  const samples: Array<[number, number]> = [
    [100, 0.4],
    [900, 1500],
    [2_500, 0.6],
    [3_000, 9], // at the window's end: outside it
  ];
  assert.deepEqual(meansBySecond(samples, 0, 3_000), [750.2, 0.6]);
  // A window shorter than a second has no whole second; one of 2.5 s has two.
  assert.deepEqual(meansBySecond(samples, 0, 999), []);
  assert.deepEqual(meansBySecond(samples, 500, 3_000), [1500]);
});

const probe = path.resolve(__dirname, '..', '..', 'bench', 'probes', 'harm-signals.js');

for (const [name, value, expected] of [
  ['HARM_PROBE_PAUSES', '100,', /HARM_PROBE_PAUSES must be whole ms >= 0, comma-separated; got "100,"/],
  ['HARM_PROBE_PAUSES', '-5', /HARM_PROBE_PAUSES must be whole ms >= 0, comma-separated; got "-5"/],
  ['HARM_PROBE_SCRIPT', 'toString', /HARM_PROBE_SCRIPT must be one of read, write; got "toString"/],
  ['HARM_PROBE_ROUNDS', '0', /HARM_PROBE_ROUNDS must be a positive whole number; got "0"/],
  ['HARM_PROBE_PROBE_MS', 'fast', /HARM_PROBE_PROBE_MS must be a positive whole number; got "fast"/],
] as const) {
  test(`the probe refuses ${name}=${JSON.stringify(value)} with a clear error and exit code 2, before any database work`, () => {
    // An unreachable database: had the probe gone past its settings, it would fail on connecting instead.
    const result = spawnSync(process.execPath, [probe], { env: { ...process.env, DATABASE_URL: 'postgres://nobody@127.0.0.1:1/none', [name]: value }, encoding: 'utf8', timeout: 30_000 });
    assert.equal(result.status, 2, `exit code (stderr: ${result.stderr})`);
    assert.match(result.stderr, expected);
    assert.doesNotMatch(result.stderr, /\n\s+at /, 'no stack trace for a setting');
  });
}
