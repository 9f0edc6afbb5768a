#!/usr/bin/env node
// Runs the compiled test suite with Node's test runner, several files at once (each file has its
// own database and broker prefix). `npm test` builds first (pretest). Extra arguments are passed
// on, e.g. `npm test -- --test-name-pattern=duplicate`.
const { spawnSync } = require('node:child_process');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const args = process.argv.slice(2);
const files = args.filter((arg) => !arg.startsWith('--'));
const flags = args.filter((arg) => arg.startsWith('--'));
const targets = files.length > 0 ? files.map((file) => path.join('dist', file.replace(/\.ts$/, '.js'))) : ['dist/test/'];
const result = spawnSync(process.execPath, ['--test', '--test-concurrency=3', '--test-timeout=180000', ...flags, ...targets], {
  cwd: root,
  stdio: 'inherit',
});
process.exit(result.status ?? 1);
