/**
 * The runtime image's file list, computed from infra/Dockerfile's COPY lines and .dockerignore
 * (no Docker daemon needed), holds no test code, no dependencies or build output from the
 * developer's tree, and no secret-looking file (issue 11).
 *
 *  - the build context is the repository minus .dockerignore (Docker's matching: a pattern
 *    excludes a path and everything under it; `**` spans directories);
 *  - the build stage compiles the .ts files it copied (tsc: dist/<path>.js);
 *  - the runtime stage takes files from the context and subtrees of the build stage's /app.
 *
 * The runtime image carries neither the failpoint module (shared/testing) nor the stand-in media
 * API (tools/, only in the `demo` target): product code reaches both lazily (require at first use),
 * so no product file imports them statically and KNOWN_TEST_IMPORTS is empty.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import path from 'node:path';
import { ROOT, dockerfile, runtimeStage, stageInstructions, type Instruction } from '../support/deployment-files';

/** Product files allowed to import from test/ for now, and what they import (see the header). */
const KNOWN_TEST_IMPORTS = new Map<string, string[]>();

// ------------------------------------------------------------------------------------------------
// .dockerignore
// ------------------------------------------------------------------------------------------------

function globToRegExp(pattern: string): RegExp {
  let source = '';
  for (let i = 0; i < pattern.length; i++) {
    const char = pattern[i]!;
    if (char === '*' && pattern[i + 1] === '*') {
      // `**/` matches any number of directories, including none.
      source += pattern[i + 2] === '/' ? '(?:.*/)?' : '.*';
      i += pattern[i + 2] === '/' ? 2 : 1;
    } else if (char === '*') source += '[^/]*';
    else if (char === '?') source += '[^/]';
    else source += char.replace(/[.+^${}()|[\]\\]/g, '\\$&');
  }
  return new RegExp(`^${source}$`);
}

const ignoreRules = readFileSync(path.join(ROOT, '.dockerignore'), 'utf8')
  .split('\n')
  .map((line) => line.trim())
  .filter((line) => line !== '' && !line.startsWith('#'))
  .map((line) => ({ exclude: !line.startsWith('!'), pattern: globToRegExp(path.posix.normalize(line.replace(/^!/, '').replace(/^\//, ''))) }));

/** Docker's rule: the last matching pattern wins; a pattern matching a parent directory matches the path. */
function ignored(relative: string): boolean {
  const parts = relative.split('/');
  const candidates = parts.map((_, index) => parts.slice(0, index + 1).join('/'));
  let result = false;
  for (const rule of ignoreRules) if (candidates.some((candidate) => rule.pattern.test(candidate))) result = rule.exclude;
  return result;
}

function walk(dir: string, relative = ''): string[] {
  return readdirSync(dir).flatMap((name) => {
    const childRelative = relative ? `${relative}/${name}` : name;
    // Skipped without reading: what .dockerignore drops whole (node_modules may be a symlink).
    if (ignored(childRelative)) return [];
    const full = path.join(dir, name);
    return statSync(full).isDirectory() ? walk(full, childRelative) : [childRelative];
  });
}

const context = walk(ROOT);

// ------------------------------------------------------------------------------------------------
// The stages
// ------------------------------------------------------------------------------------------------

interface CopyLine {
  from: string | undefined;
  sources: string[];
  destination: string;
}

function copyLines(instructions: Instruction[]): CopyLine[] {
  return instructions
    .filter((i) => i.keyword === 'COPY')
    .map((i) => {
      const tokens = i.args.split(/\s+/);
      const from = tokens.find((token) => token.startsWith('--from='))?.slice('--from='.length);
      const paths = tokens.filter((token) => !token.startsWith('--'));
      return { from, sources: paths.slice(0, -1), destination: paths.at(-1)! };
    });
}

function workdirOf(instructions: Instruction[]): string {
  return instructions.filter((i) => i.keyword === 'WORKDIR').at(-1)?.args ?? '/';
}

/** Applies COPY lines to a file list: `files` are the source tree (relative paths), returns absolute image paths. */
function applyCopies(lines: CopyLine[], workdir: string, sourceFiles: (from: string | undefined) => string[]): string[] {
  const image: string[] = [];
  for (const line of lines) {
    const files = sourceFiles(line.from);
    const destination = path.posix.resolve(workdir, line.destination);
    for (const source of line.sources) {
      // Context paths are relative to its root; another stage's are absolute (its WORKDIR is /app).
      const relativeSource = line.from !== undefined && source.startsWith('/') ? path.posix.relative(buildWorkdir, source) : source.replace(/^\/+/, '');
      const normalized = path.posix.normalize(relativeSource).replace(/\/$/, '');
      const exact = files.filter((file) => file === normalized);
      const under = files.filter((file) => file.startsWith(`${normalized}/`));
      if (exact.length > 0) {
        const intoDirectory = line.destination.endsWith('/') || line.destination === '.' || line.sources.length > 1;
        image.push(intoDirectory ? path.posix.join(destination, path.posix.basename(normalized)) : destination);
      }
      for (const file of under) image.push(path.posix.join(destination, file.slice(normalized.length + 1)));
    }
  }
  return image;
}

const buildStage = dockerfile.stages.findIndex((stage) => /\sAS\s+build$/i.test(stage));
const buildInstructions = stageInstructions(dockerfile, buildStage);
const buildWorkdir = workdirOf(buildInstructions);
/** The build stage after `npm run build`: its copied sources plus dist/<path>.js for each .ts. */
const buildFiles = (() => {
  const copied = applyCopies(copyLines(buildInstructions), buildWorkdir, () => context).map((file) => path.posix.relative(buildWorkdir, file));
  const compiled = copied.filter((file) => file.endsWith('.ts') && !file.endsWith('.d.ts')).flatMap((file) => [`dist/${file.replace(/\.ts$/, '.js')}`, `dist/${file.replace(/\.ts$/, '.js.map')}`]);
  return [...copied, ...compiled];
})();

const runtimeInstructionsList = stageInstructions(dockerfile, runtimeStage);
const runtimeWorkdir = workdirOf(runtimeInstructionsList);
const runtimeFiles = applyCopies(copyLines(runtimeInstructionsList), runtimeWorkdir, (from) => {
  if (from === undefined) return context;
  assert.equal(from, 'build', `the runtime stage copies only from the context and the build stage (--from=${from})`);
  return buildFiles;
}).map((file) => path.posix.relative(runtimeWorkdir, file));

// ------------------------------------------------------------------------------------------------

test('.dockerignore keeps dependencies, build output, history, benchmark results and secret-looking files out of the context', () => {
  for (const excluded of ['node_modules', 'node_modules/pg/package.json', '.git', '.git/HEAD', 'dist', 'dist/services/cli/main.js', 'bench/results/2026-11-29-full.json']) {
    assert.ok(ignored(excluded), `${excluded} is not sent`);
  }
  for (const secret of ['.env', '.env.production', 'infra/.env', 'id_rsa', 'deploy/id_ed25519.pub', 'tls.key', 'server.pem', 'infra/compose/secrets/database-url', 'db-secret.txt', 'aws-credentials.json', '.npmrc']) {
    assert.ok(ignored(secret), `secret-looking ${secret} is not sent`);
  }
  for (const needed of ['package.json', 'package-lock.json', 'tsconfig.json', 'bin/reaper', 'shared/db/migrations/0001_runs_and_seat_reservations.sql', 'services/cli/main.ts', 'infra/policies.demo.yaml']) {
    assert.ok(!ignored(needed), `${needed} is in the context (the build needs it)`);
  }
  assert.ok(context.length > 20 && context.every((file) => !file.startsWith('node_modules/')), `context of ${context.length} files`);
});

test('the runtime image holds the compiled product and no test code', () => {
  assert.ok(runtimeFiles.includes('dist/services/cli/main.js'), 'the CLI');
  assert.ok(runtimeFiles.includes('dist/services/worker/worker.js'), 'the worker');
  assert.ok(runtimeFiles.includes('bin/reaper'), 'the entry point');
  assert.ok(runtimeFiles.some((file) => file.startsWith('shared/db/migrations/') && file.endsWith('.sql')), 'the migrations');
  const testCode = runtimeFiles.filter((file) => /^(dist\/)?test\//.test(file) || /\.test\.js$/.test(file) || /^(dist\/)?bench\//.test(file));
  assert.deepEqual(testCode, [], 'no test or benchmark code in the runtime image');
  const suspicious = runtimeFiles.filter((file) => /(^|\/)(\.env|.*secret.*|.*\.pem|.*\.key|id_rsa.*)$/i.test(file));
  assert.deepEqual(suspicious, [], 'no secret-looking file');
});

test('the runtime image carries no failpoint module and no stand-in (issue 20)', () => {
  assert.deepEqual(runtimeFiles.filter((file) => file.startsWith('dist/shared/testing/') || file.startsWith('dist/tools/')), []);
  assert.ok(runtimeFiles.includes('dist/shared/observability/failpoint-hook.js'), 'the product side of the failpoints');
});

/**
 * The relative modules a compiled file loads when it is loaded: tsc emits a static import as a
 * top-level `require("...")` at column 0 and erases type-only imports; a lazy `require` inside a
 * function is indented and runs only when called (the failpoint hook, `reaper demo`'s stand-in).
 */
function staticRelativeRequires(compiledText: string): string[] {
  return [...compiledText.matchAll(/^\S.*?\brequire\("(\.{1,2}\/[^"]+)"\)/gm)].map((match) => match[1]!);
}

test('every static relative import of the runtime image resolves inside it (no product file imports test code or the stand-in)', () => {
  const inImage = new Set(runtimeFiles);
  const found = new Map<string, string[]>();
  for (const compiled of runtimeFiles.filter((file) => file.startsWith('dist/') && file.endsWith('.js'))) {
    // The compiled file itself (the test runner builds dist/ before it runs this file).
    for (const required of staticRelativeRequires(readFileSync(path.join(ROOT, compiled), 'utf8'))) {
      // Resolved where Node resolves it: from the compiled file (a require of package.json climbs out of dist/).
      const target = path.posix.normalize(path.posix.join(path.posix.dirname(compiled), required));
      const landed = [`${target}.js`, `${target}/index.js`, target];
      if (landed.some((candidate) => inImage.has(candidate))) continue;
      const source = compiled.slice('dist/'.length).replace(/\.js$/, '.ts');
      found.set(source, [...(found.get(source) ?? []), target]);
    }
  }
  assert.deepEqual(Object.fromEntries(found), Object.fromEntries(KNOWN_TEST_IMPORTS), 'static relative imports that do not resolve inside the runtime image');
});
