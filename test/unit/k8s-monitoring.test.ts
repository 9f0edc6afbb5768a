import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import { parse as parseYaml, parseAllDocuments } from 'yaml';

/**
 * Issue 8, Kubernetes monitoring: a kustomize component (PodMonitor + PrometheusRule), off by
 * default, rendered offline with the installed `kubectl kustomize` (no cluster needed).
 */
const ROOT = path.resolve(__dirname, '..', '..', '..');
const INFRA = path.join(ROOT, 'infra');
const COMPONENT = path.join(INFRA, 'k8s', 'components', 'monitoring');

type Manifest = { apiVersion: string; kind: string; metadata: { name: string; namespace?: string }; spec: Record<string, unknown> };

function kustomize(dir: string): Manifest[] {
  const output = execFileSync('kubectl', ['kustomize', dir], { encoding: 'utf8' });
  return parseAllDocuments(output).map((document) => document.toJS() as Manifest);
}

/** An overlay that turns the component on, as the README says, built from a scratch folder. */
function renderWithMonitoring(overlay: string): Manifest[] {
  const scratch = mkdtempSync(path.join(tmpdir(), 'reaper-k8s-monitoring-'));
  try {
    // kustomize refuses absolute paths: a link to infra/ makes the relative ones resolve.
    symlinkSync(INFRA, path.join(scratch, 'infra'));
    mkdirSync(path.join(scratch, 'on'));
    writeFileSync(
      path.join(scratch, 'on', 'kustomization.yaml'),
      `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: reaper
resources: [../infra/k8s/overlays/${overlay}]
components: [../infra/k8s/components/monitoring]
`,
    );
    return kustomize(path.join(scratch, 'on'));
  } finally {
    rmSync(scratch, { recursive: true, force: true });
  }
}

test('k8s monitoring: off by default (no overlay renders a PodMonitor or PrometheusRule)', () => {
  for (const overlay of ['dev', 'prod']) {
    const kinds = kustomize(path.join(INFRA, 'k8s', 'overlays', overlay)).map((manifest) => manifest.kind);
    assert.ok(kinds.includes('Deployment'), `${overlay} renders`);
    assert.ok(!kinds.includes('PodMonitor') && !kinds.includes('PrometheusRule'), `${overlay}: monitoring is opt-in`);
  }
});

test('k8s monitoring: the component adds a PodMonitor selecting both Deployments on their http port', () => {
  const manifests = renderWithMonitoring('prod');
  const monitors = manifests.filter((manifest) => manifest.kind === 'PodMonitor');
  assert.equal(monitors.length, 1);
  const monitor = monitors[0]!;
  assert.equal(monitor.apiVersion, 'monitoring.coreos.com/v1');
  assert.equal(monitor.metadata.namespace, 'reaper');
  const endpoints = monitor.spec.podMetricsEndpoints as Array<{ port: string; path: string }>;
  assert.deepEqual(endpoints.map((endpoint) => [endpoint.port, endpoint.path]), [['http', '/metrics']]);

  // The selector matches the pod template labels of the scheduler and the worker, and each names a port "http".
  const selector = monitor.spec.selector as { matchExpressions: Array<{ key: string; operator: string; values: string[] }> };
  const deployments = manifests.filter((manifest) => manifest.kind === 'Deployment');
  assert.equal(deployments.length, 2);
  for (const deployment of deployments) {
    const template = (deployment.spec.template as { metadata: { labels: Record<string, string> }; spec: { containers: Array<{ ports?: Array<{ name: string }> }> } });
    for (const expression of selector.matchExpressions) {
      assert.equal(expression.operator, 'In');
      assert.ok(expression.values.includes(template.metadata.labels[expression.key]!), `${deployment.metadata.name} matches ${expression.key}`);
    }
    assert.ok(template.spec.containers.some((container) => container.ports?.some((port) => port.name === 'http')), `${deployment.metadata.name} has port http`);
  }
});

test('k8s monitoring: the PrometheusRule carries exactly the groups of infra/prometheus/reaper-rules.yaml', () => {
  const rules = parseYaml(readFileSync(path.join(INFRA, 'prometheus', 'reaper-rules.yaml'), 'utf8')) as { groups: unknown };
  const wrapped = renderWithMonitoring('dev').filter((manifest) => manifest.kind === 'PrometheusRule');
  assert.equal(wrapped.length, 1);
  assert.equal(wrapped[0]!.apiVersion, 'monitoring.coreos.com/v1');
  assert.deepEqual(wrapped[0]!.spec.groups, rules.groups, `edit both, or copy the rules' groups into ${path.relative(ROOT, COMPONENT)}/prometheusrule.yaml`);
});
