/**
 * The Kubernetes manifests as a cluster would get them: `kubectl kustomize` renders the base and
 * each overlay (no model of kustomize of our own), every rendered object is validated against the
 * Kubernetes API schemas (npm `kubernetes-models`, `@kubernetes-models/keda`,
 * `@kubernetes-models/prometheus-operator`), and then our own rules run on the rendered output:
 * probes, resources, the restricted pod-security profile, selectors, PDB and ScaledObject targets,
 * network policies, service accounts, labels, and the environment each container gets compared
 * with what shared/config/env.ts and the policies file read.
 */
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { parse as parseYaml } from 'yaml';
import { brokerNames, kedaTriggers, kedaTriggersPatch } from '../../shared/amqp/topology';
import { loadEnv, type Env } from '../../shared/config/env';
import { RELAY_CLAIM_MS, RELAY_DB_POOL_SIZE } from '../../services/relay/relay';
import { type PolicySet } from '../../shared/config/policies';
import {
  DEFINITIONS_DELIVERY_LIMIT,
  DEFINITIONS_PREFIX,
  ENV_NAMES,
  K8S,
  ROOT,
  SECRET_NAMES,
  TEST_ONLY_NAMES,
  demoPolicies,
  dummySecret,
  imageUid,
  parsePoliciesWithPlaceholders,
  policyInputs,
  remoteBaseUrls,
  withoutEnvironmentSpecifics,
  writeSecret,
  yamlTextDocuments,
  type Obj,
} from '../support/deployment-files';

const tmp = mkdtempSync(path.join(tmpdir(), 'reaper-k8s-test-'));
after(() => rmSync(tmp, { recursive: true, force: true }));

const KUBECTL_HINT =
  'kubectl (with kustomize built in, v1.27 or later) is needed to render infra/k8s: install it from the Kubernetes package ' +
  'repository (apt-get install kubectl) or as a binary (https://kubernetes.io/docs/tasks/tools/), then run the tests again';

/** `kubectl kustomize <dir>`: the objects exactly as `kubectl apply -k <dir>` would send them. */
function kustomize(dir: string): Obj[] {
  let output: string;
  try {
    output = execFileSync('kubectl', ['kustomize', dir], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'], timeout: 60_000 });
  } catch (error) {
    const failure = error as NodeJS.ErrnoException & { stderr?: string };
    if (failure.code === 'ENOENT') throw new Error(`kubectl is not installed. ${KUBECTL_HINT}`);
    throw new Error(`kubectl kustomize ${path.relative(process.cwd(), dir)} failed: ${failure.stderr || failure.message}`);
  }
  return yamlTextDocuments(output, `kubectl kustomize ${dir}`);
}

/**
 * A scratch kustomization on top of `resources` (relative to infra/k8s), as an operator's own
 * overlay would be: base and prod ship no policies, so these add them (the demo ones, which the
 * checks below compare with), base through the demo component, prod through a generator.
 */
function scratchOverlay(name: string, body: string, withPolicies = false): string {
  const dir = path.join(tmp, `overlay-${name}`);
  mkdirSync(dir, { recursive: true });
  // kustomize refuses absolute paths: a link to infra/k8s makes the relative ones resolve.
  symlinkSync(K8S, path.join(dir, 'k8s'));
  if (withPolicies) copyFileSync(path.join(K8S, 'components', 'demo-policies', 'policies.yaml'), path.join(dir, 'policies.yaml'));
  writeFileSync(path.join(dir, 'kustomization.yaml'), `apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n${body}`);
  return dir;
}

const CLI = path.join(ROOT, 'dist', 'services', 'cli', 'main.js');

/** The reaper CLI as an operator runs it, with only the given environment (and PATH). */
function reaperCli(args: string[], env: Record<string, string>): string {
  return execFileSync(process.execPath, [CLI, ...args], { encoding: 'utf8', env: { PATH: process.env.PATH ?? '', ...env }, timeout: 60_000 });
}

/**
 * An operator's overlay on prod, as overlays/prod/kustomization.yaml tells them to write it: their
 * policies (the demo ones here) and the KEDA triggers `reaper topology --keda-triggers` generates
 * from them (run here, the real command, on the same file).
 */
function operatorOverlay(name: string, components: string[] = []): string {
  const withComponents = components.length > 0 ? `components: [${components.join(', ')}]\n` : '';
  const dir = scratchOverlay(name, 'resources: [k8s/overlays/prod]\n' + withComponents + 'configMapGenerator:\n  - name: reaper-policies\n    behavior: replace\n    files: [policies.yaml]\npatches:\n  - path: keda-triggers.yaml\n', true);
  writeFileSync(path.join(dir, 'keda-triggers.yaml'), reaperCli(['topology', '--keda-triggers'], { REAPER_POLICIES: path.join(dir, 'policies.yaml'), REAPER_AMQP_PREFIX: DEFINITIONS_PREFIX }));
  return dir;
}

/** The optional `reaper relay` Deployment (components/events-relay), next to an overlay as its header says. */
const EVENTS_RELAY = 'k8s/components/events-relay';

const TARGETS: [string, string][] = [
  ['base', scratchOverlay('base', 'resources: [k8s/base]\ncomponents: [k8s/components/demo-policies]\n')],
  ['dev', path.join(K8S, 'overlays', 'dev')],
  ['prod', operatorOverlay('prod')],
  // The same rules below run on the relay as on the scheduler and the workers wherever it is deployed.
  ['dev+events-relay', scratchOverlay('dev-relay', `resources: [k8s/overlays/dev]\ncomponents: [${EVENTS_RELAY}]\n`)],
  ['prod+events-relay', operatorOverlay('prod-relay', [EVENTS_RELAY])],
];
const rendered = new Map(TARGETS.map(([name, dir]) => [name, kustomize(dir)]));
const OVERLAYS = [...rendered.keys()].filter((name) => name !== 'base');
const WITH_RELAY = OVERLAYS.filter((name) => name.endsWith('+events-relay'));
/** prod, or an overlay on it: every egress destination named. */
const isProd = (name: string) => name === 'prod' || name.startsWith('prod+');

const SCHEDULER = 'reaper-scheduler';
const WORKER = 'reaper-worker';
const RELAY = 'reaper-relay';
const MIGRATE = 'reaper-migrate';

function find(manifests: Obj[], kind: string, name: string | RegExp): Obj {
  const found = manifests.find((m) => m.kind === kind && (typeof name === 'string' ? m.metadata?.name === name : name.test(m.metadata?.name)));
  assert.ok(found, `${kind}/${name} exists; have ${manifests.map((m) => `${m.kind}/${m.metadata?.name}`).join(', ')}`);
  return found;
}

function ofKind(manifests: Obj[], kind: string): Obj[] {
  return manifests.filter((m) => m.kind === kind);
}

/** The long-running services: the scheduler, the workers, and the relay where it is deployed. */
function deployments(manifests: Obj[]): Obj[] {
  return ofKind(manifests, 'Deployment');
}

/** Deployments and Jobs: everything that runs pods. */
function workloads(manifests: Obj[]): Obj[] {
  return manifests.filter((m) => m.kind === 'Deployment' || m.kind === 'Job');
}

function containersOf(workload: Obj): Obj[] {
  return (workload.spec?.template?.spec?.containers ?? []) as Obj[];
}

function matches(selector: Obj | undefined, labels: Obj | undefined): boolean {
  return Object.entries(selector ?? {}).every(([key, value]) => labels?.[key] === value);
}

/** A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels. */
function selects(selector: Obj | undefined, labels: Obj): boolean {
  const expressions = (selector?.matchExpressions ?? []) as Obj[];
  return matches(selector?.matchLabels, labels) && expressions.every((e) => {
    const has = Object.hasOwn(labels, e.key);
    switch (e.operator) {
      case 'In': return has && (e.values as string[]).includes(labels[e.key]);
      case 'NotIn': return !has || !(e.values as string[]).includes(labels[e.key]);
      case 'Exists': return has;
      case 'DoesNotExist': return !has;
      default: throw new Error(`unknown selector operator ${e.operator}`);
    }
  });
}

/** Every ingress and egress rule that some policy opens for pods with these labels (policies add up). */
function openedFor(policies: Obj[], podLabels: Obj): { ingress: { policy: string; rule: Obj }[]; egress: { policy: string; rule: Obj }[] } {
  const selecting = policies.filter((p) => selects(p.spec.podSelector, podLabels));
  const rules = (type: 'Ingress' | 'Egress') => selecting
    .filter((p) => (p.spec.policyTypes as string[]).includes(type))
    .flatMap((p) => ((p.spec[type.toLowerCase()] ?? []) as Obj[]).map((rule) => ({ policy: p.metadata.name as string, rule })));
  return { ingress: rules('Ingress'), egress: rules('Egress') };
}

/** The cluster DNS pods, or NodeLocal DNSCache's link-local address (base/networkpolicies.yaml). */
function isClusterDns(peer: Obj): boolean {
  return peer.podSelector?.matchLabels?.['k8s-app'] === 'kube-dns' || peer.ipBlock?.cidr === '169.254.20.10/32';
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

// ------------------------------------------------------------------------------------------------
// The API schemas
// ------------------------------------------------------------------------------------------------

/** The npm package that holds the model of an apiVersion, and the module path inside it. */
function modelModule(apiVersion: string): { pkg: string; module: string } {
  const [group, version] = apiVersion.includes('/') ? (apiVersion.split('/') as [string, string]) : ['', apiVersion];
  if (group === '') return { pkg: 'kubernetes-models', module: `kubernetes-models/${version}` };
  if (group === 'keda.sh' || group.endsWith('.keda.sh')) return { pkg: '@kubernetes-models/keda', module: `@kubernetes-models/keda/${group}/${version}` };
  if (group === 'monitoring.coreos.com') return { pkg: '@kubernetes-models/prometheus-operator', module: `@kubernetes-models/prometheus-operator/${group}/${version}` };
  return { pkg: 'kubernetes-models', module: `kubernetes-models/${group}/${version}` };
}

interface Model {
  validate(): void;
}
type ModelClass = new (data: Obj) => Model;

/** Loads a model class; a missing package fails with the command that installs it. */
async function modelClass(apiVersion: string, kind: string): Promise<ModelClass> {
  const { pkg, module } = modelModule(apiVersion);
  let loaded: Record<string, unknown>;
  try {
    // The model packages are ES modules: import(), not require(), from this CommonJS build.
    loaded = (await import(module)) as Record<string, unknown>;
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    if (code === 'ERR_MODULE_NOT_FOUND' || code === 'MODULE_NOT_FOUND') {
      throw new Error(`the npm package ${pkg} is missing (it validates ${apiVersion} objects): npm install --save-dev ${pkg}`);
    }
    if (code === 'ERR_PACKAGE_PATH_NOT_EXPORTED') throw new Error(`${pkg} has no models for apiVersion ${apiVersion}`);
    throw error;
  }
  const found = loaded[kind];
  assert.equal(typeof found, 'function', `${pkg} has a model for ${apiVersion} ${kind}`);
  return found as ModelClass;
}

for (const [name, manifests] of rendered) {
  test(`k8s ${name}: every rendered object validates against its API schema`, async () => {
    assert.ok(manifests.length >= 10, `${name} renders objects (${manifests.length})`);
    for (const manifest of manifests) {
      const where = `${name}: ${manifest.apiVersion} ${manifest.kind}/${manifest.metadata?.name}`;
      const Model = await modelClass(manifest.apiVersion as string, manifest.kind as string);
      assert.doesNotThrow(() => new Model(manifest).validate(), where);
    }
  });
}

test('the schema check catches a wrong field type (it is not a no-op)', async () => {
  const Deployment = await modelClass('apps/v1', 'Deployment');
  const worker = structuredClone(find(rendered.get('prod')!, 'Deployment', WORKER));
  worker.spec.template.spec.containers[0].ports[0].containerPort = 'eighty';
  assert.throws(() => new Deployment(worker).validate());
  const ScaledObject = await modelClass('keda.sh/v1alpha1', 'ScaledObject');
  const scaled = structuredClone(find(rendered.get('prod')!, 'ScaledObject', WORKER));
  delete scaled.spec.triggers;
  assert.throws(() => new ScaledObject(scaled).validate());
});

// ------------------------------------------------------------------------------------------------
// Each container's environment against what the code reads
// ------------------------------------------------------------------------------------------------

/** Checks a container's environment and returns what loadEnv makes of it, plus its policies. */
function checkContainerEnv(
  where: string,
  podSpec: Obj,
  container: Obj,
  manifests: Obj[],
): { env: Env; policies: PolicySet | undefined; raw: Map<string, string>; secretKeys: string[]; secretFiles: Map<string, string> } {
  const configMap = (configMapName: string) => find(manifests, 'ConfigMap', configMapName).data as Record<string, string>;
  const raw = new Map<string, string>();
  const resolved: NodeJS.ProcessEnv = {};
  for (const from of (container.envFrom ?? []) as Obj[]) {
    assert.ok(from.configMapRef, `${where}: envFrom only from ConfigMaps (secrets are files)`);
    for (const [key, value] of Object.entries(configMap(from.configMapRef.name))) {
      raw.set(key, value);
      resolved[key] = value;
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
    if (volume.projected) {
      // A projected volume: the file is an item of one of its sources (each lists its items).
      for (const projected of volume.projected.sources as Obj[]) {
        const item = ((projected.secret ?? projected.configMap)?.items ?? []).find((i: Obj) => i.path === inside);
        if (item) return { volume: { secret: projected.secret, configMap: projected.configMap }, key: item.key as string };
      }
      assert.fail(`${where}: ${file} is one of the items of projected volume ${volume.name}`);
    }
    const source = volume.secret ?? volume.configMap;
    const items = (source?.items ?? []) as Obj[];
    const item = items.find((i) => i.path === inside);
    // With `items`, only the listed keys become files.
    assert.ok(items.length === 0 || item, `${where}: ${file} is one of the items of volume ${volume.name}`);
    return { volume, key: (item?.key as string | undefined) ?? inside };
  };

  const secretKeys: string[] = [];
  for (const volume of volumes.filter((v) => v.secret)) {
    assert.equal(volume.secret.secretName, 'reaper-secrets', `${where}: secrets come from reaper-secrets`);
    assert.ok(volume.secret.defaultMode === undefined || (volume.secret.defaultMode & 0o007) === 0, `${where}: secret files are not world-readable`);
    secretKeys.push(...((volume.secret.items ?? []) as Obj[]).map((item) => item.key as string));
  }
  for (const volume of volumes.filter((v) => v.projected)) {
    assert.ok(volume.projected.defaultMode === undefined || (volume.projected.defaultMode & 0o007) === 0, `${where}: projected files are not world-readable`);
    for (const projected of (volume.projected.sources as Obj[]).filter((p) => p.secret)) {
      assert.equal(projected.secret.name, 'reaper-secrets', `${where}: secrets come from reaper-secrets`);
      secretKeys.push(...((projected.secret.items ?? []) as Obj[]).map((item) => item.key as string));
    }
  }

  let policies: PolicySet | undefined;
  let policyVariables = new Set<string>();
  const policiesPath = raw.get('REAPER_POLICIES');
  if (policiesPath !== undefined) {
    const { volume, key } = sourceOf(policiesPath);
    assert.ok(volume.configMap, `${where}: REAPER_POLICIES=${policiesPath} is on a ConfigMap volume`);
    const text = configMap(volume.configMap.name)[key];
    assert.ok(text, `${where}: ConfigMap ${volume.configMap.name} has the key ${key}`);
    const inputs = policyInputs(text, `${where} policies`);
    policyVariables = inputs.variables;
    for (const name of inputs.variables) assert.ok(raw.has(name), `${where}: the policies read \${${name}}, which the container sets`);
    for (const file of inputs.files) {
      const source = sourceOf(file);
      // The scheduler never calls the remote: a non-secret placeholder stands in for the token.
      const placeholder = source.volume.configMap && /-placeholders(-[a-z0-9]+)?$/.test(source.volume.configMap.name);
      assert.ok(source.volume.secret || placeholder, `${where}: the policies read \${file:${file}}, which is a mounted Secret key (or the scheduler's placeholder)`);
    }
    policies = parsePoliciesWithPlaceholders(text, `${where} policies`, resolved);
  }
  for (const name of raw.keys()) {
    assert.ok(ENV_NAMES.has(name) || policyVariables.has(name), `${where}: ${name} is read by shared/config/env.ts or by the mounted policies file`);
    assert.ok(!TEST_ONLY_NAMES.has(name), `${where}: test-only ${name} is not deployed`);
  }
  /** Each secret read through <NAME>_FILE, with the key of reaper-secrets its file is. */
  const secretFiles = new Map<string, string>();
  for (const name of SECRET_NAMES) {
    assert.ok(!raw.has(name), `${where}: secret ${name} is not an environment value; use ${name}_FILE`);
    const file = raw.get(`${name}_FILE`);
    if (file === undefined) continue;
    const { volume, key } = sourceOf(file);
    assert.ok(volume.secret, `${where}: ${name}_FILE=${file} is on a Secret volume`);
    assert.match(key, /^[-._a-zA-Z0-9]+$/, `${where}: ${name}_FILE names a valid key of Secret ${volume.secret.secretName}`);
    secretFiles.set(name, key);
    resolved[`${name}_FILE`] = writeSecret(tmp, dummySecret(name));
  }
  return { env: loadEnv(resolved), policies, raw, secretKeys, secretFiles };
}

// ------------------------------------------------------------------------------------------------
// Our rules
// ------------------------------------------------------------------------------------------------

test('k8s base: a scheduler Deployment, a worker Deployment and a migrate Job, each running its command', () => {
  const manifests = rendered.get('base')!;
  const scheduler = find(manifests, 'Deployment', SCHEDULER);
  const worker = find(manifests, 'Deployment', WORKER);
  const migrate = find(manifests, 'Job', MIGRATE);
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

/** The restricted Pod Security Standard (and our read-only root file system), per pod. */
function checkRestricted(where: string, podSpec: Obj): void {
  const pod = podSpec.securityContext ?? {};
  assert.equal(pod.runAsNonRoot, true, `${where}: runAsNonRoot`);
  assert.equal(pod.runAsUser, imageUid, `${where}: runAsUser is the image's USER`);
  assert.ok(['RuntimeDefault', 'Localhost'].includes(pod.seccompProfile?.type), `${where}: seccompProfile RuntimeDefault`);
  for (const flag of ['hostNetwork', 'hostPID', 'hostIPC']) assert.notEqual(podSpec[flag], true, `${where}: no ${flag}`);
  const allowedVolumes = ['configMap', 'secret', 'emptyDir', 'projected', 'downwardAPI', 'persistentVolumeClaim', 'ephemeral', 'csi'];
  for (const volume of (podSpec.volumes ?? []) as Obj[]) {
    const type = Object.keys(volume).find((key) => key !== 'name')!;
    assert.ok(allowedVolumes.includes(type), `${where}: volume ${volume.name} is of an allowed type (${type})`);
  }
  for (const container of [...((podSpec.initContainers ?? []) as Obj[]), ...((podSpec.containers ?? []) as Obj[])]) {
    const context = container.securityContext ?? {};
    const at = `${where} container ${container.name}`;
    assert.equal(context.allowPrivilegeEscalation, false, `${at}: allowPrivilegeEscalation false`);
    assert.notEqual(context.privileged, true, `${at}: not privileged`);
    assert.ok(((context.capabilities?.drop ?? []) as string[]).includes('ALL'), `${at}: drops ALL capabilities`);
    assert.ok(((context.capabilities?.add ?? []) as string[]).every((cap) => cap === 'NET_BIND_SERVICE'), `${at}: adds no capability`);
    assert.equal(context.readOnlyRootFilesystem, true, `${at}: read-only root file system`);
    assert.ok(context.runAsUser === undefined || context.runAsUser !== 0, `${at}: not root`);
    assert.ok(context.seccompProfile === undefined || ['RuntimeDefault', 'Localhost'].includes(context.seccompProfile.type), `${at}: seccomp`);
    const { requests, limits } = container.resources ?? {};
    assert.ok(requests?.cpu && requests?.memory && limits?.memory, `${at}: cpu/memory requests and a memory limit`);
    assert.ok(bytes(limits.memory) >= bytes(requests.memory), `${at}: memory limit >= request`);
    assert.ok(millicores(requests.cpu) > 0, `${at}: cpu request`);
    assert.equal(container.lifecycle?.preStop?.exec, undefined, `${at}: preStop uses the sleep action, not exec (the image need not have a sleep binary)`);
  }
}

for (const [name, manifests] of rendered) {
  test(`k8s ${name}: restricted pods, probes, ports, worker id, grace periods, resources`, () => {
    for (const workload of workloads(manifests)) checkRestricted(`${name} ${workload.kind}/${workload.metadata.name}`, workload.spec.template.spec);
    for (const deployment of deployments(manifests)) {
      const deploymentName = deployment.metadata.name as string;
      const podSpec = deployment.spec.template.spec;
      const where = `${name} ${deploymentName}`;
      const container = containersOf(deployment)[0]!;
      const { env } = checkContainerEnv(where, podSpec, container, manifests);
      const workerId = ((container.env ?? []) as Obj[]).find((entry) => entry.name === 'REAPER_WORKER_ID');
      assert.equal(workerId?.valueFrom?.fieldRef?.fieldPath, 'metadata.name', `${where}: REAPER_WORKER_ID is the pod name`);
      if (deploymentName === RELAY) {
        // SIGTERM ends the relay after its current pass, which ends within its claim's lease.
        assert.ok(podSpec.terminationGracePeriodSeconds * 1000 >= RELAY_CLAIM_MS, `${where}: terminationGracePeriodSeconds ${podSpec.terminationGracePeriodSeconds} covers a pass (its ${RELAY_CLAIM_MS} ms claim)`);
      } else {
        assert.ok(podSpec.terminationGracePeriodSeconds >= 45, `${where}: terminationGracePeriodSeconds ${podSpec.terminationGracePeriodSeconds} leaves time to drain`);
      }
      assert.equal(env.httpPort, 8080, `${where}: HTTP_PORT`);
      const portByName = new Map(((container.ports ?? []) as Obj[]).map((port) => [port.name, port.containerPort]));
      const probePort = (probe: Obj) => (typeof probe.httpGet.port === 'string' ? portByName.get(probe.httpGet.port) : probe.httpGet.port);
      assert.equal(container.livenessProbe?.httpGet?.path, '/livez', `${where}: liveness /livez`);
      assert.equal(container.readinessProbe?.httpGet?.path, '/readyz', `${where}: readiness /readyz`);
      assert.equal(container.startupProbe?.httpGet?.path, '/livez', `${where}: startup /livez`);
      for (const probe of [container.livenessProbe, container.readinessProbe, container.startupProbe]) {
        assert.equal(probePort(probe), env.httpPort, `${where}: probes hit HTTP_PORT`);
      }
      // Prometheus without the Operator (components/monitoring) finds every service by these.
      const annotations = (deployment.spec.template.metadata.annotations ?? {}) as Record<string, string>;
      assert.deepEqual(
        { scrape: annotations['prometheus.io/scrape'], port: Number(annotations['prometheus.io/port']), path: annotations['prometheus.io/path'] },
        { scrape: 'true', port: env.httpPort, path: '/metrics' },
        `${where}: scrape annotations name /metrics on HTTP_PORT`,
      );
      if (deploymentName === WORKER) {
        const memory = bytes(container.resources.requests.memory);
        assert.ok(memory >= 128 * 1024 ** 2 && memory <= 256 * 1024 ** 2, `${where}: worker memory request ~150Mi (${container.resources.requests.memory})`);
      }
    }
  });

  test(`k8s ${name}: one credential per workload, secrets as files, policies equal to the demo but for the media API`, () => {
    const keysOf = new Map<string, string[]>();
    const secretsOf = new Map<string, Map<string, string>>();
    for (const workload of workloads(manifests)) {
      const where = `${name} ${workload.metadata.name}`;
      const { env, policies, raw, secretKeys, secretFiles } = checkContainerEnv(where, workload.spec.template.spec, containersOf(workload)[0]!, manifests);
      keysOf.set(workload.metadata.labels['app.kubernetes.io/component'], secretKeys);
      secretsOf.set(workload.metadata.labels['app.kubernetes.io/component'], secretFiles);
      assert.ok(raw.has('DATABASE_URL_FILE'), `${where}: DATABASE_URL_FILE`);
      if (workload.kind === 'Job') continue;
      assert.ok(raw.has('AMQP_URL_FILE'), `${where}: AMQP_URL_FILE`);
      assert.equal(env.policiesPath, '/etc/reaper/policies.yaml', `${where}: REAPER_POLICIES`);
      assert.ok(policies, `${where}: policies are mounted`);
      assert.deepEqual(withoutEnvironmentSpecifics(policies), withoutEnvironmentSpecifics(demoPolicies), `${where}: the deployed policies are the demo policies`);
      for (const url of remoteBaseUrls(policies)) assert.ok(!/127\.0\.0\.1|localhost/.test(url), `${where}: the media API is not loopback (${url})`);
    }
    // The migrate Job alone may change the schema: it alone gets the migrator's credentials.
    assert.deepEqual(keysOf.get('migrate'), ['migrate-database-url'], `${name}: the migrate Job gets only its own key`);
    assert.deepEqual(new Set(keysOf.get('scheduler')), new Set(['scheduler-database-url', 'scheduler-amqp-url', 'webhook-secret']), `${name}: scheduler keys (not the media API token: it never calls the API)`);
    assert.deepEqual(new Set(keysOf.get('worker')), new Set(['worker-database-url', 'worker-amqp-url', 'media-api-token']), `${name}: worker keys`);
    if (keysOf.has('relay')) {
      // docs/deploying.md "PostgreSQL roles": `reaper relay` runs as the scheduler's role, and publishes as its broker user.
      assert.deepEqual(new Set(keysOf.get('relay')), new Set(['scheduler-database-url', 'scheduler-amqp-url']), `${name}: relay keys (the scheduler's credentials; no webhook secret, no media API token)`);
      for (const secret of ['DATABASE_URL', 'AMQP_URL']) {
        assert.equal(secretsOf.get('relay')!.get(secret), secretsOf.get('scheduler')!.get(secret), `${name}: the relay's ${secret}_FILE is the scheduler's Secret key`);
      }
    }
    const scheduler = find(manifests, 'Deployment', SCHEDULER);
    assert.ok(((containersOf(scheduler)[0]!.env ?? []) as Obj[]).some((e) => e.name === 'REAPER_WEBHOOK_SECRET_FILE'), 'the scheduler gets the webhook secret (as a file)');
    for (const deployment of deployments(manifests)) {
      const deploymentName = deployment.metadata.name as string;
      const [prefix, limit] = [DEFINITIONS_PREFIX, DEFINITIONS_DELIVERY_LIMIT];
      const { env } = checkContainerEnv(`${name} ${deploymentName}`, deployment.spec.template.spec, containersOf(deployment)[0]!, manifests);
      assert.equal(env.amqpPrefix, prefix, `${name} ${deploymentName}: REAPER_AMQP_PREFIX is the one infra/rabbitmq/definitions.json was made for`);
      assert.equal(env.deliveryLimit, limit, `${name} ${deploymentName}: REAPER_DELIVERY_LIMIT (a different x-delivery-limit is refused by the broker)`);
    }
  });

  test(`k8s ${name}: selectors, the scheduler Service, PodDisruptionBudgets, service accounts`, () => {
    const scheduler = find(manifests, 'Deployment', SCHEDULER);
    find(manifests, 'Deployment', WORKER);
    const podLabels = new Map(workloads(manifests).map((w) => [w.metadata.name as string, w.spec.template.metadata.labels as Obj]));
    for (const deployment of deployments(manifests)) {
      assert.ok(matches(deployment.spec.selector.matchLabels, podLabels.get(deployment.metadata.name)), `${deployment.metadata.name} selects its pods`);
      for (const [other, labels] of podLabels) {
        if (other !== deployment.metadata.name) assert.ok(!matches(deployment.spec.selector.matchLabels, labels), `${deployment.metadata.name}'s selector does not take ${other}'s pods`);
      }
    }
    const webhook = ofKind(manifests, 'Service').find((service) => matches(service.spec.selector, podLabels.get(SCHEDULER)));
    assert.ok(webhook, 'a Service selects the scheduler pods');
    for (const other of deployments(manifests).filter((d) => d !== scheduler)) {
      assert.ok(!matches(webhook.spec.selector, podLabels.get(other.metadata.name)), `the webhook Service does not route to ${other.metadata.name}`);
    }
    const schedulerPorts = (containersOf(scheduler)[0]!.ports ?? []) as Obj[];
    for (const port of webhook.spec.ports as Obj[]) {
      const target = port.targetPort ?? port.port;
      assert.ok(schedulerPorts.some((p) => p.name === target || p.containerPort === target), `Service targetPort ${target} is a scheduler port`);
    }
    const budgets = ofKind(manifests, 'PodDisruptionBudget');
    for (const budget of budgets) {
      const covered = deployments(manifests).filter((d) => matches(budget.spec.selector.matchLabels, podLabels.get(d.metadata.name)));
      assert.equal(covered.length, 1, `PodDisruptionBudget ${budget.metadata.name} covers exactly one Deployment`);
    }
    for (const deployment of deployments(manifests)) {
      const matching = budgets.filter((b) => matches(b.spec.selector.matchLabels, podLabels.get(deployment.metadata.name)));
      assert.equal(matching.length, 1, `one PodDisruptionBudget covers ${deployment.metadata.name}`);
      if (matching[0]!.spec.minAvailable !== undefined && deployment.spec.replicas !== undefined) {
        assert.ok(matching[0]!.spec.minAvailable < deployment.spec.replicas, `${deployment.metadata.name}: the budget allows a drain`);
      }
    }
    const accounts = new Map(ofKind(manifests, 'ServiceAccount').map((account) => [account.metadata.name as string, account]));
    const used = new Set<string>();
    for (const workload of workloads(manifests)) {
      const podSpec = workload.spec.template.spec;
      const account = accounts.get(podSpec.serviceAccountName);
      assert.ok(account, `${workload.metadata.name}: its ServiceAccount ${podSpec.serviceAccountName} is part of the deployment`);
      assert.ok(!used.has(podSpec.serviceAccountName), `${workload.metadata.name}: a ServiceAccount of its own`);
      used.add(podSpec.serviceAccountName);
      assert.equal(account.automountServiceAccountToken, false, `${account.metadata.name}: no token`);
      assert.equal(podSpec.automountServiceAccountToken, false, `${workload.metadata.name}: no token mounted`);
    }
  });

  test(`k8s ${name}: a restricted Namespace, network policies that deny by default and open only what each workload needs`, () => {
    const namespaces = ofKind(manifests, 'Namespace');
    assert.equal(namespaces.length, 1, 'one Namespace');
    const labels = namespaces[0]!.metadata.labels as Obj;
    assert.equal(labels['pod-security.kubernetes.io/enforce'], 'restricted', 'pod security enforced at restricted');
    if (name !== 'base') {
      for (const manifest of manifests.filter((m) => m.kind !== 'Namespace')) {
        assert.equal(manifest.metadata.namespace, namespaces[0]!.metadata.name, `${manifest.kind}/${manifest.metadata.name} is in the Namespace the overlay creates`);
      }
    }
    const policies = ofKind(manifests, 'NetworkPolicy');
    const denyAll = policies.filter((p) => Object.keys(p.spec.podSelector ?? {}).length === 0 && p.spec.ingress === undefined && p.spec.egress === undefined);
    assert.equal(denyAll.length, 1, 'a default-deny policy selects every pod');
    assert.deepEqual([...denyAll[0]!.spec.policyTypes].sort(), ['Egress', 'Ingress'], 'it denies both directions');

    const allowedEgress: Record<string, Set<number>> = {
      scheduler: new Set([5432, 5671, 5672]),
      worker: new Set([5432, 5671, 5672, 443, 8081]),
      migrate: new Set([5432]),
      // reaper relay: claims outbox rows in PostgreSQL, publishes them to RabbitMQ.
      relay: new Set([5432, 5671, 5672]),
    };
    for (const workload of workloads(manifests)) {
      const component = workload.metadata.labels['app.kubernetes.io/component'] as string;
      const where = `${name} ${workload.metadata.name}`;
      const { ingress, egress } = openedFor(policies.filter((p) => p !== denyAll[0]), workload.spec.template.metadata.labels as Obj);
      assert.ok(allowedEgress[component], `${where}: a component whose egress this test knows (${component})`);
      const egressPorts = new Set<number>();
      for (const { policy, rule } of egress) {
        const ports = ((rule.ports ?? []) as Obj[]).map((p) => p.port as number);
        assert.ok(ports.length > 0, `${where} ${policy}: every egress rule names its ports (no "any port")`);
        if (ports.every((port) => port === 53)) {
          for (const peer of (rule.to ?? []) as Obj[]) assert.ok(isClusterDns(peer), `${where} ${policy}: port 53 only to the cluster DNS or NodeLocal DNSCache (${JSON.stringify(peer)})`);
          assert.ok((rule.to ?? []).length > 0, `${where} ${policy}: port 53 to named resolvers only`);
          continue;
        }
        for (const port of ports) egressPorts.add(port);
        // overlays/prod says where each server is: no egress rule of its leaves the destination open.
        if (isProd(name)) assert.ok(((rule.to ?? []) as Obj[]).length > 0, `${where} ${policy}: prod names the destination of port(s) ${ports.join(', ')}`);
      }
      assert.ok(egress.some(({ rule }) => ((rule.ports ?? []) as Obj[]).some((p) => p.port === 53 && p.protocol === 'UDP')), `${where}: resolves names (UDP 53)`);
      assert.deepEqual([...egressPorts].sort(), [...allowedEgress[component]!].filter((port) => egressPorts.has(port)).sort(), `${where}: egress only to PostgreSQL, RabbitMQ, DNS${component === 'worker' ? ' and the media API' : ''}`);
      assert.ok(egressPorts.has(5432), `${where}: reaches PostgreSQL`);
      if (component !== 'migrate') assert.ok(egressPorts.has(5672) && egressPorts.has(5671), `${where}: reaches RabbitMQ on 5672 and 5671 (TLS)`);
      if (component === 'migrate') {
        assert.equal(ingress.length, 0, `${where}: nothing connects to it (it serves nothing)`);
        continue;
      }
      for (const { policy, rule } of ingress) {
        assert.deepEqual(((rule.ports ?? []) as Obj[]).map((p) => p.port), ['http'], `${where} ${policy}: ingress only on the HTTP port`);
        for (const peer of (rule.from ?? []) as Obj[]) {
          const fromMonitoring = peer.namespaceSelector?.matchLabels?.['kubernetes.io/metadata.name'] === 'monitoring' && peer.podSelector === undefined;
          const webhookSender = component === 'scheduler' && peer.podSelector?.matchLabels?.['reaper.webhook/sender'] === 'true';
          assert.ok(fromMonitoring || webhookSender, `${where}: ingress only from the monitoring namespace${component === 'scheduler' ? ' and webhook senders' : ''} (${JSON.stringify(peer)})`);
        }
      }
      assert.ok(ingress.length >= 1, `${where}: Prometheus may scrape it`);
    }
    // Each destination is a policy of its own, so an overlay narrows it by name (issue 42 item 5).
    for (const policy of ['reaper-egress-dns', 'reaper-egress-postgresql', 'reaper-egress-rabbitmq', 'reaper-egress-media-api']) {
      assert.equal(find(manifests, 'NetworkPolicy', policy).spec.egress.length, 1, `${name} ${policy}: one egress rule, patched by the policy's name`);
    }
    const resolvers = (find(manifests, 'NetworkPolicy', 'reaper-egress-dns').spec.egress[0].to ?? []) as Obj[];
    assert.ok(resolvers.some((peer) => peer.ipBlock?.cidr === '169.254.20.10/32'), `${name}: DNS also to NodeLocal DNSCache (169.254.20.10), which no pod selector matches`);
  });

  test(`k8s ${name}: standard labels; the migrate Job cleans up after itself`, () => {
    const version = name === 'base' ? undefined : find(manifests, 'Deployment', WORKER).metadata.labels['app.kubernetes.io/version'];
    for (const manifest of manifests) {
      const labels = manifest.metadata.labels ?? {};
      const where = `${name} ${manifest.kind}/${manifest.metadata.name}`;
      for (const key of ['app.kubernetes.io/name', 'app.kubernetes.io/part-of', 'app.kubernetes.io/instance', 'app.kubernetes.io/managed-by']) {
        assert.ok(labels[key], `${where}: label ${key}`);
      }
      if (name !== 'base') assert.equal(labels['app.kubernetes.io/version'], version, `${where}: label app.kubernetes.io/version`);
    }
    for (const workload of workloads(manifests)) {
      const labels = workload.spec.template.metadata.labels as Obj;
      assert.ok(labels['app.kubernetes.io/component'], `${workload.metadata.name}: pods carry their component`);
      if (name !== 'base') assert.equal(labels['app.kubernetes.io/version'], version, `${workload.metadata.name}: pods carry the version`);
    }
    const job = find(manifests, 'Job', /^reaper-migrate/);
    assert.ok(Number.isInteger(job.spec.ttlSecondsAfterFinished) && job.spec.ttlSecondsAfterFinished > 0, 'the finished Job is removed (ttlSecondsAfterFinished)');
    if (name !== 'base') {
      assert.equal(job.metadata.name, `${MIGRATE}-${version}`, `${name}: the migrate Job is named per release, so a new release creates a new Job`);
    }
  });
}

for (const [name, manifests] of rendered) {
  test(`k8s ${name}: the Deployments wait for the schema in an init container, as their own role, no longer than the migrate Job may run`, () => {
    const job = find(manifests, 'Job', /^reaper-migrate/);
    for (const deployment of deployments(manifests)) {
      const deploymentName = deployment.metadata.name as string;
      const podSpec = deployment.spec.template.spec;
      const where = `${name} ${deploymentName}`;
      const inits = (podSpec.initContainers ?? []) as Obj[];
      assert.deepEqual(inits.map((c) => c.name), ['wait-for-schema'], `${where}: one init container, wait-for-schema`);
      const wait = inits[0]!;
      const main = containersOf(deployment)[0]!;
      assert.equal(wait.image, main.image, `${where}: the same image (the same migrations: the version it waits for is the one the service needs)`);
      assert.deepEqual(wait.args.slice(0, 2), ['schema', 'wait'], `${where}: runs \`reaper schema wait\``);
      const timeout = Number(wait.args[wait.args.indexOf('--timeout') + 1]);
      assert.ok(timeout >= job.spec.activeDeadlineSeconds, `${where}: waits (--timeout ${timeout}) at least as long as the Job may run (${job.spec.activeDeadlineSeconds} s)`);
      const { raw: waitEnv, secretKeys } = checkContainerEnv(`${where} init`, podSpec, wait, manifests);
      const { raw: mainEnv } = checkContainerEnv(where, podSpec, main, manifests);
      assert.equal(waitEnv.get('DATABASE_URL_FILE'), mainEnv.get('DATABASE_URL_FILE'), `${where}: with the service's own database credentials`);
      assert.ok(!waitEnv.has('AMQP_URL_FILE'), `${where}: the wait needs no broker credentials`);
      assert.ok(secretKeys.length > 0);
    }
  });
}

test('k8s overlays: images, replicas; prod pins its tag, matches the version label, and scales workers on queue depth with KEDA', () => {
  for (const name of OVERLAYS) {
    const manifests = rendered.get(name)!;
    const release = containersOf(find(manifests, 'Deployment', WORKER))[0]!.image as string;
    for (const workload of workloads(manifests)) {
      const spec = workload.spec.template.spec;
      for (const container of [...((spec.initContainers ?? []) as Obj[]), ...containersOf(workload)]) {
        assert.notEqual(container.image, 'reaper', `${name} ${workload.metadata.name} ${container.name}: the overlay sets the image`);
        assert.equal(container.image, release, `${name} ${workload.metadata.name} ${container.name}: one release everywhere (the workers' image)`);
      }
    }
  }
  const prod = rendered.get('prod')!;
  const worker = find(prod, 'Deployment', WORKER);
  const image = containersOf(worker)[0]!.image as string;
  const tag = image.slice(image.lastIndexOf(':') + 1);
  assert.ok(!['latest', 'dev', ''].includes(tag) && image.includes(':'), `prod pins a release tag (${image})`);
  assert.equal(worker.metadata.labels['app.kubernetes.io/version'], tag, 'prod: the version label is the image tag');
  assert.equal(ofKind(prod, 'HorizontalPodAutoscaler').length, 0, 'prod: no CPU HorizontalPodAutoscaler (KEDA creates its own)');
  assert.equal(worker.spec.replicas, undefined, 'prod removes the worker replicas field (the autoscaler owns it)');
  assert.ok(find(prod, 'Deployment', SCHEDULER).spec.replicas >= 2, 'prod runs two schedulers');

  const scaled = find(prod, 'ScaledObject', WORKER);
  const target = scaled.spec.scaleTargetRef;
  assert.equal(target.kind ?? 'Deployment', 'Deployment');
  find(prod, 'Deployment', target.name);
  const { env } = checkContainerEnv('prod worker', worker.spec.template.spec, containersOf(worker)[0]!, prod);
  const names = brokerNames(env.amqpPrefix);
  const policyNames = [...demoPolicies.keys()];
  const triggers = scaled.spec.triggers as Obj[];
  assert.deepEqual(
    triggers.map((t) => t.metadata.queueName).sort(),
    policyNames.map((policy) => names.workQueue(policy)).sort(),
    'one rabbitmq trigger per work queue of the deployed policies',
  );
  assert.deepEqual(kedaTriggers(env, policyNames, { queueLengthPerWorker: 20, authenticationRef: 'reaper-rabbitmq' }), triggers);
  for (const trigger of triggers) {
    assert.equal(trigger.type, 'rabbitmq');
    assert.equal(trigger.metadata.mode, 'QueueLength', 'scales on ready messages');
    assert.equal(trigger.metadata.host, undefined, 'no credentials in the manifest');
    const auth = find(prod, 'TriggerAuthentication', trigger.authenticationRef.name);
    const host = (auth.spec.secretTargetRef as Obj[]).find((ref) => ref.parameter === 'host');
    assert.ok(host && host.name === 'reaper-secrets', 'the AMQP URL comes from reaper-secrets');
  }
  assert.ok(scaled.spec.minReplicaCount >= 2 && scaled.spec.maxReplicaCount >= scaled.spec.minReplicaCount, 'bounds');
});

/**
 * The PostgreSQL connection budget in the comment of worker-autoscaling.yaml, one `<op> <count>
 * <what>` line each: its lines add up, and the ones that count reaper's own pods count what prod
 * renders (the relays: what prod+events-relay renders), so a replica or pool size changed without
 * the budget fails here.
 */
test('k8s prod: the connection budget in worker-autoscaling.yaml adds up and counts the schedulers, the relays and the workers prod renders', () => {
  const text = readFileSync(path.join(K8S, 'overlays', 'prod', 'worker-autoscaling.yaml'), 'utf8');
  const lines = [...text.matchAll(/^#\s+([-=])?\s*(\d+)\s{2}(\S.*)$/gm)].map(([, op, count, what]) => ({ op, count: Number(count), what: what! }));
  const [total, ...rest] = lines;
  assert.ok(total && total.op === undefined && total.what === 'max_connections', `the budget starts from max_connections: ${JSON.stringify(lines)}`);
  const spent = rest.filter((line) => line.op === '-');
  const forWorkers = rest.find((line) => line.op === '=');
  assert.ok(forWorkers, 'the budget ends with `=  <n>  for workers`');
  assert.equal(total.count - spent.reduce((sum, line) => sum + line.count, 0), forWorkers.count, 'max_connections minus every line above is what is left for workers');
  /** The `<n>  <what>: <replicas> replicas x <pool>` line of `what`, checked against the rendered replicas and pool size. */
  const podsLine = (what: RegExp, replicas: number, poolSize: number) => {
    const line = spent.find((candidate) => what.test(candidate.what));
    assert.ok(line, `the budget has a line for ${what}`);
    const stated = /: (\d+) replicas x (\d+)\b/.exec(line.what);
    assert.ok(stated, `${line.what}: says "<replicas> replicas x <pool>"`);
    assert.deepEqual([Number(stated[1]), Number(stated[2])], [replicas, poolSize], `${line.what}: the rendered replicas x pool size`);
    assert.equal(line.count, replicas * poolSize, `${line.what}: ${replicas} x ${poolSize}`);
  };
  const prod = rendered.get('prod')!;
  const poolSizeOf = (deployment: Obj) => checkContainerEnv(`prod ${deployment.metadata.name}`, deployment.spec.template.spec, containersOf(deployment)[0]!, prod).env.dbPoolSize;
  const scheduler = find(prod, 'Deployment', SCHEDULER);
  podsLine(/^schedulers/, scheduler.spec.replicas, poolSizeOf(scheduler));
  podsLine(/^relays, once components\/events-relay is included/, find(rendered.get('prod+events-relay')!, 'Deployment', RELAY).spec.replicas, RELAY_DB_POOL_SIZE);
  const workerPool = poolSizeOf(find(prod, 'Deployment', WORKER));
  const scaled = find(prod, 'ScaledObject', WORKER);
  assert.ok(
    scaled.spec.maxReplicaCount * workerPool <= forWorkers.count,
    `maxReplicaCount x REAPER_DB_POOL_SIZE (${scaled.spec.maxReplicaCount} x ${workerPool}) stays within the ${forWorkers.count} connections budgeted for workers`,
  );
  assert.match(forWorkers.what, new RegExp(`= ${scaled.spec.maxReplicaCount} workers at most`), 'the budget names maxReplicaCount');
});

test('k8s: a missing kubectl fails with the install hint', () => {
  const saved = process.env.PATH;
  process.env.PATH = tmp;
  try {
    assert.throws(() => kustomize(path.join(K8S, 'base')), /kubectl is not installed.*apt-get install kubectl/);
  } finally {
    process.env.PATH = saved;
  }
});

// ------------------------------------------------------------------------------------------------
// Issue 20 item 7: the smaller production gaps
// ------------------------------------------------------------------------------------------------

for (const [name, manifests] of rendered) {
  test(`k8s ${name}: no service links, replicas spread across nodes and zones, amqps allowed beside amqp`, () => {
    for (const workload of workloads(manifests)) {
      assert.equal(workload.spec.template.spec.enableServiceLinks, false, `${name} ${workload.metadata.name}: enableServiceLinks: false`);
    }
    for (const deployment of deployments(manifests)) {
      const deploymentName = deployment.metadata.name as string;
      const spread = (deployment.spec.template.spec.topologySpreadConstraints ?? []) as Obj[];
      const podLabels = deployment.spec.template.metadata.labels as Obj;
      assert.deepEqual(spread.map((c) => c.topologyKey).sort(), ['kubernetes.io/hostname', 'topology.kubernetes.io/zone'], `${name} ${deploymentName}: spread over hosts and zones`);
      for (const constraint of spread) {
        assert.equal(constraint.whenUnsatisfiable, 'ScheduleAnyway', `${name} ${deploymentName}: a single-zone cluster still schedules`);
        assert.ok(selects(constraint.labelSelector, podLabels), `${name} ${deploymentName}: spreads its own pods (${constraint.topologyKey})`);
        for (const other of deployments(manifests).filter((d) => d !== deployment)) {
          assert.ok(!selects(constraint.labelSelector, other.spec.template.metadata.labels), `${name} ${deploymentName}: does not count ${other.metadata.name}'s pods (${constraint.topologyKey})`);
        }
      }
      const ports = openedFor(ofKind(manifests, 'NetworkPolicy'), podLabels).egress.flatMap(({ rule }) => ((rule.ports ?? []) as Obj[]).map((port) => port.port));
      assert.ok(ports.includes(5672) && ports.includes(5671), `${name} ${deploymentName}: egress to RabbitMQ on 5672 and 5671 (TLS)`);
    }
  });
}

test('k8s prod: KEDA falls back to a fixed worker count when it cannot read the queues; cooldownPeriod described truly', () => {
  const scaled = find(rendered.get('prod')!, 'ScaledObject', WORKER);
  assert.ok(scaled.spec.fallback?.failureThreshold >= 1, 'fallback.failureThreshold');
  assert.ok(scaled.spec.fallback.replicas >= scaled.spec.minReplicaCount && scaled.spec.fallback.replicas <= scaled.spec.maxReplicaCount, 'fallback.replicas within min..max');
  const text = readFileSync(path.join(K8S, 'overlays', 'prod', 'worker-autoscaling.yaml'), 'utf8');
  assert.match(text, /cooldownPeriod only delays scaling from minReplicaCount to 0/, 'the comment says what cooldownPeriod does (not the scale-down pace)');
});

test('k8s monitoring: the PodMonitor and PrometheusRule carry the label kube-prometheus-stack selects', () => {
  for (const file of ['podmonitor.yaml', 'prometheusrule.yaml']) {
    const manifest = parseYaml(readFileSync(path.join(K8S, 'components', 'monitoring', file), 'utf8')) as Obj;
    assert.equal(manifest.metadata.labels.release, 'kube-prometheus-stack', file);
  }
});

test('k8s prod ships no policies (the demo ones are a dev-only component); dev runs the demo policies', () => {
  const prod = kustomize(path.join(K8S, 'overlays', 'prod'));
  const placeholder = find(prod, 'ConfigMap', /^reaper-policies-/).data['policies.yaml'] as string;
  assert.deepEqual(parseYaml(placeholder), { policies: [] }, 'prod\'s reaper-policies is empty until the operator\'s overlay replaces it');
  assert.throws(() => parsePoliciesWithPlaceholders(placeholder, 'prod policies', {}), /policies/, 'and reaper refuses to start on it');
  for (const configMap of ofKind(prod, 'ConfigMap')) {
    for (const value of Object.values((configMap.data ?? {}) as Record<string, string>)) assert.ok(!/seat-holds|seat_reservations/.test(value), `${configMap.metadata.name}: no demo policy`);
  }
  const dev = find(rendered.get('dev')!, 'ConfigMap', /^reaper-policies-/);
  assert.match(dev.data['policies.yaml'], /name: seat-holds/, 'dev mounts the demo policies');
});

test('k8s object-store egress: the optional component opens 443 for workers only, in their namespace, and narrows by name', () => {
  const narrowed = `  - patch: |-
      apiVersion: networking.k8s.io/v1
      kind: NetworkPolicy
      metadata:
        name: reaper-egress-object-store
        namespace: reaper
      spec:
        egress:
          - to:
              - namespaceSelector:
                  matchLabels:
                    kubernetes.io/metadata.name: storage
            ports:
              - { protocol: TCP, port: 9000 }
`;
  const body = 'resources: [k8s/overlays/prod]\ncomponents: [k8s/components/object-store-egress]\n';
  const shipped = kustomize(scratchOverlay('object-store', body));
  const policy = find(shipped, 'NetworkPolicy', 'reaper-egress-object-store');
  assert.equal(policy.metadata.namespace, 'reaper', 'in the namespace of the pods it opens traffic for');
  assert.deepEqual(policy.spec.egress, [{ ports: [{ protocol: 'TCP', port: 443 }] }]);
  for (const workload of workloads(shipped)) {
    const opens = selects(policy.spec.podSelector, workload.spec.template.metadata.labels);
    assert.equal(opens, workload.metadata.name === WORKER, `${workload.metadata.name}: ${opens ? 'selected' : 'not selected'}`);
  }
  assert.ok(!ofKind(rendered.get('prod')!, 'NetworkPolicy').some((p) => p.metadata.name === 'reaper-egress-object-store'), 'off unless included');

  const mine = kustomize(scratchOverlay('object-store-narrowed', `${body}patches:\n${narrowed}`));
  assert.deepEqual(find(mine, 'NetworkPolicy', 'reaper-egress-object-store').spec.egress, [
    { to: [{ namespaceSelector: { matchLabels: { 'kubernetes.io/metadata.name': 'storage' } } }], ports: [{ protocol: 'TCP', port: 9000 }] },
  ]);
  // A patch by name fails loudly when the name is gone (an index patch would change another rule).
  assert.throws(() => kustomize(scratchOverlay('object-store-missing', `resources: [k8s/overlays/prod]\npatches:\n${narrowed}`)), /reaper-egress-object-store/);
});

test('k8s events relay: off unless included; components/events-relay adds a Deployment that runs `reaper relay` as the scheduler', () => {
  for (const name of ['base', 'dev', 'prod']) {
    assert.ok(!rendered.get(name)!.some((m) => m.metadata?.name === RELAY), `${name}: no relay unless the component is included`);
  }
  assert.deepEqual(WITH_RELAY, ['dev+events-relay', 'prod+events-relay'], 'the relay is rendered next to both overlays (and every rule above ran on it)');
  for (const name of WITH_RELAY) {
    const manifests = rendered.get(name)!;
    const where = `${name} ${RELAY}`;
    const relay = find(manifests, 'Deployment', RELAY);
    const scheduler = find(manifests, 'Deployment', SCHEDULER);
    const container = containersOf(relay)[0]!;
    assert.deepEqual(containersOf(relay).map((c) => c.args), [['relay']], `${where}: runs \`reaper relay\``);
    assert.equal(container.command, undefined, `${where}: the image's ENTRYPOINT (bin/reaper) runs`);
    for (const labels of [relay.metadata.labels, relay.spec.selector.matchLabels, relay.spec.template.metadata.labels]) {
      assert.equal(labels['app.kubernetes.io/component'], 'relay', `${where}: component relay`);
    }
    assert.equal(container.image, containersOf(scheduler)[0]!.image, `${where}: the scheduler's image (the release that writes the outbox it reads)`);
    // docs/deploying.md "PostgreSQL roles": the relay runs as reaper_scheduler (and the scheduler's broker user).
    const fileOf = (deployment: Obj, variable: string) => ((containersOf(deployment)[0]!.env ?? []) as Obj[]).find((e) => e.name === variable)?.value as string | undefined;
    for (const variable of ['DATABASE_URL_FILE', 'AMQP_URL_FILE']) {
      assert.ok(fileOf(relay, variable), `${where}: ${variable}`);
      assert.equal(fileOf(relay, variable), fileOf(scheduler, variable), `${where}: ${variable} is the scheduler's`);
    }
    const wait = (relay.spec.template.spec.initContainers as Obj[])[0]!;
    assert.equal(((wait.env ?? []) as Obj[]).find((e) => e.name === 'DATABASE_URL_FILE')?.value, fileOf(scheduler, 'DATABASE_URL_FILE'), `${where}: waits for the schema as the scheduler's role`);
    // Claims with a lease and SKIP LOCKED (shared/db/queries/outbox.ts): replicas share the outbox.
    assert.equal(relay.spec.replicas, 2, `${where}: two relays, for availability`);
    find(manifests, 'PodDisruptionBudget', RELAY);
    find(manifests, 'ServiceAccount', RELAY);
    // Prometheus scrapes it: its own ingress policy (the network policy test above checks what it opens).
    find(manifests, 'NetworkPolicy', RELAY);
  }
  const text = readFileSync(path.join(K8S, 'components', 'events-relay', 'relay.yaml'), 'utf8');
  assert.match(text, /Two replicas are safe[\s\S]*SKIP LOCKED[\s\S]*claim_expires_at/, 'relay.yaml says why two replicas are safe');
});

test('k8s events relay: in the components of an overlay built on the base, it takes that overlay\'s image, labels and namespace', () => {
  const body = [
    'resources: [k8s/base]',
    `components: [k8s/components/demo-policies, ${EVENTS_RELAY}]`,
    'namespace: acme-reaper',
    'labels:',
    '  - pairs: {app.kubernetes.io/version: "9.9.9", acme.test/team: retention}',
    '    includeTemplates: true',
    'images:',
    '  - {name: reaper, newName: registry.acme.test/reaper, newTag: "9.9.9"}',
    '',
  ].join('\n');
  const manifests = kustomize(scratchOverlay('relay-inside', body));
  const relay = find(manifests, 'Deployment', RELAY);
  const spec = relay.spec.template.spec;
  for (const container of [...(spec.initContainers as Obj[]), ...(spec.containers as Obj[])]) {
    assert.equal(container.image, 'registry.acme.test/reaper:9.9.9', `${container.name}: the overlay's image`);
  }
  for (const object of [relay, ...['ServiceAccount', 'PodDisruptionBudget', 'NetworkPolicy'].map((kind) => find(manifests, kind, RELAY))]) {
    const where = `${object.kind}/${RELAY}`;
    assert.equal(object.metadata.namespace, 'acme-reaper', `${where}: the overlay's namespace`);
    for (const labels of [object.metadata.labels, ...(object.kind === 'Deployment' ? [object.spec.template.metadata.labels] : [])]) {
      assert.equal(labels['app.kubernetes.io/version'], '9.9.9', `${where}: the overlay's version`);
      assert.equal(labels['acme.test/team'], 'retention', `${where}: the overlay's own labels`);
      assert.equal(labels['app.kubernetes.io/component'], 'relay', `${where}: its own component`);
    }
  }
});

test('the scheduler, the worker and the relay serve /livez, /readyz and /metrics on HTTP_PORT (what their probes and scrapes rest on)', () => {
  const source = (file: string) => readFileSync(path.join(ROOT, 'services', file), 'utf8');
  // test/integration/relay-http.test.ts asks the running relay; this keeps the three alike.
  for (const file of ['scheduler/scheduler.ts', 'worker/worker.ts', 'relay/relay.ts']) {
    assert.match(source(file), /startHealthServer\(\{\s*port: env\.httpPort,/, `${file} serves /livez, /readyz and /metrics on HTTP_PORT`);
    assert.match(source(file), /httpPort: server\?\.boundPort/, `${file} reports the port it listens on (\`<service> started\`)`);
  }
});

test('k8s prod: the KEDA triggers it ships are generated from the policies.yaml it ships (none), never the demo queues', () => {
  const prodDir = path.join(K8S, 'overlays', 'prod');
  const shippedNames = ((parseYaml(readFileSync(path.join(prodDir, 'policies.yaml'), 'utf8')) as Obj).policies as Obj[]).map((p) => p.name as string);
  const reaperEnv = find(kustomize(prodDir), 'ConfigMap', /^reaper-env-/).data as Record<string, string>;
  assert.deepEqual(
    parseYaml(readFileSync(path.join(prodDir, 'keda-triggers.yaml'), 'utf8')),
    kedaTriggersPatch({ amqpPrefix: reaperEnv.REAPER_AMQP_PREFIX! }, shippedNames),
    'overlays/prod/keda-triggers.yaml is the triggers patch of overlays/prod/policies.yaml: regenerate it with `reaper topology --keda-triggers`',
  );
  const scaled = find(kustomize(prodDir), 'ScaledObject', WORKER);
  assert.deepEqual(scaled.spec.triggers, [], 'as shipped: no trigger, in particular none for a demo queue');
});

test('reaper topology --keda-triggers: a patch for any prefix and policy set; --json the triggers alone', () => {
  const dir = mkdtempSync(path.join(tmp, 'keda-'));
  const policies = path.join(dir, 'policies.yaml');
  copyFileSync(path.join(K8S, 'components', 'demo-policies', 'policies.yaml'), policies);
  // The demo policies read ${REAPER_MEDIA_API_URL} and ${file:/run/secrets/...}: neither exists here.
  const patch = parseYaml(reaperCli(['topology', '--keda-triggers'], { REAPER_POLICIES: policies, REAPER_AMQP_PREFIX: 'acme-prod' })) as Obj;
  assert.equal(patch.kind, 'ScaledObject');
  assert.equal(patch.metadata.name, WORKER);
  assert.deepEqual(patch.spec.triggers.map((t: Obj) => t.metadata.queueName), ['acme-prod.cleanup.seat-holds', 'acme-prod.cleanup.media-assets']);
  const triggers = JSON.parse(reaperCli(['topology', '--keda-triggers', '--json'], { REAPER_POLICIES: policies, REAPER_AMQP_PREFIX: 'acme-prod' })) as Obj[];
  assert.deepEqual(triggers, patch.spec.triggers);
});
