import assert from 'node:assert/strict';
import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { parse as parseYaml } from 'yaml';
import { eventually } from '../support/eventually';
import { combinedPoliciesYaml, rowDeletePolicyYaml } from '../support/fixtures';
import { startMediaApi, type MediaApi } from '../../tools/media-api/server';
import { requireTool, PROMETHEUS } from '../support/requirements';
import { assertNoLeakedProcesses, runReaperCli, spawnOwned, startReaper, stopLeftovers, type ReaperProcess } from '../support/processes';
import { mediaPolicyYaml, seedAssets, startRemoteServices, stopStarted } from '../support/remote-helpers';
import { seedHolds } from '../support/seed';
import { makeTestBed, type TestBed } from '../support/testbed';

/**
 * Issue 8: a real Prometheus server (Debian's `prometheus` package) scrapes a scheduler, a worker
 * and a relay (the seat-holds policy writes expiry events) during a short run, loads infra/prometheus/reaper-rules.yaml itself, and answers every
 * dashboard and alert expression through its HTTP API: each must parse and return a series
 * (for an alert, each metric it reads must return one: an alert that is not firing is empty).
 */
const ROOT = path.resolve(__dirname, '..', '..', '..');
const RULES = path.join(ROOT, 'infra', 'prometheus', 'reaper-rules.yaml');
const DASHBOARD = path.join(ROOT, 'infra', 'grafana', 'reaper-dashboard.json');

async function freeLoopbackPort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const address = server.address();
  await new Promise<void>((resolve) => server.close(() => resolve()));
  assert.ok(address && typeof address === 'object');
  return address.port;
}

interface Dashboard {
  panels: Array<{ title: string; targets?: Array<{ expr: string }> }>;
}

/** Grafana's variables as a user with "All" selected would send them. */
function asQuery(expr: string): string {
  return expr.replaceAll('$__rate_interval', '15s').replaceAll('$policy', '.*');
}

describe('a real Prometheus evaluates every dashboard and alert expression', () => {
  let bed: TestBed;
  let api: MediaApi;
  let folder: string;
  let relay: ReaperProcess | undefined;

  before(async () => {
    bed = await makeTestBed('prometheus_real');
    api = await startMediaApi();
    folder = mkdtempSync(path.join(tmpdir(), 'reaper-test-prometheus-'));
    bed.writePolicies(
      combinedPoliciesYaml(
        rowDeletePolicyYaml({ batchSize: 2, events: true }),
        mediaPolicyYaml({ baseUrl: api.url, ratePerSecond: 20, burst: 5, concurrency: 2, batchSize: 2 }),
      ),
    );
  });

  after(async () => {
    try {
      await stopStarted();
      if (relay) await stopLeftovers([relay]);
      await assertNoLeakedProcesses();
    } finally {
      await api?.close();
      await bed?.close();
      rmSync(folder, { recursive: true, force: true });
    }
  });

  test('every expression parses and returns a series; Prometheus loaded every rule', { timeout: 60_000 }, async (t) => {
    if (!(await requireTool(t, PROMETHEUS))) return;
    const env = { HTTP_PORT: '0', REAPER_BACKLOG_REFRESH_MS: '500' };
    const { scheduler, workers: [worker] } = await startRemoteServices(bed, { scheduler: 'prom-scheduler', workers: ['prom-worker'], schedulerEnv: env, workerEnv: env });
    relay = startReaper('prom-relay', ['relay'], bed.processEnv({ HTTP_PORT: '0' }));
    await relay.waitForLine('relay started', (line) => line.msg === 'relay started');
    const portOf = (process: ReaperProcess, kind: string) => Number(process.lines.find((line) => line.msg === `${kind} started`)!.httpPort);

    const port = await freeLoopbackPort();
    const config = path.join(folder, 'prometheus.yml');
    writeFileSync(
      config,
      `global: { scrape_interval: 1s, evaluation_interval: 1s }
rule_files: [${JSON.stringify(RULES)}]
scrape_configs:
  - job_name: reaper-scheduler
    static_configs: [{ targets: ["127.0.0.1:${portOf(scheduler, 'scheduler')}"] }]
  - job_name: reaper-worker
    static_configs: [{ targets: ["127.0.0.1:${portOf(worker, 'worker')}"] }]
  - job_name: reaper-relay
    static_configs: [{ targets: ["127.0.0.1:${portOf(relay, 'relay')}"] }]
`,
    );
    const prometheus: ChildProcess = spawnOwned(
      'prometheus',
      [`--config.file=${config}`, `--storage.tsdb.path=${path.join(folder, 'data')}`, `--web.listen-address=127.0.0.1:${port}`, '--log.level=warn'],
      { stdio: ['ignore', 'ignore', 'pipe'] },
    );
    const stderr: string[] = [];
    prometheus.stderr!.on('data', (chunk: Buffer) => stderr.push(chunk.toString('utf8')));
    const exited = new Promise<void>((resolve) => prometheus.once('exit', () => resolve()));
    try {
      const base = `http://127.0.0.1:${port}`;
      const get = async <T>(pathAndQuery: string): Promise<{ status: string; data: T; error?: string }> =>
        (await (await fetch(`${base}${pathAndQuery}`)).json()) as { status: string; data: T; error?: string };
      const query = (expr: string) => get<{ result: unknown[] }>(`/api/v1/query?query=${encodeURIComponent(expr)}`);

      await eventually(
        'Prometheus to scrape the three services',
        async () => {
          const targets = await get<{ activeTargets: Array<{ health: string }> }>('/api/v1/targets');
          return targets.data.activeTargets.length === 3 && targets.data.activeTargets.every((target) => target.health === 'up');
        },
        { timeoutMs: 20_000, describe: () => stderr.join('').slice(-2000) },
      );

      // A short run of each policy: rows and assets deleted, runs completed.
      await seedHolds(bed.pool, { expiredHeld: 6, expiredConfirmed: 2 });
      await seedAssets(bed.pool, 'prom', 4);
      for (const policy of ['seat-holds', 'media-assets']) assert.equal((await runReaperCli(['trigger', policy], bed.processEnv())).code, 0);

      const dashboard = JSON.parse(readFileSync(DASHBOARD, 'utf8')) as Dashboard;
      const panelExprs = dashboard.panels.flatMap((panel) => (panel.targets ?? []).map((target) => ({ where: `panel "${panel.title}"`, expr: target.expr })));
      const rules = parseYaml(readFileSync(RULES, 'utf8')) as { groups: Array<{ rules: Array<{ alert: string; expr: string }> }> };
      const alertExprs = rules.groups.flatMap((group) => group.rules.map((rule) => ({ alert: rule.alert, expr: rule.expr })));
      assert.ok(panelExprs.length >= 20 && alertExprs.length >= 8);

      // Every panel returns a series once both runs completed and rate windows hold samples.
      const empty = async () => {
        const missing: string[] = [];
        for (const { where, expr } of panelExprs) {
          const answer = await query(asQuery(expr));
          assert.equal(answer.status, 'success', `${where}: ${expr} parses (${answer.error ?? ''})`);
          if (answer.data.result.length === 0) missing.push(`${where}: ${expr}`);
        }
        return missing;
      };
      await eventually('every dashboard expression to return a series', async () => (await empty()).length === 0, {
        timeoutMs: 30_000,
        intervalMs: 1_000,
        describe: empty,
      });

      for (const { alert, expr } of alertExprs) {
        const answer = await query(expr);
        assert.equal(answer.status, 'success', `${alert}: parses (${answer.error ?? ''})`);
        // Not firing is an empty answer: instead every metric selector in it must return a series.
        const selectors = expr.match(/reaper_[a-z_]+(\{[^}]*\})?/g) ?? [];
        assert.ok(selectors.length > 0, `${alert} reads reaper metrics`);
        for (const selector of selectors) {
          const series = await query(selector);
          assert.ok(series.data.result.length > 0, `${alert}: ${selector} returns a series`);
        }
      }

      // Prometheus loaded the rules file itself: every alert is known and healthy.
      const loaded = await get<{ groups: Array<{ rules: Array<{ name: string; health: string }> }> }>('/api/v1/rules');
      const names = loaded.data.groups.flatMap((group) => group.rules.filter((rule) => rule.health === 'ok').map((rule) => rule.name));
      assert.deepEqual(names.sort(), alertExprs.map((rule) => rule.alert).sort());
      assert.equal((await scheduler.stop()).code, 0);
      assert.equal((await worker.stop()).code, 0);
      assert.equal((await relay.stop()).code, 0);
    } finally {
      prometheus.kill('SIGTERM');
      const timer = setTimeout(() => prometheus.kill('SIGKILL'), 10_000);
      await exited;
      clearTimeout(timer);
    }
  });
});
