/**
 * Offline checks of the deployment files (infra/, docker-compose.yml) against the code they deploy.
 * Nothing here can build an image or talk to a cluster, so every fact a deployment relies on is
 * compared with its source of truth instead:
 *
 *  - every YAML file parses; kustomizations only reference files that exist inside their own root;
 *  - the environment each container gets uses only names shared/config/env.ts reads (recorded by
 *    running loadEnv on a recording environment), secrets only through `_FILE` mounts, and loadEnv
 *    accepts it; the policies file each container mounts parses with that environment;
 *  - the RabbitMQ definitions equal makeTopology() for the deployed prefix and delivery limit;
 *  - the Dockerfile puts the migrations and the demo policies where the code looks for them.
 */
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { parseAllDocuments } from 'yaml';
import { makeTopology, type Topology } from '../../shared/amqp/topology';
import { DEMO_POLICIES_PATH, loadEnv, type Env } from '../../shared/config/env';
import { parsePolicies, type PolicySet } from '../../shared/config/policies';
import { migrationsDirectory } from '../../shared/db/migrate';

// Parsed YAML/JSON is untyped by nature; the assertions below establish its shape.
type Obj = Record<string, any>;

const ROOT = findRoot(__dirname);
const INFRA = path.join(ROOT, 'infra');
const K8S = path.join(INFRA, 'k8s');
const COMPOSE_FILE = path.join(ROOT, 'docker-compose.yml');
const DEFINITIONS_FILE = path.join(INFRA, 'rabbitmq', 'definitions.json');
const RABBITMQ_CONF = path.join(INFRA, 'rabbitmq', 'rabbitmq.conf');
const DOCKERFILE = path.join(INFRA, 'Dockerfile');
const OVERLAYS = ['dev', 'prod'];

const tmp = mkdtempSync(path.join(tmpdir(), 'reaper-infra-test-'));
after(() => rmSync(tmp, { recursive: true, force: true }));

function findRoot(start: string): string {
  for (let dir = start; ; dir = path.dirname(dir)) {
    if (existsSync(path.join(dir, 'package.json')) && existsSync(path.join(dir, 'infra'))) return dir;
    if (path.dirname(dir) === dir) throw new Error(`no package root above ${start}`);
  }
}

function rel(file: string): string {
  return path.relative(ROOT, file);
}

function isInside(dir: string, file: string): boolean {
  const relative = path.relative(dir, file);
  return relative !== '' && !relative.startsWith('..') && !path.isAbsolute(relative);
}

/** All documents of a YAML file; merge keys (`<<`) resolved as Docker Compose does. */
function yamlDocuments(file: string): Obj[] {
  const documents = parseAllDocuments(readFileSync(file, 'utf8'), { merge: true });
  const list = Array.isArray(documents) ? documents : [documents];
  for (const document of list) {
    assert.deepEqual(document.errors.map(String), [], `${rel(file)} parses`);
  }
  return list.map((document) => document.toJS() as Obj).filter((value) => value !== null && value !== undefined);
}

function yamlOne(file: string): Obj {
  const documents = yamlDocuments(file);
  assert.equal(documents.length, 1, `${rel(file)} holds one document`);
  return documents[0]!;
}

function walk(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const full = path.join(dir, name);
    return statSync(full).isDirectory() ? walk(full) : [full];
  });
}

// ------------------------------------------------------------------------------------------------
// What the code reads
// ------------------------------------------------------------------------------------------------

/** Runs `read` against an environment that records every name looked up. */
function namesReadBy(read: (source: NodeJS.ProcessEnv) => unknown, answer: (name: string) => string | undefined): Set<string> {
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
const ENV_NAMES = namesReadBy((source) => loadEnv(source), () => undefined);
/** Variables that may hold a secret: those also read as `<NAME>_FILE`. */
const SECRET_NAMES = new Set([...ENV_NAMES].filter((name) => name.endsWith('_FILE') && ENV_NAMES.has(name.slice(0, -5))).map((name) => name.slice(0, -5)));
/** Test-only switches that must never be deployed. */
const TEST_ONLY_NAMES = new Set(['REAPER_FAILPOINT']);

/** Variables a policies file reads through `${NAME}`. */
function policyVariables(text: string, origin: string): Set<string> {
  return namesReadBy((source) => parsePolicies(text, origin, source), () => 'http://placeholder.invalid');
}

const demoText = readFileSync(DEMO_POLICIES_PATH, 'utf8');
const demoPolicies = parsePolicies(demoText, DEMO_POLICIES_PATH, {});
const DEMO_POLICY_NAMES = [...demoPolicies.keys()];

/** A policy set with the remote base URLs blanked: what may differ between environments. */
function withoutBaseUrls(policies: PolicySet): unknown[] {
  return [...policies.values()].map((policy) => (policy.kind === 'remote-delete' ? { ...policy, remote: { ...policy.remote, baseUrl: '(per environment)' } } : policy));
}

function remoteBaseUrls(policies: PolicySet): string[] {
  return [...policies.values()].flatMap((policy) => (policy.kind === 'remote-delete' ? [policy.remote.baseUrl] : []));
}

/** Dummy secret contents that pass loadEnv's validation. */
function dummySecret(name: string): string {
  if (name === 'DATABASE_URL') return 'postgres://reaper:secret@db.invalid:5432/reaper';
  if (name === 'AMQP_URL') return 'amqp://reaper:secret@mq.invalid:5672';
  return 's'.repeat(32);
}

let secretCounter = 0;
function writeSecret(content: string): string {
  const file = path.join(tmp, `secret-${++secretCounter}`);
  writeFileSync(file, content, { mode: 0o600 });
  return file;
}

test('shared/config/env.ts reads the variables docs/design.md promises', () => {
  for (const name of ['DATABASE_URL', 'AMQP_URL', 'REAPER_AMQP_PREFIX', 'REAPER_POLICIES', 'REAPER_WORKER_ID', 'LOG_LEVEL', 'HTTP_PORT']) {
    assert.ok(ENV_NAMES.has(name), `${name} is read; read: ${[...ENV_NAMES].join(', ')}`);
  }
  for (const name of ['DATABASE_URL', 'AMQP_URL', 'REAPER_WEBHOOK_SECRET']) assert.ok(SECRET_NAMES.has(name), `${name}_FILE is read`);
});

// ------------------------------------------------------------------------------------------------
// Every file parses
// ------------------------------------------------------------------------------------------------

test('every YAML file under infra/ and docker-compose.yml parses; JSON files parse', () => {
  const files = walk(INFRA);
  const yamlFiles = [...files.filter((file) => /\.ya?ml$/.test(file)), COMPOSE_FILE];
  assert.ok(yamlFiles.length >= 10, `found ${yamlFiles.length} YAML files`);
  for (const file of yamlFiles) assert.ok(yamlDocuments(file).length >= 1, `${rel(file)} is not empty`);
  for (const file of files.filter((file) => file.endsWith('.json'))) {
    assert.doesNotThrow(() => JSON.parse(readFileSync(file, 'utf8')), `${rel(file)} is JSON`);
  }
});

// ------------------------------------------------------------------------------------------------
// Kustomize: a small model (resources, generators, patches) of what `kubectl kustomize` reads
// ------------------------------------------------------------------------------------------------

interface Generator {
  name: string;
  behavior: 'create' | 'merge' | 'replace';
  literals: Map<string, string>;
  files: Map<string, string>; // key -> absolute path
}

interface Kustomization {
  dir: string;
  doc: Obj;
  manifests: Obj[]; // this directory's own resources
  bases: Kustomization[];
  generators: Generator[];
  patches: { target: Obj; body: Obj | Obj[] }[];
}

function loadKustomization(dir: string): Kustomization {
  const file = path.join(dir, 'kustomization.yaml');
  assert.ok(existsSync(file), `${rel(dir)} has a kustomization.yaml`);
  const doc = yamlOne(file);
  assert.equal(doc.apiVersion, 'kustomize.config.k8s.io/v1beta1', `${rel(file)} apiVersion`);
  assert.equal(doc.kind, 'Kustomization', `${rel(file)} kind`);
  assert.equal(doc.commonLabels, undefined, `${rel(file)}: commonLabels is deprecated and rewrites selectors; use labels`);
  const manifests: Obj[] = [];
  const bases: Kustomization[] = [];
  for (const resource of (doc.resources ?? []) as string[]) {
    const target = path.resolve(dir, resource);
    assert.ok(existsSync(target), `${rel(file)}: resource ${resource} exists`);
    if (statSync(target).isDirectory()) {
      bases.push(loadKustomization(target));
    } else {
      // kustomize's load restrictor: files must be inside the kustomization's own directory.
      assert.ok(isInside(dir, target), `${rel(file)}: resource file ${resource} is inside ${rel(dir)}`);
      manifests.push(...yamlDocuments(target));
    }
  }
  const generators: Generator[] = ((doc.configMapGenerator ?? []) as Obj[]).map((entry) => {
    const literals = new Map<string, string>();
    for (const literal of (entry.literals ?? []) as string[]) {
      const at = literal.indexOf('=');
      assert.ok(at > 0, `${rel(file)}: literal ${literal} is KEY=VALUE`);
      literals.set(literal.slice(0, at), literal.slice(at + 1));
    }
    const files = new Map<string, string>();
    for (const spec of (entry.files ?? []) as string[]) {
      const [key, source] = spec.includes('=') ? (spec.split('=', 2) as [string, string]) : [path.basename(spec), spec];
      const full = path.resolve(dir, source);
      assert.ok(isInside(dir, full) && existsSync(full), `${rel(file)}: generator file ${source} exists inside ${rel(dir)}`);
      files.set(key, full);
    }
    return { name: entry.name as string, behavior: (entry.behavior ?? 'create') as Generator['behavior'], literals, files };
  });
  assert.equal(doc.secretGenerator, undefined, `${rel(file)}: no secret is generated from the repository`);
  const patches = ((doc.patches ?? []) as Obj[]).map((entry) => {
    let body: Obj | Obj[];
    if (entry.path !== undefined) {
      const full = path.resolve(dir, entry.path as string);
      assert.ok(isInside(dir, full) && existsSync(full), `${rel(file)}: patch ${entry.path} exists inside ${rel(dir)}`);
      body = yamlOne(full);
    } else {
      const documents = parseAllDocuments(entry.patch as string);
      const list = Array.isArray(documents) ? documents : [documents];
      assert.equal(list.length, 1, `${rel(file)}: an inline patch is one document`);
      assert.deepEqual(list[0]!.errors.map(String), [], `${rel(file)}: inline patch parses`);
      body = list[0]!.toJS() as Obj | Obj[];
    }
    const target = (entry.target ?? (Array.isArray(body) ? undefined : { kind: body.kind, name: body.metadata?.name })) as Obj | undefined;
    assert.ok(target, `${rel(file)}: a JSON patch names its target`);
    return { target, body };
  });
  return { dir, doc, manifests, bases, generators, patches };
}

/** Resources after all bases, with generator contents merged as kustomize would. */
interface Rendered {
  manifests: Obj[];
  configMaps: Map<string, { literals: Map<string, string>; files: Map<string, string> }>;
  images: Obj[];
}

function render(kustomization: Kustomization): Rendered {
  const manifests: Obj[] = [];
  const configMaps = new Map<string, { literals: Map<string, string>; files: Map<string, string> }>();
  const images: Obj[] = [];
  for (const base of kustomization.bases) {
    const inner = render(base);
    manifests.push(...inner.manifests);
    for (const [name, value] of inner.configMaps) configMaps.set(name, value);
    images.push(...inner.images);
  }
  // Copies: patches and replicas below change them, and the base is rendered on its own too.
  manifests.push(...kustomization.manifests.map((manifest) => structuredClone(manifest)));
  images.push(...((kustomization.doc.images ?? []) as Obj[]));
  const where = rel(path.join(kustomization.dir, 'kustomization.yaml'));
  for (const generator of kustomization.generators) {
    const existing = configMaps.get(generator.name);
    if (generator.behavior === 'create') {
      assert.equal(existing, undefined, `${where}: configMapGenerator ${generator.name} is created once (merge/replace in overlays)`);
      configMaps.set(generator.name, { literals: new Map(generator.literals), files: new Map(generator.files) });
    } else {
      assert.ok(existing, `${where}: configMapGenerator ${generator.name} (${generator.behavior}) has a base to ${generator.behavior}`);
      configMaps.set(
        generator.name,
        generator.behavior === 'replace'
          ? { literals: new Map(generator.literals), files: new Map(generator.files) }
          : { literals: new Map([...existing.literals, ...generator.literals]), files: new Map([...existing.files, ...generator.files]) },
      );
    }
  }
  for (const patch of kustomization.patches) {
    const targets = manifests.filter(
      (manifest) => (!patch.target.kind || manifest.kind === patch.target.kind) && (!patch.target.name || manifest.metadata?.name === patch.target.name),
    );
    assert.ok(targets.length > 0, `${where}: patch target ${JSON.stringify(patch.target)} exists`);
    for (const target of targets) {
      if (Array.isArray(patch.body)) {
        for (const operation of patch.body) {
          assert.ok(['add', 'remove', 'replace', 'test', 'move', 'copy'].includes(operation.op), `${where}: JSON patch op ${operation.op}`);
          if (operation.op !== 'add') assert.ok(pointer(target, operation.path) !== undefined, `${where}: ${operation.path} exists in ${target.kind}/${target.metadata.name}`);
          if (operation.op === 'remove') removePointer(target, operation.path);
        }
      } else {
        // Strategic merge patches of containers must name containers that exist.
        for (const container of (patch.body.spec?.template?.spec?.containers ?? []) as Obj[]) {
          const names = containersOf(target).map((c) => c.name);
          assert.ok(names.includes(container.name), `${where}: patched container ${container.name} exists in ${target.metadata.name} (${names.join(', ')})`);
          const original = containersOf(target).find((c) => c.name === container.name)!;
          if (container.resources) {
            original.resources = {
              requests: { ...original.resources?.requests, ...container.resources.requests },
              limits: { ...original.resources?.limits, ...container.resources.limits },
            };
          }
        }
      }
    }
  }
  for (const entry of (kustomization.doc.replicas ?? []) as Obj[]) {
    const target = manifests.find((manifest) => manifest.kind === 'Deployment' && manifest.metadata.name === entry.name);
    assert.ok(target, `${where}: replicas for ${entry.name} names a Deployment`);
    assert.ok(Number.isInteger(entry.count) && entry.count >= 1, `${where}: replicas count for ${entry.name}`);
    target.spec.replicas = entry.count;
  }
  return { manifests, configMaps, images };
}

function pointer(value: Obj, jsonPointer: string): unknown {
  return jsonPointer
    .split('/')
    .slice(1)
    .reduce<unknown>((current, token) => (current === undefined || current === null ? undefined : (current as Obj)[token.replace(/~1/g, '/').replace(/~0/g, '~')]), value);
}

function removePointer(value: Obj, jsonPointer: string): void {
  const tokens = jsonPointer.split('/').slice(1);
  const parent = pointer(value, `/${tokens.slice(0, -1).join('/')}`.replace(/\/$/, '')) as Obj;
  delete (tokens.length === 1 ? value : parent)[tokens[tokens.length - 1]!];
}

function containersOf(workload: Obj): Obj[] {
  return (workload.spec?.template?.spec?.containers ?? []) as Obj[];
}

function find(manifests: Obj[], kind: string, name: string): Obj {
  const found = manifests.find((manifest) => manifest.kind === kind && manifest.metadata?.name === name);
  assert.ok(found, `${kind}/${name} exists; have ${manifests.map((m) => `${m.kind}/${m.metadata?.name}`).join(', ')}`);
  return found;
}

function matches(selector: Obj, labels: Obj): boolean {
  return Object.entries(selector).every(([key, value]) => labels?.[key] === value);
}

function bytes(quantity: string): number {
  const match = /^(\d+(?:\.\d+)?)(Ki|Mi|Gi|k|M|G)?$/.exec(String(quantity));
  assert.ok(match, `memory quantity ${quantity}`);
  const unit = { Ki: 1024, Mi: 1024 ** 2, Gi: 1024 ** 3, k: 1e3, M: 1e6, G: 1e9 }[match[2] ?? ''] ?? 1;
  return Number(match[1]) * unit;
}

function millicores(quantity: string | number): number {
  const text = String(quantity);
  return text.endsWith('m') ? Number(text.slice(0, -1)) : Number(text) * 1000;
}

const base = loadKustomization(path.join(K8S, 'base'));
const renderedBase = render(base);
const overlays = new Map(OVERLAYS.map((name) => [name, loadKustomization(path.join(K8S, 'overlays', name))]));
const renderedOverlays = new Map([...overlays].map(([name, kustomization]) => [name, render(kustomization)]));
const allRendered: [string, Rendered][] = [['base', renderedBase], ...renderedOverlays];

const SCHEDULER = 'reaper-scheduler';
const WORKER = 'reaper-worker';
const MIGRATE = 'reaper-migrate';

// ------------------------------------------------------------------------------------------------
// Dockerfile
// ------------------------------------------------------------------------------------------------

interface Instruction {
  stage: number;
  keyword: string;
  args: string;
}

function parseDockerfile(text: string): { instructions: Instruction[]; stages: string[] } {
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

const dockerfile = parseDockerfile(readFileSync(DOCKERFILE, 'utf8'));
const finalStage = dockerfile.stages.length - 1;
const finalInstructions = dockerfile.instructions.filter((instruction) => instruction.stage === finalStage);
const imageUser = finalInstructions.filter((i) => i.keyword === 'USER').at(-1)?.args ?? 'root';
const imageUid = Number(imageUser.split(':')[0]);
const imageWorkdir = finalInstructions.filter((i) => i.keyword === 'WORKDIR').at(-1)?.args ?? '/';

interface Copy {
  from: string | undefined;
  /** Source (relative to the build context, or to the other stage) and where it lands in the image. */
  entries: { source: string; target: string; directory: boolean }[];
}

/** COPY instructions of the final stage, with Docker's rules for where each source lands. */
function finalCopies(): Copy[] {
  return finalInstructions
    .filter((i) => i.keyword === 'COPY')
    .map((i) => {
      const tokens = i.args.split(/\s+/);
      const from = tokens.find((token) => token.startsWith('--from='))?.slice('--from='.length);
      const paths = tokens.filter((token) => !token.startsWith('--'));
      const destination = paths.at(-1)!;
      const sources = paths.slice(0, -1);
      const base = path.posix.resolve(imageWorkdir, destination);
      const intoDirectory = destination.endsWith('/') || destination === '.' || sources.length > 1;
      const entries = sources.map((source) => {
        // A directory's contents land at the destination; a file lands in it, or as it.
        const directory = from === undefined ? existsSync(path.join(ROOT, source)) && statSync(path.join(ROOT, source)).isDirectory() : true;
        return { source, directory, target: directory || !intoDirectory ? base : path.posix.join(base, path.posix.basename(source)) };
      });
      return { from, entries };
    });
}

/** The build-context path an image path (relative to WORKDIR) is copied from, if any. */
function imageSource(relative: string): string | undefined {
  const wanted = path.posix.join(imageWorkdir, relative.split(path.sep).join('/'));
  for (const copy of finalCopies().filter((c) => c.from === undefined)) {
    for (const entry of copy.entries) {
      if (wanted === entry.target) return entry.source;
      if (entry.directory && wanted.startsWith(`${entry.target}/`)) return path.posix.join(entry.source, wanted.slice(entry.target.length + 1));
    }
  }
  return undefined;
}

test('Dockerfile: multi-stage node:24-slim, npm ci + build, production deps without scripts', () => {
  assert.ok(dockerfile.stages.length >= 2, 'at least a build and a runtime stage');
  for (const stage of dockerfile.stages) assert.match(stage, /^node:24-slim(@sha256:[0-9a-f]{64})?( AS \w+)?$/i, `stage FROM ${stage}`);
  const build = dockerfile.instructions.filter((i) => i.stage < finalStage && i.keyword === 'RUN').map((i) => i.args);
  assert.ok(build.some((run) => /\bnpm ci\b/.test(run)), 'the build stage runs npm ci');
  assert.ok(build.some((run) => /\bnpm run build\b/.test(run)), 'the build stage runs npm run build');
  const runtime = finalInstructions.filter((i) => i.keyword === 'RUN').map((i) => i.args);
  const install = runtime.find((run) => /\bnpm ci\b/.test(run));
  assert.ok(install, 'the runtime stage installs dependencies with npm ci');
  assert.match(install, /--omit=dev/, 'production dependencies only');
  assert.match(install, /--ignore-scripts/, '`prepare` runs tsc, which is not installed in the runtime stage');
  assert.ok(!runtime.some((run) => /npm run build|\btsc\b/.test(run)), 'the runtime stage does not compile');
});

test('Dockerfile: non-root user, entrypoint bin/reaper, default command worker', () => {
  assert.match(imageUser, /^\d+(:\d+)?$/, 'USER is numeric, so runAsNonRoot can verify it');
  assert.ok(imageUid > 0, 'USER is not root');
  const packageJson = JSON.parse(readFileSync(path.join(ROOT, 'package.json'), 'utf8')) as Obj;
  const entrypoint = JSON.parse(finalInstructions.filter((i) => i.keyword === 'ENTRYPOINT').at(-1)!.args) as string[];
  assert.deepEqual(entrypoint, ['node', packageJson.bin.reaper]);
  assert.deepEqual(entrypoint, ['node', 'bin/reaper']);
  assert.deepEqual(JSON.parse(finalInstructions.filter((i) => i.keyword === 'CMD').at(-1)!.args), ['worker']);
});

test('Dockerfile: the runtime image has dist/, bin/, the migrations and the demo policies where the code reads them', () => {
  const fromBuild = finalCopies().filter((copy) => copy.from !== undefined);
  assert.ok(
    fromBuild.some((copy) => copy.entries.some((entry) => entry.target === path.posix.join(imageWorkdir, 'dist'))),
    'dist/ comes from the build stage',
  );
  assert.equal(imageSource('bin/reaper'), 'bin/reaper', 'bin/reaper is copied');
  // The directories the code resolves at run time, relative to the package root.
  const migrations = rel(migrationsDirectory()).split(path.sep).join('/');
  assert.ok(readdirSync(migrationsDirectory()).some((file) => file.endsWith('.sql')), 'there are .sql migrations to copy');
  for (const file of readdirSync(migrationsDirectory()).filter((name) => name.endsWith('.sql'))) {
    assert.equal(imageSource(`${migrations}/${file}`), `${migrations}/${file}`, `${migrations}/${file} (migrationsDirectory()) is in the image at the same path`);
  }
  const demo = rel(DEMO_POLICIES_PATH).split(path.sep).join('/');
  assert.equal(imageSource(demo), demo, `${demo} (the REAPER_POLICIES default) is in the image at the same path`);
  // The stand-in media API (docker-compose.yml) and `reaper demo` need dist/test/support.
  const tsconfig = JSON.parse(readFileSync(path.join(ROOT, 'tsconfig.json'), 'utf8')) as Obj;
  assert.ok((tsconfig.include as string[]).includes('test'), 'tsconfig compiles test/');
  const buildCopies = dockerfile.instructions.filter((i) => i.stage < finalStage && i.keyword === 'COPY').map((i) => i.args);
  for (const directory of ['shared', 'services', 'test']) {
    assert.ok(buildCopies.some((args) => args.split(/\s+/)[0] === directory), `the build stage copies ${directory}/`);
  }
});

// ------------------------------------------------------------------------------------------------
// Kubernetes
// ------------------------------------------------------------------------------------------------

/** Checks a container's environment and returns what loadEnv makes of it, plus its policies. */
function checkK8sContainer(where: string, podSpec: Obj, container: Obj, rendered: Rendered): { env: Env; policies: PolicySet | undefined; raw: Map<string, string> } {
  const raw = new Map<string, string>();
  const resolved: NodeJS.ProcessEnv = {};
  for (const from of (container.envFrom ?? []) as Obj[]) {
    assert.ok(from.configMapRef, `${where}: envFrom only from ConfigMaps (secrets are files)`);
    const configMap = rendered.configMaps.get(from.configMapRef.name);
    assert.ok(configMap, `${where}: envFrom ConfigMap ${from.configMapRef.name} is generated`);
    for (const [name, value] of configMap.literals) {
      raw.set(name, value);
      resolved[name] = value;
    }
  }
  for (const entry of (container.env ?? []) as Obj[]) {
    if (entry.valueFrom) {
      assert.ok(!entry.valueFrom.secretKeyRef, `${where}: ${entry.name} does not read a secret into the environment (use ${entry.name}_FILE)`);
      assert.ok(entry.valueFrom.fieldRef, `${where}: ${entry.name} comes from the downward API`);
      raw.set(entry.name, `fieldRef:${entry.valueFrom.fieldRef.fieldPath}`);
      resolved[entry.name] = 'reaper-pod-7d9f8b6c4-x2x9z';
    } else {
      raw.set(entry.name, String(entry.value));
      resolved[entry.name] = String(entry.value);
    }
  }
  const mounts = (container.volumeMounts ?? []) as Obj[];
  const volumes = (podSpec.volumes ?? []) as Obj[];
  /** The volume and the key a file path inside the container comes from. */
  const sourceOf = (file: string) => {
    const mount = mounts.find((m) => file.startsWith(`${m.mountPath}/`));
    assert.ok(mount, `${where}: ${file} is under a volume mount`);
    const volume = volumes.find((v) => v.name === mount.name);
    assert.ok(volume, `${where}: volume ${mount.name} exists`);
    const inside = file.slice(mount.mountPath.length + 1);
    const source = volume.secret ?? volume.configMap;
    const items = (source?.items ?? []) as Obj[];
    const item = items.find((i) => i.path === inside);
    // With `items`, only the listed keys become files.
    assert.ok(items.length === 0 || item, `${where}: ${file} is one of the items of volume ${volume.name}`);
    return { volume, key: (item?.key as string | undefined) ?? inside };
  };

  for (const name of raw.keys()) {
    assert.ok(ENV_NAMES.has(name) || policyVariablesOfContainer().has(name), `${where}: ${name} is read by shared/config/env.ts or by the mounted policies file`);
    assert.ok(!TEST_ONLY_NAMES.has(name), `${where}: test-only ${name} is not deployed`);
  }
  for (const name of SECRET_NAMES) {
    assert.ok(!raw.has(name), `${where}: secret ${name} is not an environment value; use ${name}_FILE`);
    const file = raw.get(`${name}_FILE`);
    if (file === undefined) continue;
    const { volume, key } = sourceOf(file);
    assert.ok(volume.secret, `${where}: ${name}_FILE=${file} is on a Secret volume`);
    assert.ok(volume.secret.defaultMode === undefined || (volume.secret.defaultMode & 0o007) === 0, `${where}: secret files are not world-readable`);
    assert.match(key, /^[-._a-zA-Z0-9]+$/, `${where}: ${name}_FILE names a valid key of Secret ${volume.secret.secretName}`);
    resolved[`${name}_FILE`] = writeSecret(dummySecret(name));
  }

  let policies: PolicySet | undefined;
  const policiesPath = raw.get('REAPER_POLICIES');
  if (policiesPath !== undefined) {
    const { volume, key } = sourceOf(policiesPath);
    assert.ok(volume.configMap, `${where}: REAPER_POLICIES=${policiesPath} is on a ConfigMap volume`);
    const configMap = rendered.configMaps.get(volume.configMap.name);
    assert.ok(configMap, `${where}: ConfigMap ${volume.configMap.name} is generated`);
    const file = configMap.files.get(key);
    assert.ok(file, `${where}: ConfigMap ${volume.configMap.name} has the key ${key}`);
    const text = readFileSync(file, 'utf8');
    for (const name of policyVariables(text, rel(file))) {
      assert.ok(raw.has(name), `${where}: ${rel(file)} reads \${${name}}, which the container sets`);
    }
    policies = parsePolicies(text, rel(file), resolved);
  }
  const env = loadEnv(resolved);
  return { env, policies, raw };

  function policyVariablesOfContainer(): Set<string> {
    const policyFile = raw.get('REAPER_POLICIES');
    if (policyFile === undefined) return new Set();
    const { volume, key } = sourceOf(policyFile);
    const file = rendered.configMaps.get(volume.configMap?.name)?.files.get(key);
    return file ? policyVariables(readFileSync(file, 'utf8'), rel(file)) : new Set();
  }
}

test('k8s base: a scheduler Deployment, a worker Deployment and a migrate Job, each running its command', () => {
  const scheduler = find(renderedBase.manifests, 'Deployment', SCHEDULER);
  const worker = find(renderedBase.manifests, 'Deployment', WORKER);
  const migrate = find(renderedBase.manifests, 'Job', MIGRATE);
  assert.deepEqual(containersOf(scheduler).map((c) => c.args), [['scheduler']]);
  assert.deepEqual(containersOf(worker).map((c) => c.args), [['worker']]);
  assert.equal(containersOf(migrate)[0]!.args[0], 'migrate');
  assert.ok(['Never', 'OnFailure'].includes(migrate.spec.template.spec.restartPolicy), 'the Job does not restart forever');
  assert.ok(Number.isInteger(migrate.spec.backoffLimit), 'the Job retries a bounded number of times');
  for (const workload of [scheduler, worker, migrate]) {
    for (const container of containersOf(workload)) {
      assert.equal(container.image, 'reaper', `${workload.metadata.name}: the image is set by the overlays' images:`);
      assert.equal(container.command, undefined, `${workload.metadata.name}: the image's ENTRYPOINT (bin/reaper) runs`);
    }
  }
  assert.ok(scheduler.spec.replicas >= 2, 'two schedulers: runs are unique per tick in the database');
});

for (const [name, rendered] of allRendered) {
  test(`k8s ${name}: probes, ports, downward API worker id, grace periods, resources, non-root`, () => {
    for (const deploymentName of [SCHEDULER, WORKER]) {
      const deployment = find(rendered.manifests, 'Deployment', deploymentName);
      const podSpec = deployment.spec.template.spec;
      const where = `${name} ${deploymentName}`;
      assert.equal(podSpec.securityContext?.runAsNonRoot, true, `${where}: runAsNonRoot`);
      assert.equal(podSpec.securityContext?.runAsUser, imageUid, `${where}: runAsUser is the image's USER`);
      assert.ok(podSpec.terminationGracePeriodSeconds >= 45, `${where}: terminationGracePeriodSeconds ${podSpec.terminationGracePeriodSeconds} leaves time to drain`);
      const container = containersOf(deployment)[0]!;
      const { env } = checkK8sContainer(where, podSpec, container, rendered);
      assert.equal(env.httpPort, 8080, `${where}: HTTP_PORT`);
      const portByName = new Map(((container.ports ?? []) as Obj[]).map((port) => [port.name, port.containerPort]));
      const probePort = (probe: Obj) => (typeof probe.httpGet.port === 'string' ? portByName.get(probe.httpGet.port) : probe.httpGet.port);
      assert.equal(container.livenessProbe?.httpGet?.path, '/livez', `${where}: liveness /livez`);
      assert.equal(container.readinessProbe?.httpGet?.path, '/readyz', `${where}: readiness /readyz`);
      if (container.startupProbe) assert.equal(container.startupProbe.httpGet?.path, '/livez', `${where}: startup /livez`);
      for (const probe of [container.livenessProbe, container.readinessProbe, container.startupProbe].filter(Boolean)) {
        assert.equal(probePort(probe), env.httpPort, `${where}: probes hit HTTP_PORT`);
      }
      const workerId = ((container.env ?? []) as Obj[]).find((entry) => entry.name === 'REAPER_WORKER_ID');
      assert.equal(workerId?.valueFrom?.fieldRef?.fieldPath, 'metadata.name', `${where}: REAPER_WORKER_ID is the pod name`);
      const { requests, limits } = container.resources ?? {};
      assert.ok(requests?.cpu && requests?.memory && limits?.memory, `${where}: cpu/memory requests and a memory limit`);
      assert.ok(bytes(limits.memory) >= bytes(requests.memory), `${where}: memory limit >= request`);
      assert.ok(millicores(requests.cpu) > 0, `${where}: cpu request`);
      if (deploymentName === WORKER) {
        assert.ok(bytes(requests.memory) >= 128 * 1024 ** 2 && bytes(requests.memory) <= 256 * 1024 ** 2, `${where}: worker memory request ~150Mi (${requests.memory})`);
      }
      assert.equal(container.securityContext?.allowPrivilegeEscalation, false, `${where}: no privilege escalation`);
    }
    const migrate = find(rendered.manifests, 'Job', MIGRATE);
    const job = checkK8sContainer(`${name} ${MIGRATE}`, migrate.spec.template.spec, containersOf(migrate)[0]!, rendered);
    assert.ok(job.raw.has('DATABASE_URL_FILE'), 'the migrate Job reads DATABASE_URL from a file');
  });

  test(`k8s ${name}: secrets via *_FILE, policies mounted at REAPER_POLICIES and equal to the demo except the media API address`, () => {
    for (const deploymentName of [SCHEDULER, WORKER]) {
      const deployment = find(rendered.manifests, 'Deployment', deploymentName);
      const where = `${name} ${deploymentName}`;
      const { env, policies, raw } = checkK8sContainer(where, deployment.spec.template.spec, containersOf(deployment)[0]!, rendered);
      assert.ok(raw.has('DATABASE_URL_FILE') && raw.has('AMQP_URL_FILE'), `${where}: DATABASE_URL_FILE and AMQP_URL_FILE`);
      assert.equal(env.policiesPath, '/etc/reaper/policies.yaml', `${where}: REAPER_POLICIES`);
      assert.ok(policies, `${where}: policies are mounted`);
      assert.deepEqual(withoutBaseUrls(policies), withoutBaseUrls(demoPolicies), `${where}: the deployed policies are the demo policies`);
      for (const url of remoteBaseUrls(policies)) assert.ok(!/127\.0\.0\.1|localhost/.test(url), `${where}: the media API is not loopback (${url})`);
    }
    const scheduler = find(rendered.manifests, 'Deployment', SCHEDULER);
    assert.ok(
      ((containersOf(scheduler)[0]!.env ?? []) as Obj[]).some((entry) => entry.name === 'REAPER_WEBHOOK_SECRET_FILE'),
      'the scheduler gets the webhook secret (as a file)',
    );
  });

  test(`k8s ${name}: selectors, the scheduler Service, PodDisruptionBudgets`, () => {
    const scheduler = find(rendered.manifests, 'Deployment', SCHEDULER);
    const worker = find(rendered.manifests, 'Deployment', WORKER);
    const podLabels = new Map([
      [SCHEDULER, scheduler.spec.template.metadata.labels as Obj],
      [WORKER, worker.spec.template.metadata.labels as Obj],
    ]);
    for (const deployment of [scheduler, worker]) {
      assert.ok(matches(deployment.spec.selector.matchLabels, podLabels.get(deployment.metadata.name)!), `${deployment.metadata.name} selects its pods`);
    }
    assert.ok(!matches(scheduler.spec.selector.matchLabels, podLabels.get(WORKER)!), 'the scheduler selector does not take worker pods');
    assert.ok(!matches(worker.spec.selector.matchLabels, podLabels.get(SCHEDULER)!), 'the worker selector does not take scheduler pods');

    const services = rendered.manifests.filter((manifest) => manifest.kind === 'Service');
    const webhook = services.find((service) => matches(service.spec.selector, podLabels.get(SCHEDULER)!));
    assert.ok(webhook, 'a Service selects the scheduler pods');
    assert.ok(!matches(webhook.spec.selector, podLabels.get(WORKER)!), 'the webhook Service does not route to workers');
    const schedulerPorts = (containersOf(scheduler)[0]!.ports ?? []) as Obj[];
    for (const port of webhook.spec.ports as Obj[]) {
      const target = port.targetPort ?? port.port;
      assert.ok(schedulerPorts.some((p) => p.name === target || p.containerPort === target), `Service targetPort ${target} is a scheduler port`);
    }

    const budgets = rendered.manifests.filter((manifest) => manifest.kind === 'PodDisruptionBudget');
    for (const [deploymentName, labels] of podLabels) {
      const matching = budgets.filter((budget) => matches(budget.spec.selector.matchLabels, labels));
      assert.equal(matching.length, 1, `one PodDisruptionBudget covers ${deploymentName}`);
      const replicas = find(rendered.manifests, 'Deployment', deploymentName).spec.replicas;
      if (matching[0]!.spec.minAvailable !== undefined && replicas !== undefined) {
        assert.ok(matching[0]!.spec.minAvailable < replicas, `${deploymentName}: the budget allows a drain`);
      }
    }
  });
}

test('k8s overlays: images, replicas, namespaces; prod pins its tag and lets the HPA own the worker count', () => {
  for (const [name, rendered] of renderedOverlays) {
    const kustomization = overlays.get(name)!;
    assert.ok(kustomization.bases.some((b) => b.dir === path.join(K8S, 'base')), `${name} builds on ../../base`);
    assert.ok(typeof kustomization.doc.namespace === 'string' && kustomization.doc.namespace.length > 0, `${name} sets a namespace`);
    assert.ok(rendered.images.some((image) => image.name === 'reaper' && image.newTag), `${name} sets the reaper image tag`);
    for (const image of rendered.images) assert.equal(image.name, 'reaper', `${name}: images: entries name the base image`);
  }
  const prod = renderedOverlays.get('prod')!;
  const tag = prod.images.filter((image) => image.name === 'reaper').at(-1)!.newTag as string;
  assert.ok(!['latest', 'dev', ''].includes(String(tag)), `prod pins a release tag (${tag})`);
  const hpa = prod.manifests.find((manifest) => manifest.kind === 'HorizontalPodAutoscaler');
  assert.ok(hpa, 'prod autoscales workers');
  assert.deepEqual([hpa.spec.scaleTargetRef.kind, hpa.spec.scaleTargetRef.name], ['Deployment', WORKER]);
  assert.ok(hpa.spec.minReplicas >= 2 && hpa.spec.maxReplicas >= hpa.spec.minReplicas, 'HPA bounds');
  assert.equal(find(prod.manifests, 'Deployment', WORKER).spec.replicas, undefined, 'prod removes the worker replicas field (the HPA owns it)');
  assert.ok(find(prod.manifests, 'Deployment', SCHEDULER).spec.replicas >= 2, 'prod runs two schedulers');
});

// ------------------------------------------------------------------------------------------------
// RabbitMQ definitions
// ------------------------------------------------------------------------------------------------

const definitions = JSON.parse(readFileSync(DEFINITIONS_FILE, 'utf8')) as Obj;

/** Definitions-file entries for a topology, as RabbitMQ exports them (with amqplib's defaults). */
function asDefinitions(topology: Topology, vhost: string) {
  return {
    exchanges: topology.exchanges.map((e) => ({ name: e.name, vhost, type: e.type, durable: e.options.durable ?? true, auto_delete: e.options.autoDelete ?? false, internal: e.options.internal ?? false, arguments: e.options.arguments ?? {} })),
    queues: topology.queues.map((q) => ({ name: q.name, vhost, durable: q.options.durable ?? true, auto_delete: q.options.autoDelete ?? false, arguments: q.options.arguments ?? {} })),
    bindings: topology.bindings.map((b) => ({ source: b.exchange, vhost, destination: b.queue, destination_type: 'queue', routing_key: b.routingKey, arguments: b.args ?? {} })),
  };
}

function sortedBy<T>(items: T[], key: (item: T) => string): T[] {
  return [...items].sort((a, b) => key(a).localeCompare(key(b)));
}

const DEFINITIONS_PREFIX = 'reaper';
const DEFINITIONS_DELIVERY_LIMIT = 20;

test('rabbitmq definitions.json is exactly makeTopology({prefix: reaper, demo policies, deliveryLimit: 20})', () => {
  assert.deepEqual(DEMO_POLICY_NAMES, ['seat-holds', 'media-assets'], 'the demo policies the definitions were made for');
  const expected = asDefinitions(makeTopology({ prefix: DEFINITIONS_PREFIX, policies: DEMO_POLICY_NAMES, deliveryLimit: DEFINITIONS_DELIVERY_LIMIT }), '/');
  assert.deepEqual(sortedBy(definitions.exchanges, (e: Obj) => e.name), sortedBy(expected.exchanges, (e) => e.name), 'exchanges');
  assert.deepEqual(sortedBy(definitions.queues, (q: Obj) => q.name), sortedBy(expected.queues, (q) => q.name), 'queues, with the exact arguments');
  const bindingKey = (b: Obj) => `${b.source}|${b.destination}|${b.routing_key}|${JSON.stringify(b.arguments)}`;
  assert.deepEqual(sortedBy(definitions.bindings, bindingKey), sortedBy(expected.bindings, bindingKey), 'bindings, with the exact arguments');
  assert.ok((definitions.vhosts as Obj[]).some((v) => v.name === '/'), 'declares the vhost (a blank node importing definitions creates none)');
  assert.equal(definitions.users, undefined, 'no users (credentials are not committed)');
  assert.equal(definitions.permissions, undefined, 'no permissions');
});

test('every deployment uses the prefix and delivery limit the definitions were made for', () => {
  for (const [name, rendered] of allRendered) {
    for (const deploymentName of [SCHEDULER, WORKER]) {
      const deployment = find(rendered.manifests, 'Deployment', deploymentName);
      const { env } = checkK8sContainer(`${name} ${deploymentName}`, deployment.spec.template.spec, containersOf(deployment)[0]!, rendered);
      assert.equal(env.amqpPrefix, DEFINITIONS_PREFIX, `${name} ${deploymentName}: REAPER_AMQP_PREFIX`);
      assert.equal(env.deliveryLimit, DEFINITIONS_DELIVERY_LIMIT, `${name} ${deploymentName}: REAPER_DELIVERY_LIMIT (a different x-delivery-limit is refused by the broker)`);
    }
  }
  for (const [name, service] of reaperServices()) {
    const env = composeEnv(name, service).env;
    assert.equal(env.amqpPrefix, DEFINITIONS_PREFIX, `compose ${name}: REAPER_AMQP_PREFIX`);
    assert.equal(env.deliveryLimit, DEFINITIONS_DELIVERY_LIMIT, `compose ${name}: REAPER_DELIVERY_LIMIT`);
  }
});

function rabbitmqConf(): Map<string, string> {
  const settings = new Map<string, string>();
  for (const line of readFileSync(RABBITMQ_CONF, 'utf8').split('\n')) {
    const trimmed = line.trim();
    if (trimmed === '' || trimmed.startsWith('#')) continue;
    const match = /^([A-Za-z0-9_.]+)\s*=\s*(.+)$/.exec(trimmed);
    assert.ok(match, `rabbitmq.conf: "${trimmed}" is key = value`);
    settings.set(match[1]!, match[2]!.trim());
  }
  return settings;
}

test('rabbitmq.conf sets consumer_timeout and loads definitions from a local path', () => {
  const settings = rabbitmqConf();
  const timeout = Number(settings.get('consumer_timeout'));
  assert.ok(Number.isInteger(timeout) && timeout >= 5 * 60_000, `consumer_timeout ${settings.get('consumer_timeout')} ms is minutes, not seconds`);
  assert.equal(settings.get('definitions.import_backend'), 'local_filesystem');
  assert.ok(settings.get('definitions.local.path')?.startsWith('/'), 'definitions.local.path is absolute');
});

// ------------------------------------------------------------------------------------------------
// docker-compose.yml
// ------------------------------------------------------------------------------------------------

const compose = yamlOne(COMPOSE_FILE);
const services = compose.services as Record<string, Obj>;

function reaperServices(): [string, Obj][] {
  return Object.entries(services).filter(([, service]) => service.build !== undefined && service.entrypoint === undefined);
}

function composeVolumes(service: Obj): { source: string; target: string }[] {
  return ((service.volumes ?? []) as (string | Obj)[]).map((volume) => {
    if (typeof volume === 'string') {
      const [source, target] = volume.split(':') as [string, string];
      return { source, target };
    }
    return { source: volume.source as string, target: volume.target as string };
  });
}

function composeEnvironment(service: Obj): Map<string, string> {
  const environment = service.environment ?? {};
  const entries: [string, string][] = Array.isArray(environment)
    ? (environment as string[]).map((entry) => [entry.slice(0, entry.indexOf('=')), entry.slice(entry.indexOf('=') + 1)])
    : Object.entries(environment as Obj).map(([key, value]) => [key, String(value)]);
  return new Map(entries);
}

/** loadEnv over a compose service's environment, and the host file behind REAPER_POLICIES. */
function composeEnv(name: string, service: Obj): { env: Env; raw: Map<string, string>; policiesFile: string | undefined } {
  const raw = composeEnvironment(service);
  for (const key of raw.keys()) {
    assert.ok(ENV_NAMES.has(key), `compose ${name}: ${key} is read by shared/config/env.ts`);
    assert.ok(!TEST_ONLY_NAMES.has(key), `compose ${name}: test-only ${key} is not set`);
  }
  let policiesFile: string | undefined;
  const policiesPath = raw.get('REAPER_POLICIES');
  if (policiesPath !== undefined) {
    const mount = composeVolumes(service).find((volume) => volume.target === policiesPath);
    assert.ok(mount, `compose ${name}: REAPER_POLICIES=${policiesPath} is mounted`);
    policiesFile = path.resolve(ROOT, mount.source);
    assert.ok(existsSync(policiesFile), `compose ${name}: ${mount.source} exists`);
  }
  return { env: loadEnv(Object.fromEntries(raw)), raw, policiesFile };
}

test('compose: postgres 15, rabbitmq 3.10-management, migrate once, a scheduler and two workers from infra/Dockerfile', () => {
  assert.equal(services.postgres?.image, 'postgres:15');
  assert.equal(services.rabbitmq?.image, 'rabbitmq:3.10-management');
  for (const [name, service] of Object.entries(services).filter(([, s]) => s.build !== undefined)) {
    assert.equal(service.build.dockerfile, 'infra/Dockerfile', `${name} is built from infra/Dockerfile`);
    assert.equal(path.resolve(ROOT, service.build.context ?? '.'), ROOT, `${name} builds from the repository root`);
  }
  assert.deepEqual(services.migrate?.command, ['migrate']);
  assert.equal(services.migrate?.restart ?? 'no', 'no', 'migrate is one-shot');
  assert.deepEqual(services.scheduler?.command, ['scheduler']);
  const workers = Object.entries(services).filter(([, service]) => Array.isArray(service.command) && service.command[0] === 'worker');
  const workerCount = workers.reduce((sum, [, service]) => sum + (service.deploy?.replicas ?? 1), 0);
  assert.ok(workerCount >= 2, `two workers (found ${workerCount})`);
  for (const [name, service] of [['scheduler', services.scheduler!], ...workers] as [string, Obj][]) {
    assert.equal(service.depends_on?.migrate?.condition, 'service_completed_successfully', `${name} starts after migrations`);
    assert.equal(service.depends_on?.rabbitmq?.condition, 'service_healthy', `${name} waits for the broker`);
  }
  assert.equal(services.migrate.depends_on?.postgres?.condition, 'service_healthy', 'migrate waits for PostgreSQL');
  for (const [name, service] of Object.entries(services)) {
    for (const [dependency, spec] of Object.entries((service.depends_on ?? {}) as Obj)) {
      if ((spec as Obj).condition === 'service_healthy') assert.ok(services[dependency]?.healthcheck, `${name} waits for ${dependency}, which has a healthcheck`);
    }
  }
  for (const name of ['postgres', 'rabbitmq', 'scheduler', 'media-api', ...workers.map(([workerName]) => workerName)]) {
    assert.ok(services[name]?.healthcheck?.test, `${name} has a healthcheck`);
  }
});

test('compose: reaper services use only env.ts variables, valid values, and a health check on their /readyz', () => {
  const postgres = composeEnvironment(services.postgres!);
  for (const [name, service] of reaperServices()) {
    const { env } = composeEnv(name, service);
    const database = new URL(env.databaseUrl);
    assert.equal(database.hostname, 'postgres', `${name}: DATABASE_URL points at the postgres service`);
    assert.equal(decodeURIComponent(database.username), postgres.get('POSTGRES_USER'), `${name}: database user`);
    assert.equal(decodeURIComponent(database.password), postgres.get('POSTGRES_PASSWORD'), `${name}: database password`);
    assert.equal(database.pathname.slice(1), postgres.get('POSTGRES_DB'), `${name}: database name`);
    assert.equal(new URL(env.amqpUrl).hostname, 'rabbitmq', `${name}: AMQP_URL points at the rabbitmq service`);
    if (service.healthcheck) {
      const probe = (service.healthcheck.test as string[]).join(' ');
      assert.ok(probe.includes(`127.0.0.1:${env.httpPort}/readyz`), `${name}: the healthcheck asks /readyz on HTTP_PORT`);
    }
  }
});

test('compose: the broker user exists in the boot definitions with the password of AMQP_URL', () => {
  const settings = rabbitmqConf();
  const definitionsDir = settings.get('definitions.local.path')!;
  const mounts = composeVolumes(services.rabbitmq!);
  const topology = mounts.find((mount) => path.resolve(ROOT, mount.source) === DEFINITIONS_FILE);
  assert.ok(topology, 'rabbitmq mounts infra/rabbitmq/definitions.json');
  assert.equal(path.posix.dirname(topology.target), definitionsDir.replace(/\/$/, ''), 'into the directory rabbitmq.conf imports');
  const conf = mounts.find((mount) => path.resolve(ROOT, mount.source) === RABBITMQ_CONF);
  assert.ok(conf && /^\/etc\/rabbitmq\/conf\.d\/[^/]+\.conf$/.test(conf.target), 'rabbitmq.conf is a conf.d fragment');

  const userConfig = ((services.rabbitmq!.configs ?? []) as Obj[]).find((config) => path.posix.dirname(config.target) === definitionsDir.replace(/\/$/, ''));
  assert.ok(userConfig, 'a users definitions file sits next to the topology (a blank node importing definitions creates no user)');
  const users = JSON.parse(compose.configs[userConfig.source].content as string) as Obj;
  const amqp = new URL(composeEnvironment(services.worker!).get('AMQP_URL')!);
  const username = decodeURIComponent(amqp.username);
  const password = decodeURIComponent(amqp.password);
  const vhost = amqp.pathname === '' || amqp.pathname === '/' ? '/' : decodeURIComponent(amqp.pathname.slice(1));
  const user = (users.users as Obj[]).find((candidate) => candidate.name === username);
  assert.ok(user, `user ${username} is defined`);
  assert.equal(user.hashing_algorithm, 'rabbit_password_hashing_sha256');
  const hash = Buffer.from(user.password_hash as string, 'base64');
  const salt = hash.subarray(0, 4);
  const expected = createHash('sha256').update(Buffer.concat([salt, Buffer.from(password, 'utf8')])).digest();
  assert.ok(hash.length === 36 && expected.equals(hash.subarray(4)), 'password_hash is the salted SHA-256 of the AMQP_URL password');
  assert.ok((users.permissions as Obj[]).some((p) => p.user === username && p.vhost === vhost && p.configure === '.*' && p.write === '.*' && p.read === '.*'), 'full permissions on the vhost');
  assert.ok((users.vhosts as Obj[]).some((v) => v.name === vhost), 'the users file declares its vhost');
});

test('compose: policies are the demo policies with the media API pointing at the media-api service it runs', () => {
  const seen = new Set<string>();
  for (const [name, service] of reaperServices()) {
    const { policiesFile, raw } = composeEnv(name, service);
    assert.ok(policiesFile, `${name} mounts a policies file`);
    seen.add(policiesFile);
    const policies = parsePolicies(readFileSync(policiesFile, 'utf8'), rel(policiesFile), Object.fromEntries(raw));
    assert.deepEqual(withoutBaseUrls(policies), withoutBaseUrls(demoPolicies), `${rel(policiesFile)} equals the demo policies but for baseUrl`);
    for (const baseUrl of remoteBaseUrls(policies)) {
      const url = new URL(baseUrl);
      const api = services[url.hostname];
      assert.ok(api, `${baseUrl}: ${url.hostname} is a compose service`);
      const script = [...(api.entrypoint ?? []), ...(api.command ?? [])].join(' ');
      assert.ok(script.includes('dist/test/support/media-api-main.js'), `${url.hostname} runs the stand-in media API`);
      assert.ok(script.includes(`listen(${url.port}, '0.0.0.0')`), `${url.hostname} listens on ${url.port} on every interface`);
    }
  }
  assert.deepEqual([...seen].map(rel), [path.join('infra', 'compose', 'policies.yaml')]);
});
