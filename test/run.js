#!/usr/bin/env node
// Runs the compiled test suite with Node's test runner, three files at a time (each file has its
// own database and broker prefix). `npm test` builds first (pretest). Files are listed here rather
// than by directory: Node 20 would also run every .js under a "test" folder (the support code).
// `npm test -- test/unit/policies.test.ts` runs one file; flags (--test-name-pattern=...) pass on.
// Files named *.serial.test.ts measure rates against the clock: they run afterwards, alone, so the
// other files' load on a 2-core machine does not decide their result.
// Every test has a timeout (--test-timeout, 120 s by default; REAPER_TEST_TIMEOUT_MS or an explicit
// --test-timeout=<ms> overrides it): a test that waits forever fails with its name instead of
// hanging the run. The longest fault tests take about 30 s alone, under load three times that.
const { spawnSync } = require('node:child_process');
const { readdirSync } = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const args = process.argv.slice(2);
const flags = args.filter((arg) => arg.startsWith('--'));
if (!flags.some((flag) => flag.startsWith('--test-timeout'))) flags.push(`--test-timeout=${Number(process.env.REAPER_TEST_TIMEOUT_MS ?? 120_000)}`);
const chosen = args.filter((arg) => !arg.startsWith('--'));

function testFiles(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) return testFiles(full);
    return entry.name.endsWith('.test.js') ? [full] : [];
  });
}

const files =
  chosen.length > 0
    ? chosen.map((file) => path.join(root, 'dist', file.replace(/\.ts$/, '.js')))
    : testFiles(path.join(root, 'dist', 'test')).sort();
if (files.length === 0) {
  console.error('no compiled test files found under dist/test (run `npm run build`)');
  process.exit(1);
}
const serial = files.filter((file) => file.endsWith('.serial.test.js'));
const parallel = files.filter((file) => !file.endsWith('.serial.test.js'));
let status = 0;
for (const [group, concurrency] of [[parallel, 3], [serial, 1]]) {
  if (group.length === 0) continue;
  const result = spawnSync(process.execPath, ['--test', `--test-concurrency=${concurrency}`, ...flags, ...group], { cwd: root, stdio: 'inherit' });
  if (result.status !== 0) status = result.status ?? 1;
}
process.exit(status);
