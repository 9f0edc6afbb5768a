#!/usr/bin/env node
// Runs the compiled test suite with Node's test runner, three or four files at a time (each file has
// its own database and broker prefix; see `concurrency` below). `npm test` builds first
// (pretest). Files are listed here rather than by directory: Node 20 would also run every .js
// under a "test" folder (the support code).
// `npm test -- test/unit/policies.test.ts` runs one file; flags (--test-name-pattern=...) pass on.
// Files named *.serial.test.ts measure rates against the clock: they run afterwards, alone, so the
// other files' load on a 2-core machine does not decide their result.
//
// Every test and hook has a timeout (120 s, REAPER_TEST_TIMEOUT_MS overrides it; an explicit
// `timeout` option wins): from Node 22 `--test-timeout` bounds each test and hook; on Node 20 it
// bounds a whole file (killed without its `after` hooks, reported without the name of the test
// that hung), so there the preload test/support/timeouts.ts gives each test and hook the option
// instead. `--test-force-exit` ends a file once its tests are done even when a test that timed
// out still holds a socket or a timer. Before the run, leftovers of earlier runs that were
// killed (older than an hour) are removed (test/support/sweeper.ts). A test that needs a tool the
// machine lacks is skipped with one line naming it (test/support/requirements.ts); the skips are
// counted at the end, and REAPER_TEST_REQUIRE_ALL=1 makes each of them a failure instead.
const { spawnSync } = require('node:child_process');
const { mkdtempSync, readdirSync, readFileSync, rmSync } = require('node:fs');
const { tmpdir } = require('node:os');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const dist = path.join(root, 'dist');
const args = process.argv.slice(2);
const flags = args.filter((arg) => arg.startsWith('--'));
const chosen = args.filter((arg) => !arg.startsWith('--'));

function testFiles(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) return testFiles(full);
    return entry.name.endsWith('.test.js') ? [full] : [];
  });
}

/** The share of all CPUs' time spent idle over the next `ms` (from /proc/stat; 1 where it cannot be read, e.g. not Linux). */
async function cpuIdleShare(ms) {
  const read = () => {
    const fields = readFileSync('/proc/stat', 'utf8').split('\n')[0].trim().split(/\s+/).slice(1).map(Number);
    return { idle: fields[3] + (fields[4] || 0), total: fields.reduce((sum, n) => sum + n, 0) };
  };
  try {
    const before = read();
    await new Promise((resolve) => setTimeout(resolve, ms));
    const after = read();
    return after.total > before.total ? (after.idle - before.idle) / (after.total - before.total) : 1;
  } catch {
    return 1;
  }
}

async function main() {
  const files = chosen.length > 0 ? chosen.map((file) => path.join(dist, file.replace(/\.ts$/, '.js'))) : testFiles(path.join(dist, 'test')).sort();
  if (files.length === 0) {
    console.error('no compiled test files found under dist/test (run `npm run build`)');
    return 1;
  }
  // Only when a file needs the servers: the unit tests run without them (CI runs them on Node 24 too).
  if (!process.env.REAPER_TEST_NO_SWEEP && files.some((file) => !file.includes(`${path.sep}unit${path.sep}`))) {
    const { sweepLeftovers, describeSweep } = require(path.join(dist, 'test', 'support', 'sweeper.js'));
    const lines = await sweepLeftovers().then(describeSweep, (error) => [`leftover sweep failed (the run goes on): ${error.message}`]);
    for (const line of lines) console.log(`# ${line}`);
  }
  const skipLog = path.join(mkdtempSync(path.join(tmpdir(), 'reaper-skips-')), 'skips');
  const env = { ...process.env, REAPER_TEST_SKIP_LOG: skipLog };
  const timeoutMs = Number(process.env.REAPER_TEST_TIMEOUT_MS || 120_000);
  if (!Number.isInteger(timeoutMs) || timeoutMs <= 0) {
    console.error(`REAPER_TEST_TIMEOUT_MS must be a positive whole number of milliseconds, got ${JSON.stringify(process.env.REAPER_TEST_TIMEOUT_MS)}`);
    return 1;
  }
  // Files of the parallel group at once: REAPER_TEST_CONCURRENCY, else by the machine's state at
  // the start. Each file mostly waits on its services (a file's node processes used a third to half
  // a core on average, issue 43), so an idle machine runs 4 (the parallel group took 372 s at 3 on
  // an idle 2-core machine; 4 was 5-20 % faster on the same files), and one already busy 3 (another
  // job, CI's busy loops), which keeps the timing-sensitive files within their bounds. Busy means
  // less than half of the CPU idle over one second now: the load average would still count the
  // build that just ran (2.6 on an idle machine right after `npm ci` and tsc). The serial group runs
  // one file at a time whatever this says.
  const idleShare = await cpuIdleShare(1_000);
  const busy = idleShare < 0.5;
  const concurrency = Number(process.env.REAPER_TEST_CONCURRENCY || (busy ? 3 : 4));
  if (!Number.isInteger(concurrency) || concurrency <= 0 || concurrency > 16) {
    console.error(`REAPER_TEST_CONCURRENCY must be a whole number of files from 1 to 16, got ${JSON.stringify(process.env.REAPER_TEST_CONCURRENCY)}`);
    return 1;
  }
  console.log(`# ${concurrency} files at once in the parallel group (${process.env.REAPER_TEST_CONCURRENCY ? 'REAPER_TEST_CONCURRENCY' : `CPU ${(idleShare * 100).toFixed(0)} % idle over 1 s: ${busy ? 'busy' : 'idle'}`})`);
  const perTestTimeout = Number(process.versions.node.split('.')[0]) >= 22 ? [`--test-timeout=${timeoutMs}`] : ['--require', path.join(dist, 'test', 'support', 'timeouts.js')];
  const preload = [...perTestTimeout, '--test-force-exit'];
  const serial = files.filter((file) => file.endsWith('.serial.test.js'));
  const parallel = files.filter((file) => !file.endsWith('.serial.test.js'));
  let status = 0;
  // Per-file durations (test/slowest-reporter.mjs) beside the usual output: the slowest are printed at the end.
  const timings = path.join(path.dirname(skipLog), 'timings');
  const reporters = [`--test-reporter=${process.stdout.isTTY ? 'spec' : 'tap'}`, '--test-reporter-destination=stdout', `--test-reporter=${path.join(root, 'test', 'slowest-reporter.mjs')}`, `--test-reporter-destination=${timings}`];
  const userReporter = flags.some((flag) => flag.startsWith('--test-reporter'));
  const byFile = new Map();
  // Each group's wall time, printed at the end (issue 43 item 4 measures npm test's time by them).
  const groupSeconds = [];
  for (const [group, atOnce] of [[parallel, concurrency], [serial, 1]]) {
    if (group.length === 0) continue;
    rmSync(timings, { force: true });
    const groupStarted = Date.now();
    const result = spawnSync(process.execPath, [...preload, '--test', `--test-concurrency=${atOnce}`, ...(userReporter ? [] : reporters), ...flags, ...group], { cwd: root, stdio: 'inherit', env });
    if (result.status !== 0) status = result.status ?? 1;
    groupSeconds.push(`${atOnce === 1 && group === serial ? 'serial' : 'parallel'} ${((Date.now() - groupStarted) / 1000).toFixed(0)} s (${group.length} files)`);
    let lines = [];
    try {
      lines = readFileSync(timings, 'utf8').split('\n').filter(Boolean);
    } catch {
      // no timings (a user reporter, or nothing ran)
    }
    for (const line of lines) {
      const { file, ms } = JSON.parse(line);
      byFile.set(file, (byFile.get(file) ?? 0) + ms);
    }
  }
  const slowest = [...byFile].sort((a, b) => b[1] - a[1]).slice(0, 10);
  if (slowest.length > 0) {
    console.log(`# slowest files (seconds, each file start to end; ${concurrency} run at once in the parallel group):`);
    for (const [file, ms] of slowest) console.log(`#   ${(ms / 1000).toFixed(1).padStart(6)}  ${path.relative(dist, file)}`);
  }
  if (groupSeconds.length > 0) console.log(`# wall time: ${groupSeconds.join(', ')}`);
  let skips = [];
  try {
    skips = readFileSync(skipLog, 'utf8').split('\n').filter(Boolean);
  } catch {
    // no file: nothing was skipped
  }
  rmSync(path.dirname(skipLog), { recursive: true, force: true });
  console.log(`# skipped for a missing tool: ${skips.length}${skips.length > 0 ? ' (REAPER_TEST_REQUIRE_ALL=1 makes these failures)' : ''}`);
  for (const line of skips) console.log(`#   ${line}`);
  return status;
}

main().then(
  (status) => process.exit(status),
  (error) => {
    console.error(error);
    process.exit(1);
  },
);
