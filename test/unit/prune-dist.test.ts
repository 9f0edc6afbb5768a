import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';

/** bin/prune-dist.js, run by `npm run build` before the incremental tsc. */
const { pruneDist } = require(path.resolve(__dirname, '..', '..', '..', 'bin', 'prune-dist.js')) as {
  pruneDist: (root: string) => { pruned: number; missing: number; sources: number };
};

function tree(files: string[]): string {
  const root = mkdtempSync(path.join(tmpdir(), 'reaper-prune-'));
  for (const file of files) {
    mkdirSync(path.dirname(path.join(root, file)), { recursive: true });
    writeFileSync(path.join(root, file), '');
  }
  return root;
}

test('an output whose source is gone is removed (a deleted test file must not run again); the build info stays when every source has its output', () => {
  const root = tree(['shared/a.ts', 'dist/shared/a.js', 'dist/shared/a.js.map', 'dist/test/unit/gone.test.js', 'dist/test/unit/gone.test.js.map', 'dist/.tsbuildinfo']);
  try {
    assert.deepEqual(pruneDist(root), { pruned: 2, missing: 0, sources: 1 });
    assert.equal(existsSync(path.join(root, 'dist/test/unit/gone.test.js')), false);
    assert.equal(existsSync(path.join(root, 'dist/shared/a.js')), true);
    assert.equal(existsSync(path.join(root, 'dist/.tsbuildinfo')), true, 'nothing missing: the next build stays incremental');
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});

test('a source without its output (deleted by hand) removes the build info, so tsc emits everything again', () => {
  const root = tree(['shared/a.ts', 'shared/b.ts', 'shared/types.d.ts', 'dist/shared/a.js', 'dist/.tsbuildinfo']);
  try {
    assert.deepEqual(pruneDist(root), { pruned: 0, missing: 1, sources: 2 });
    assert.equal(existsSync(path.join(root, 'dist/.tsbuildinfo')), false);
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});
