#!/usr/bin/env node
// Runs the compiled test suite with Node's test runner, three files at a time (each file has its
// own database and broker prefix). `npm test` builds first (pretest). Files are listed here rather
// than by directory: Node 20 would also run every .js under a "test" folder (the support code).
// `npm test -- test/unit/policies.test.ts` runs one file; flags (--test-name-pattern=...) pass on.
const { spawnSync } = require('node:child_process');
const { readdirSync } = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
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

const files =
  chosen.length > 0
    ? chosen.map((file) => path.join(root, 'dist', file.replace(/\.ts$/, '.js')))
    : testFiles(path.join(root, 'dist', 'test')).sort();
if (files.length === 0) {
  console.error('no compiled test files found under dist/test (run `npm run build`)');
  process.exit(1);
}
const result = spawnSync(process.execPath, ['--test', '--test-concurrency=3', ...flags, ...files], { cwd: root, stdio: 'inherit' });
process.exit(result.status ?? 1);
