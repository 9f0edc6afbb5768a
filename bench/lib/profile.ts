import { readFileSync } from 'node:fs';

/**
 * Reads a V8 .cpuprofile (node --cpu-prof) and says where the busy time went: by library or
 * product file (self time), by function (self time), and by product function including what it
 * calls. Idle time is left out of every percentage: the question is what the CPU did while busy.
 */

interface CallFrame {
  functionName: string;
  url: string;
  lineNumber: number;
}

interface ProfileNode {
  id: number;
  callFrame: CallFrame;
  children?: number[];
}

interface CpuProfile {
  nodes: ProfileNode[];
  samples: number[];
  timeDeltas: number[];
}

export interface ProfileEntry {
  name: string;
  ms: number;
  /** Share of busy (non-idle) time. */
  share: number;
}

export interface ProfileSummary {
  file: string;
  totalMs: number;
  busyMs: number;
  byCategory: ProfileEntry[];
  topSelf: ProfileEntry[];
  topProductInclusive: ProfileEntry[];
}

/** dist/services/worker/worker.js -> services/worker/worker.ts */
function productFile(url: string): string | null {
  const match = /\/dist\/((?:services|shared|bench)\/.+)\.js$/.exec(url);
  return match ? `${match[1]}.ts` : null;
}

function category(frame: CallFrame): string {
  if (frame.url === '') {
    if (frame.functionName === '(idle)' || frame.functionName === '(program)' || frame.functionName === '(garbage collector)') return frame.functionName;
    return `native: ${frame.functionName || '(anonymous)'}`; // builtins such as JSON.parse have no script
  }
  const product = productFile(frame.url);
  if (product) return `reaper: ${product}`;
  const modules = /\/node_modules\/((?:@[^/]+\/)?[^/]+)\//.exec(frame.url);
  if (modules) return `lib: ${modules[1]}`;
  if (frame.url.startsWith('node:')) {
    // node:internal/streams/writable -> node: streams
    const parts = frame.url.slice('node:'.length).split('/');
    return `node: ${parts[0] === 'internal' ? (parts[1] ?? 'internal') : parts[0]}`;
  }
  return frame.url;
}

function label(frame: CallFrame): string {
  const where = productFile(frame.url) ?? frame.url.replace(/^.*\/node_modules\//, '');
  // A nameless frame at the top of a file is the module being loaded (start-up, not work).
  const name = frame.functionName || (frame.lineNumber === 0 && frame.url !== '' ? '(module load)' : '(anonymous)');
  return `${name} ${where ? `${where}:${frame.lineNumber + 1}` : ''}`.trim();
}

function top(map: Map<string, number>, busyMs: number, count: number): ProfileEntry[] {
  return [...map.entries()]
    .sort((a, b) => b[1] - a[1])
    .slice(0, count)
    .map(([name, ms]) => ({ name, ms, share: busyMs > 0 ? ms / busyMs : 0 }));
}

export function summariseProfile(file: string, topCount = 15): ProfileSummary {
  const profile = JSON.parse(readFileSync(file, 'utf8')) as CpuProfile;
  const byId = new Map(profile.nodes.map((node) => [node.id, node]));
  const selfUs = new Map<number, number>();
  profile.samples.forEach((id, index) => selfUs.set(id, (selfUs.get(id) ?? 0) + (profile.timeDeltas[index] ?? 0)));

  let totalUs = 0;
  let idleUs = 0;
  const categories = new Map<string, number>();
  const functions = new Map<string, number>();
  for (const [id, us] of selfUs) {
    const frame = byId.get(id)!.callFrame;
    totalUs += us;
    if (frame.functionName === '(idle)') {
      idleUs += us;
      continue;
    }
    const name = category(frame);
    categories.set(name, (categories.get(name) ?? 0) + us / 1000);
    functions.set(label(frame), (functions.get(label(frame)) ?? 0) + us / 1000);
  }

  // Inclusive time of product functions: each node's subtree, counted once per call path even
  // when the function recurses (a node whose ancestor is the same function adds nothing).
  const inclusive = new Map<string, number>();
  const subtreeCache = new Map<number, number>();
  const subtreeUs = (node: ProfileNode): number => {
    let us = subtreeCache.get(node.id);
    if (us === undefined) {
      us = (selfUs.get(node.id) ?? 0) + (node.children ?? []).reduce((sum, child) => sum + subtreeUs(byId.get(child)!), 0);
      subtreeCache.set(node.id, us);
    }
    return us;
  };
  const walk = (node: ProfileNode, active: ReadonlySet<string>): void => {
    let next = active;
    if (productFile(node.callFrame.url)) {
      const name = label(node.callFrame);
      if (!active.has(name)) {
        inclusive.set(name, (inclusive.get(name) ?? 0) + subtreeUs(node) / 1000);
        next = new Set(active).add(name);
      }
    }
    for (const child of node.children ?? []) walk(byId.get(child)!, next);
  };
  walk(profile.nodes[0]!, new Set());

  const busyMs = (totalUs - idleUs) / 1000;
  return {
    file,
    totalMs: totalUs / 1000,
    busyMs,
    byCategory: top(categories, busyMs, topCount),
    topSelf: top(functions, busyMs, topCount),
    topProductInclusive: top(inclusive, busyMs, topCount),
  };
}
