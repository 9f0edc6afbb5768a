import assert from 'node:assert/strict';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';

/**
 * Issue 42 item 1: every relative link in the README and in docs/ resolves — the file exists and,
 * where the link names a section (`file.md#section`), that file has a heading with that anchor
 * (GitHub's rule: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats).
 */
const root = path.resolve(__dirname, '..', '..', '..');
const pages = ['README.md', ...readdirSync(path.join(root, 'docs')).filter((name) => name.endsWith('.md')).map((name) => `docs/${name}`)];

export function anchorsOf(markdown: string): Set<string> {
  const anchors = new Set<string>();
  const seen = new Map<string, number>();
  let fenced = false;
  for (const line of markdown.split('\n')) {
    if (/^\s*```/.test(line)) fenced = !fenced;
    const heading = !fenced && /^#{1,6}\s+(.*?)\s*#*\s*$/.exec(line);
    if (!heading) continue;
    const slug = heading[1]!
      .toLowerCase()
      .replace(/`/g, '')
      .replace(/[^\p{L}\p{N}\s_-]/gu, '')
      .replace(/\s/g, '-');
    const repeats = seen.get(slug) ?? 0;
    seen.set(slug, repeats + 1);
    anchors.add(repeats === 0 ? slug : `${slug}-${repeats}`);
  }
  return anchors;
}

/** Relative links of a page outside code: [text](target) with no scheme. */
export function relativeLinks(markdown: string): string[] {
  const prose = markdown.replace(/```[\s\S]*?```/g, '').replace(/`[^`\n]*`/g, '');
  return [...prose.matchAll(/\]\(([^)\s]+)(?:\s+"[^"]*")?\)/g)].map((match) => match[1]!).filter((target) => !/^[a-z][a-z0-9+.-]*:/i.test(target));
}

test('the anchor rule: punctuation dropped, spaces to hyphens, repeats numbered', () => {
  assert.deepEqual([...anchorsOf('# How a message could be lost or doubled, and why it is not\n## `reaper doctor`\n## A\n## A\n```\n# not a heading\n```')], [
    'how-a-message-could-be-lost-or-doubled-and-why-it-is-not',
    'reaper-doctor',
    'a',
    'a-1',
  ]);
  assert.deepEqual(relativeLinks('[a](docs/x.md#y) [b](https://e.org) `[c](no.md)` [d](#local)'), ['docs/x.md#y', '#local']);
});

for (const page of pages) {
  test(`every relative link in ${page} resolves`, () => {
    const text = readFileSync(path.join(root, page), 'utf8');
    const broken: string[] = [];
    for (const link of relativeLinks(text)) {
      const [file, anchor] = link.split('#') as [string, string | undefined];
      const target = file === '' ? path.join(root, page) : path.resolve(path.dirname(path.join(root, page)), decodeURIComponent(file));
      if (!existsSync(target)) {
        broken.push(`${link}: no such file`);
        continue;
      }
      if (anchor !== undefined && target.endsWith('.md') && !anchorsOf(readFileSync(target, 'utf8')).has(anchor)) broken.push(`${link}: no heading with that anchor`);
    }
    assert.deepEqual(broken, [], `${page}: broken links`);
  });
}
