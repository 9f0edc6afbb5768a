import assert from 'node:assert/strict';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';
import ts from 'typescript';

/**
 * No module of the product imports itself through others (issue 42 item 7). A circle makes the
 * load order decide what a module sees at start (an import still undefined), and it means the
 * modules cannot be read, or moved, one at a time: expiring-rows, archive and holds were one knot
 * through the type ResolvedTarget until it got its own module (shared/db/queries/target.ts).
 * Type-only imports count too: they are the dependencies a reader follows.
 */
const root = path.resolve(__dirname, '..', '..', '..');
const PRODUCT_FOLDERS = ['shared', 'services', 'tools'];

function sourceFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) return sourceFiles(full);
    return entry.name.endsWith('.ts') && !entry.name.endsWith('.d.ts') ? [full] : [];
  });
}

/** Each file's relative imports (import, import type, export ... from, require, import()) that name a file of the folders. */
function importGraph(files: readonly string[]): Map<string, string[]> {
  const known = new Set(files);
  const graph = new Map<string, string[]>();
  for (const file of files) {
    const imported = ts.preProcessFile(readFileSync(file, 'utf8'), true, true).importedFiles;
    const targets = imported
      .filter((entry) => entry.fileName.startsWith('.'))
      .map((entry) => path.resolve(path.dirname(file), entry.fileName))
      .map((base) => [`${base}.ts`, path.join(base, 'index.ts')].find((candidate) => existsSync(candidate)))
      .filter((candidate): candidate is string => candidate !== undefined && known.has(candidate));
    graph.set(file, targets);
  }
  return graph;
}

/** Every circle a depth-first walk meets, each as the path from a module back to itself. */
function findCycles(graph: ReadonlyMap<string, readonly string[]>): string[][] {
  const state = new Map<string, 'open' | 'done'>();
  const stack: string[] = [];
  const cycles: string[][] = [];
  const visit = (node: string): void => {
    state.set(node, 'open');
    stack.push(node);
    for (const next of graph.get(node) ?? []) {
      if (state.get(next) === 'open') cycles.push([...stack.slice(stack.indexOf(next)), next]);
      else if (!state.has(next)) visit(next);
    }
    stack.pop();
    state.set(node, 'done');
  };
  for (const node of graph.keys()) if (!state.has(node)) visit(node);
  return cycles;
}

test('findCycles finds a circle of three, a module importing itself, and none in a chain', () => {
  const circle = new Map([['a', ['b']], ['b', ['c']], ['c', ['a']], ['d', ['a']]]);
  assert.deepEqual(findCycles(circle), [['a', 'b', 'c', 'a']]);
  assert.deepEqual(findCycles(new Map([['a', ['a']]])), [['a', 'a']]);
  assert.deepEqual(findCycles(new Map([['a', ['b']], ['b', ['c']], ['c', []]])), []);
});

test('no circular import among the modules of shared/, services/ and tools/', () => {
  const files = PRODUCT_FOLDERS.flatMap((folder) => sourceFiles(path.join(root, folder)));
  assert.ok(files.length > 50, `expected the product's sources under ${root}, found ${files.length} files`);
  const graph = importGraph(files);
  // The walk sees the graph: the imports the circle once went through are found.
  const expiringRows = path.join(root, 'shared/db/queries/expiring-rows.ts');
  assert.ok(graph.get(expiringRows)?.includes(path.join(root, 'shared/db/queries/holds.ts')), 'expiring-rows imports holds');
  const cycles = findCycles(graph).map((cycle) => cycle.map((file) => path.relative(root, file)).join(' -> '));
  assert.deepEqual(cycles, [], `circular imports:\n${cycles.join('\n')}`);
});
