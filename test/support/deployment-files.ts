/**
 * What the deployment checks (test/unit/infra.test.ts, test/unit/k8s-manifests.test.ts,
 * test/unit/image-contents.test.ts) share: where the files are, YAML reading, which variables the
 * code reads, the demo policies, and the Dockerfile's instructions.
 */
import assert from 'node:assert/strict';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { parseAllDocuments } from 'yaml';
import { DEMO_POLICIES_PATH, loadEnv } from '../../shared/config/env';
import { parsePolicies, type PolicySet } from '../../shared/config/policies';

// Parsed YAML/JSON is untyped by nature; the assertions establish its shape.
export type Obj = Record<string, any>;

function findRoot(start: string): string {
  for (let dir = start; ; dir = path.dirname(dir)) {
    if (existsSync(path.join(dir, 'package.json')) && existsSync(path.join(dir, 'infra'))) return dir;
    if (path.dirname(dir) === dir) throw new Error(`no package root above ${start}`);
  }
}

export const ROOT = findRoot(__dirname);
export const INFRA = path.join(ROOT, 'infra');
export const K8S = path.join(INFRA, 'k8s');
export const COMPOSE_FILE = path.join(ROOT, 'docker-compose.yml');
export const DEFINITIONS_FILE = path.join(INFRA, 'rabbitmq', 'definitions.json');
export const RABBITMQ_CONF = path.join(INFRA, 'rabbitmq', 'rabbitmq.conf');
export const DOCKERFILE = path.join(INFRA, 'Dockerfile');
export const DEFINITIONS_PREFIX = 'reaper';
export const DEFINITIONS_DELIVERY_LIMIT = 20;

export function rel(file: string): string {
  return path.relative(ROOT, file);
}

/** All documents of a YAML text; merge keys (`<<`) resolved as Docker Compose does. */
export function yamlTextDocuments(text: string, origin: string): Obj[] {
  const documents = parseAllDocuments(text, { merge: true });
  const list = Array.isArray(documents) ? documents : [documents];
  for (const document of list) {
    assert.deepEqual(document.errors.map(String), [], `${origin} parses`);
  }
  return list.map((document) => document.toJS() as Obj).filter((value) => value !== null && value !== undefined);
}

export function yamlDocuments(file: string): Obj[] {
  return yamlTextDocuments(readFileSync(file, 'utf8'), rel(file));
}

export function yamlOne(file: string): Obj {
  const documents = yamlDocuments(file);
  assert.equal(documents.length, 1, `${rel(file)} holds one document`);
  return documents[0]!;
}

/** Runs `read` against an environment that records every name looked up. */
export function namesReadBy(read: (source: NodeJS.ProcessEnv) => unknown, answer: (name: string) => string | undefined): Set<string> {
  const seen = new Set<string>();
  const source = new Proxy({} as NodeJS.ProcessEnv, {
    get(_target, key) {
      if (typeof key !== 'string') return undefined;
      seen.add(key);
      return answer(key);
    },
  });
  read(source);
  return seen;
}

/** Every variable shared/config/env.ts reads, `<NAME>_FILE` variants included. */
export const ENV_NAMES = namesReadBy((source) => loadEnv(source), () => undefined);
/** Variables that may hold a secret: those also read as `<NAME>_FILE`. */
export const SECRET_NAMES = new Set([...ENV_NAMES].filter((name) => name.endsWith('_FILE') && ENV_NAMES.has(name.slice(0, -5))).map((name) => name.slice(0, -5)));
/** Test-only switches that must never be deployed. */
export const TEST_ONLY_NAMES = new Set(['REAPER_TEST_FAILPOINT']);

/** What a policies file reads: variables through `${NAME}`, files through `${file:/path}`. */
export function policyInputs(text: string, origin: string): { variables: Set<string>; files: Set<string> } {
  const files = new Set<string>();
  const variables = namesReadBy(
    (source) =>
      parsePolicies(text, origin, source, (file) => {
        files.add(file);
        return 'placeholder-token';
      }),
    () => 'http://placeholder.invalid',
  );
  return { variables, files };
}

/** Parses a policies file, answering every `${file:...}` with a placeholder. */
export function parsePoliciesWithPlaceholders(text: string, origin: string, source: NodeJS.ProcessEnv): PolicySet {
  return parsePolicies(text, origin, source, () => 'placeholder-token');
}

export const demoPolicies = parsePolicies(readFileSync(DEMO_POLICIES_PATH, 'utf8'), DEMO_POLICIES_PATH, {});
export const DEMO_POLICY_NAMES = [...demoPolicies.keys()];

/** A policy set with the remote base URLs and headers blanked: what may differ between environments. */
export function withoutEnvironmentSpecifics(policies: PolicySet): unknown[] {
  // The media API's address and credentials, and the brake's limits (the demo's seed is a backlog on
  // purpose: it brakes at 0.9, production at 0.5), differ by environment; nothing else may.
  return [...policies.values()].map((policy) => {
    const { limits: _limits, ...rule } = policy;
    return rule.kind === 'remote-delete' ? { ...rule, remote: { ...rule.remote, baseUrl: '(per environment)', headers: '(per environment)' } } : rule;
  });
}

export function remoteBaseUrls(policies: PolicySet): string[] {
  return [...policies.values()].flatMap((policy) => (policy.kind === 'remote-delete' && policy.remote.kind !== 's3' ? [policy.remote.baseUrl] : []));
}

/** Dummy secret contents that pass loadEnv's validation. */
export function dummySecret(name: string): string {
  if (name === 'DATABASE_URL') return 'postgres://reaper:secret@db.invalid:5432/reaper';
  if (name === 'AMQP_URL') return 'amqp://reaper:secret@mq.invalid:5672';
  return 's'.repeat(32);
}

let secretCounter = 0;
export function writeSecret(dir: string, content: string): string {
  const file = path.join(dir, `secret-${++secretCounter}`);
  writeFileSync(file, content, { mode: 0o600 });
  return file;
}

// ------------------------------------------------------------------------------------------------
// Dockerfile
// ------------------------------------------------------------------------------------------------

export interface Instruction {
  stage: number;
  keyword: string;
  args: string;
}

export interface Dockerfile {
  instructions: Instruction[];
  /** FROM arguments, one per stage, e.g. "node:24-slim AS build". */
  stages: string[];
}

export function parseDockerfile(text: string): Dockerfile {
  const instructions: Instruction[] = [];
  const stages: string[] = [];
  let pending = '';
  for (const raw of text.split('\n')) {
    const line = raw.trim();
    if (line.startsWith('#') || (line === '' && pending === '')) continue;
    if (line.endsWith('\\')) {
      pending += `${line.slice(0, -1)} `;
      continue;
    }
    const full = (pending + line).trim();
    pending = '';
    if (full === '') continue;
    const [keyword, ...rest] = full.split(/\s+/);
    const args = rest.join(' ');
    if (keyword!.toUpperCase() === 'FROM') stages.push(args);
    instructions.push({ stage: stages.length - 1, keyword: keyword!.toUpperCase(), args });
  }
  return { instructions, stages };
}

export const dockerfile = parseDockerfile(readFileSync(DOCKERFILE, 'utf8'));

/** Index of the stage named `name` (FROM ... AS name), or of the last stage. */
export function stageIndex(file: Dockerfile, name?: string): number {
  if (name === undefined) return file.stages.length - 1;
  const index = file.stages.findIndex((stage) => new RegExp(`\\sAS\\s+${name}$`, 'i').test(stage));
  assert.ok(index >= 0, `the Dockerfile has a stage named ${name}`);
  return index;
}

export function stageInstructions(file: Dockerfile, stage: number): Instruction[] {
  return file.instructions.filter((instruction) => instruction.stage === stage);
}

/** The runtime image: the stage named `runtime`, else the last one. */
export const runtimeStage = dockerfile.stages.findIndex((stage) => /\sAS\s+runtime$/i.test(stage)) >= 0 ? stageIndex(dockerfile, 'runtime') : stageIndex(dockerfile);
export const runtimeInstructions = stageInstructions(dockerfile, runtimeStage);
export const imageUser = runtimeInstructions.filter((i) => i.keyword === 'USER').at(-1)?.args ?? 'root';
export const imageUid = Number(imageUser.split(':')[0]);
