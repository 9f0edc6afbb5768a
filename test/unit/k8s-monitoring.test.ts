import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import { parse as parseYaml, parseAllDocuments } from 'yaml';

/**
 * Issue 8, Kubernetes monitoring: a kustomize component (PodMonitor, PrometheusRule, Grafana
 * dashboard), off by default, rendered offline with the installed `kubectl kustomize` (no cluster
 * needed) exactly as an operator's own overlay includes it (issue 42 item 5: no `namespace:` added
 * by the test, which hid that the component had none).
 */
const ROOT = path.resolve(__dirname, '..', '..', '..');
const INFRA = path.join(ROOT, 'infra');
const COMPONENT = path.join(INFRA, 'k8s', 'components', 'monitoring');
const OPERATING = path.join(ROOT, 'docs', 'operating.md');
/** The default runbook base, as infra/k8s/base/kustomization.yaml and the rules file state it. */
const RUNBOOK_BASE = 'https://git.example.com/platform/reaper/blob/main/docs/operating.md';

type Manifest = { apiVersion: string; kind: string; metadata: { name: string; namespace?: string; labels?: Record<string, string> }; spec: Record<string, unknown>; data?: Record<string, string> };
type RuleGroups = Array<{ name: string; rules: Array<{ alert?: string; annotations?: Record<string, string> }> }>;

function kustomize(dir: string): Manifest[] {
  const output = execFileSync('kubectl', ['kustomize', dir], { encoding: 'utf8' });
  return parseAllDocuments(output).map((document) => document.toJS() as Manifest);
}

/**
 * The overlay docs/deploying.md and the component's header tell an operator to write: the shipped
 * overlay as a resource, the component beside it, nothing else unless `extra` adds it.
 */
function renderWithMonitoring(overlay: string, extra = '', components: readonly string[] = []): Manifest[] {
  const scratch = mkdtempSync(path.join(tmpdir(), 'reaper-k8s-monitoring-'));
  try {
    // kustomize refuses absolute paths: a link to infra/ makes the relative ones resolve.
    symlinkSync(INFRA, path.join(scratch, 'infra'));
    mkdirSync(path.join(scratch, 'mine'));
    writeFileSync(
      path.join(scratch, 'mine', 'kustomization.yaml'),
      `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../infra/k8s/overlays/${overlay}]
components: [${['monitoring', ...components].map((component) => `../infra/k8s/components/${component}`).join(', ')}]
${extra}`,
    );
    return kustomize(path.join(scratch, 'mine'));
  } finally {
    rmSync(scratch, { recursive: true, force: true });
  }
}

function runbookUrls(groups: RuleGroups): Array<{ alert: string; url: string }> {
  return groups.flatMap((group) => group.rules.filter((rule) => rule.alert).map((rule) => ({ alert: rule.alert!, url: rule.annotations?.runbook_url ?? '' })));
}

/** GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens. */
function anchorOf(heading: string): string {
  return heading.trim().toLowerCase().replace(/[^\p{L}\p{N} _-]/gu, '').replace(/ /g, '-');
}

test('k8s monitoring: off by default (no overlay renders a PodMonitor, PrometheusRule or dashboard)', () => {
  for (const overlay of ['dev', 'prod']) {
    const manifests = kustomize(path.join(INFRA, 'k8s', 'overlays', overlay));
    const kinds = manifests.map((manifest) => manifest.kind);
    assert.ok(kinds.includes('Deployment'), `${overlay} renders`);
    assert.ok(!kinds.includes('PodMonitor') && !kinds.includes('PrometheusRule'), `${overlay}: monitoring is opt-in`);
    assert.ok(!manifests.some((manifest) => manifest.metadata.name === 'reaper-runbooks'), `${overlay}: the runbook base is local-config, never deployed`);
  }
});

for (const [overlay, namespace] of [['prod', 'reaper'], ['dev', 'reaper-dev']] as const) {
  test(`k8s monitoring on ${overlay}: PodMonitor, PrometheusRule and dashboard in the pods' namespace ${namespace}`, () => {
    const manifests = renderWithMonitoring(overlay);
    const deployments = manifests.filter((manifest) => manifest.kind === 'Deployment');
    assert.equal(deployments.length, 2);
    for (const deployment of deployments) assert.equal(deployment.metadata.namespace, namespace, `${deployment.metadata.name} runs in ${namespace}`);
    for (const [kind, name] of [['PodMonitor', 'reaper'], ['PrometheusRule', 'reaper'], ['ConfigMap', 'reaper-grafana-dashboard']]) {
      const found = manifests.filter((manifest) => manifest.kind === kind && manifest.metadata.name === name);
      assert.equal(found.length, 1, `${kind}/${name} rendered once`);
      // A PodMonitor watches pods of its own namespace only: anywhere else it scrapes nothing.
      assert.equal(found[0]!.metadata.namespace, namespace, `${kind}/${name} is in ${namespace}, with the pods`);
    }
  });
}

test('k8s monitoring: an overlay that sets its own namespace moves the monitoring objects with the pods', () => {
  const manifests = renderWithMonitoring('dev', 'namespace: team-cleanup\n');
  for (const manifest of manifests.filter((m) => ['PodMonitor', 'PrometheusRule', 'Deployment'].includes(m.kind))) {
    assert.equal(manifest.metadata.namespace, 'team-cleanup', `${manifest.kind}/${manifest.metadata.name}`);
  }
});

for (const [components, expected] of [[[], ['reaper-scheduler', 'reaper-worker']], [['events-relay'], ['reaper-relay', 'reaper-scheduler', 'reaper-worker']]] as const) {
  test(`k8s monitoring${components.length ? ` with ${components.join(', ')}` : ''}: the component adds a PodMonitor selecting every Deployment (${expected.join(', ')}) on its http port`, () => {
    checkPodMonitor(renderWithMonitoring('prod', '', components), expected);
  });
}

function checkPodMonitor(manifests: Manifest[], expected: readonly string[]): void {
  const monitors = manifests.filter((manifest) => manifest.kind === 'PodMonitor');
  assert.equal(monitors.length, 1);
  const monitor = monitors[0]!;
  assert.equal(monitor.apiVersion, 'monitoring.coreos.com/v1');
  const endpoints = monitor.spec.podMetricsEndpoints as Array<{ port: string; path: string }>;
  assert.deepEqual(endpoints.map((endpoint) => [endpoint.port, endpoint.path]), [['http', '/metrics']]);

  // The selector matches the pod template labels of every Deployment, and each names a port "http".
  const selector = monitor.spec.selector as { matchExpressions: Array<{ key: string; operator: string; values: string[] }> };
  const deployments = manifests.filter((manifest) => manifest.kind === 'Deployment');
  assert.deepEqual(deployments.map((deployment) => deployment.metadata.name).sort(), expected);
  for (const deployment of deployments) {
    const template = (deployment.spec.template as { metadata: { labels: Record<string, string> }; spec: { containers: Array<{ ports?: Array<{ name: string }> }> } });
    for (const expression of selector.matchExpressions) {
      assert.equal(expression.operator, 'In');
      assert.ok(expression.values.includes(template.metadata.labels[expression.key]!), `${deployment.metadata.name} matches ${expression.key}`);
    }
    assert.ok(template.spec.containers.some((container) => container.ports?.some((port) => port.name === 'http')), `${deployment.metadata.name} has port http`);
  }
}

test('k8s monitoring: the PrometheusRule carries exactly the groups of infra/prometheus/reaper-rules.yaml', () => {
  const rules = parseYaml(readFileSync(path.join(INFRA, 'prometheus', 'reaper-rules.yaml'), 'utf8')) as { groups: unknown };
  const wrapped = renderWithMonitoring('dev').filter((manifest) => manifest.kind === 'PrometheusRule');
  assert.equal(wrapped.length, 1);
  assert.equal(wrapped[0]!.apiVersion, 'monitoring.coreos.com/v1');
  assert.deepEqual(wrapped[0]!.spec.groups, rules.groups, `edit both, or copy the rules' groups into ${path.relative(ROOT, COMPONENT)}/prometheusrule.yaml`);
});

test('alert rules: every runbook_url is absolute, <base>#<alert>, and names a section of docs/operating.md', () => {
  const rules = parseYaml(readFileSync(path.join(INFRA, 'prometheus', 'reaper-rules.yaml'), 'utf8')) as { groups: RuleGroups };
  const headings = new Set([...readFileSync(OPERATING, 'utf8').matchAll(/^#{1,6} (.+)$/gm)].map((match) => anchorOf(match[1]!)));
  const links = runbookUrls(rules.groups);
  assert.ok(links.length >= 13, `every alert (${links.length})`);
  for (const { alert, url } of links) {
    assert.equal(url, `${RUNBOOK_BASE}#${alert.toLowerCase()}`, `${alert}: runbook_url`);
    assert.ok(headings.has(alert.toLowerCase()), `${alert}: docs/operating.md has a section "${alert}" for its runbook_url`);
  }
  // The base the Kubernetes component substitutes is the same one.
  const base = readFileSync(path.join(INFRA, 'k8s', 'base', 'kustomization.yaml'), 'utf8');
  assert.ok(base.includes(`- base-url=${RUNBOOK_BASE}\n`), 'infra/k8s/base/kustomization.yaml: reaper-runbooks base-url is the rules file\'s base');
});

test('k8s monitoring: one literal in your overlay moves every runbook_url to your own runbook page', () => {
  const mine = 'https://wiki.example.org/reaper/operating';
  const manifests = renderWithMonitoring('prod', `configMapGenerator:\n  - name: reaper-runbooks\n    behavior: merge\n    literals: [base-url=${mine}]\n`);
  const rule = manifests.find((manifest) => manifest.kind === 'PrometheusRule')!;
  const links = runbookUrls(rule.spec.groups as RuleGroups);
  assert.ok(links.length >= 13);
  for (const { alert, url } of links) assert.equal(url, `${mine}#${alert.toLowerCase()}`, alert);
  assert.ok(!manifests.some((manifest) => manifest.metadata.name === 'reaper-runbooks'), 'and the setting itself is not deployed');
});

test('k8s monitoring: the Grafana dashboard as a ConfigMap the dashboard sidecar loads', () => {
  const manifests = renderWithMonitoring('prod');
  const dashboard = manifests.find((manifest) => manifest.kind === 'ConfigMap' && manifest.metadata.name === 'reaper-grafana-dashboard');
  assert.ok(dashboard, 'ConfigMap reaper-grafana-dashboard (no hash suffix: one dashboard, replaced in place)');
  assert.equal(dashboard.metadata.labels?.grafana_dashboard, '1', 'the label kube-prometheus-stack\'s sidecar selects');
  const file = readFileSync(path.join(INFRA, 'grafana', 'reaper-dashboard.json'), 'utf8');
  assert.deepEqual(Object.keys(dashboard.data ?? {}), ['reaper-dashboard.json']);
  assert.equal(dashboard.data!['reaper-dashboard.json'], file, 'the same file as infra/grafana/reaper-dashboard.json');
  assert.equal((JSON.parse(file) as { uid: string }).uid, 'reaper-backlog');
});
