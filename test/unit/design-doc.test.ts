import assert from 'node:assert/strict';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';
import { parsePolicies } from '../../shared/config/policies';

/**
 * The design the code cites lives in the repository (issue 13 item 9): docs/design.md exists with
 * its numbered invariants, every "design.md invariant N" citation names an invariant that exists,
 * the README links the document, and every test file the README's "Tests" table names exists.
 */
const root = path.resolve(__dirname, '..', '..', '..');
const read = (file: string) => readFileSync(path.join(root, file), 'utf8');

function sourceFiles(dir: string): string[] {
  const full = path.join(root, dir);
  if (!existsSync(full)) return [];
  return readdirSync(full, { withFileTypes: true }).flatMap((entry) => {
    const relative = path.join(dir, entry.name);
    if (entry.isDirectory()) return entry.name === 'node_modules' ? [] : sourceFiles(relative);
    return /\.(ts|js|sql|ya?ml)$/.test(entry.name) ? [relative] : [];
  });
}

function invariantsOfDesign(): Map<number, string> {
  const design = read('docs/design.md');
  const section = design.slice(design.indexOf('## Invariants'), design.indexOf('## Contracts'));
  return new Map([...section.matchAll(/^(\d+)\. (.+)$/gm)].map((match) => [Number(match[1]), match[2]!]));
}

test('docs/design.md holds the invariants (1..18 at least, numbered without gaps), the contracts and the ledger state machine', () => {
  const invariants = invariantsOfDesign();
  assert.ok(invariants.size >= 18, `at least 18 invariants (has ${invariants.size})`);
  assert.deepEqual([...invariants.keys()], Array.from({ length: invariants.size }, (_, i) => i + 1));
  const design = read('docs/design.md');
  for (const heading of ['## Contracts others rely on', '## The ledger state machine', '## Where things live']) assert.ok(design.includes(heading), heading);
  assert.match(design, /\(new\) ──> pending ─+> in_flight/, 'the ledger drawing');
});

test('every "design.md invariant N" citation in code and tests names an invariant of docs/design.md', () => {
  const invariants = invariantsOfDesign();
  const bad: string[] = [];
  for (const file of ['services', 'shared', 'test', 'bench', 'infra'].flatMap(sourceFiles)) {
    for (const match of read(file).matchAll(/design\.md,? invariants? ([\d ,and]+)/gi)) {
      for (const n of match[1]!.match(/\d+/g) ?? []) if (!invariants.has(Number(n))) bad.push(`${file}: invariant ${n}`);
    }
  }
  assert.deepEqual(bad, []);
});

test('the README links docs/design.md, and every test file its "Tests" section names exists', () => {
  const readme = read('README.md');
  assert.match(readme, /\]\(docs\/design\.md\)/);
  const tests = readme.slice(readme.indexOf('## Tests'), readme.indexOf('## Dependencies'));
  const named = [...new Set([...tests.matchAll(/`((?:unit|integration|faults)\/[\w.-]+\.test\.ts)`/g)].map((m) => m[1]!))];
  assert.ok(named.length >= 10, `the table names the tests (${named.length})`);
  assert.deepEqual(named.filter((file) => !existsSync(path.join(root, 'test', file))), [], 'named test files exist');
});

test('every policies example in README.md and docs/configuration.md is a valid policies file (the validator reads it as a deployment would)', () => {
  let examples = 0;
  for (const file of ['README.md', 'docs/configuration.md']) {
    for (const [, yaml] of read(file).matchAll(/```yaml\n(policies:\n[\s\S]*?)```/g)) {
      examples++;
      const names = [...parsePolicies(yaml!, file, { MEDIA_API_URL: 'http://127.0.0.1:8081' }, () => 'secret').keys()];
      assert.ok(names.length >= 2, `${file}: an example with ${names.length} policies`);
    }
  }
  assert.ok(examples >= 2, `README.md and docs/configuration.md each show a policies file (found ${examples})`);
});
