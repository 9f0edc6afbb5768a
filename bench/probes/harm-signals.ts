/**
 * What PostgreSQL shows of the harm a cleanup does a foreground (issue 41 item 3): a probe, not a
 * figure. The harm law (shared/admission/adaptive-harm.ts) reads the others' statement durations
 * from pg_stat_activity; beside bench figure 7b's 2,000 point reads/s its steps read harm 0.87-1.11 all
 * the way from 1,000 to 64,000 rows/s while the foreground's p99 rose to 4.7 x alone (2026-12-07), so it
 * climbed without bound. This probe asks why, with nothing of reaper's pipeline in the way: pgbench
 * point reads at a fixed rate (the foreground, its per-transaction log: the harm as the client
 * sees it), and a bare DELETE loop at a few paces (2 connections, 500 rows a transaction, a pause
 * after each commit), each pace in rounds of a window alone then a window deleting. Three signals
 * are read in every window:
 *  - the others' statement durations as the harm law reads them (admissionOthersSample every
 *    100 ms: state_change - query_start of sessions idle again, each counted once);
 *  - the round trip of `SELECT 1` every 20 ms (HARM_PROBE_PROBE_MS) on a connection of its own
 *    (a scheduling-latency probe: the wait for a backend to be woken and run, which no statement
 *    duration contains);
 *  - the foreground's own latencies (pgbench), the truth the others are judged against.
 * Run: `npm run bench:harm-signals`. Settings: HARM_PROBE_ROUNDS, HARM_PROBE_PAUSES (comma-separated
 * ms), HARM_PROBE_SCRIPT (read or write), HARM_PROBE_RATE (transactions/s), HARM_PROBE_WINDOW
 * (seconds), HARM_PROBE_PROBE_MS (the round-trip probe's period). Writes
 * bench/results/<date>-harm-signals-<script>-<rate>-paces<ms>-probe<ms>ms-rounds<n>-window<s>s.{md,json}
 * (a run with the same settings on the same day replaces it). Needs the local PostgreSQL and
 * pgbench; creates and drops its own database.
 */
import { mkdtempSync, mkdirSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { admissionOthersSample } from '../../shared/db/queries/admission';
import { Pgbench, percentile } from '../figures/foreground';
import { SAMPLER_APPLICATION, databaseUrl, withAdmin } from '../lib/database';
import { meansBySecond } from '../lib/stats';
import { sleep } from '../lib/wait';

const DATABASE = 'reaper_harm_probe';
const adminUrl = process.env.DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
const rounds = Number(process.env.HARM_PROBE_ROUNDS ?? 3);
const pausesMs = (process.env.HARM_PROBE_PAUSES ?? '0,25,100,400').split(',').map((pause) => (pause.trim() === '' ? Number.NaN : Number(pause)));
const readsPerSecond = Number(process.env.HARM_PROBE_RATE ?? 2000);
const windowSeconds = Number(process.env.HARM_PROBE_WINDOW ?? 6);
/** The round-trip probe's period (ms): a `SELECT 1` this often. */
const probeEveryMs = Number(process.env.HARM_PROBE_PROBE_MS ?? 20);
/**
 * The foreground's transaction (HARM_PROBE_SCRIPT): `read`, a point read; `write`, an update by key and
 * a 20-row insert in one transaction (its commit waits for a WAL flush, inside a statement: the COMMIT).
 */
const SCRIPTS = {
  read: '\\set k random(1, 200000)\nSELECT v FROM app WHERE id = :k;\n',
  write:
    '\\set k random(1, 200000)\nBEGIN;\nUPDATE app SET v = md5(random()::text) WHERE id = :k;\n' +
    'INSERT INTO app_log (app_id, v) SELECT :k, md5(i::text) FROM generate_series(1, 20) AS i;\nCOMMIT;\n',
} as const;
const scriptName = (process.env.HARM_PROBE_SCRIPT ?? 'read') as keyof typeof SCRIPTS;
for (const [name, value] of Object.entries({ HARM_PROBE_ROUNDS: rounds, HARM_PROBE_RATE: readsPerSecond, HARM_PROBE_WINDOW: windowSeconds, HARM_PROBE_PROBE_MS: probeEveryMs })) {
  if (!(Number.isInteger(value) && value > 0)) usage(`${name} must be a positive whole number; got ${JSON.stringify(process.env[name])}`);
}
if (pausesMs.some((pause) => !(Number.isInteger(pause) && pause >= 0))) usage(`HARM_PROBE_PAUSES must be whole ms >= 0, comma-separated; got ${JSON.stringify(process.env.HARM_PROBE_PAUSES)}`);
if (!Object.hasOwn(SCRIPTS, scriptName)) usage(`HARM_PROBE_SCRIPT must be one of ${Object.keys(SCRIPTS).join(', ')}; got ${JSON.stringify(scriptName)}`);

function usage(message: string): never {
  process.stderr.write(`harm-signals: ${message}\n`);
  process.exit(2);
}
const BATCH = 500;
const DELETERS = 2;
/** Rows the junk table is refilled to before each window that deletes: the unthrottled loop deleted 143-164k rows/s on a 2-core machine, so 200k for each second of the window. */
const JUNK_ROWS = 200_000 * windowSeconds;

interface Window {
  client: number[];
  server: number[];
  roundTrip: number[];
  /** The mean round trip of each whole second of the window (ms): what a law stepping once a second would read. */
  roundTripBySecond: number[];
}

interface PaceResult {
  pauseMs: number;
  rowsPerSecond: number;
  alone: Window;
  deleting: Window;
  /** Each round's foreground p99 deleting / alone. */
  clientP99ByRound: number[];
}

const sorted = (values: readonly number[]) => [...values].sort((a, b) => a - b);
const geometricMean = (values: readonly number[]) => Math.exp(values.reduce((sum, value) => sum + Math.log(value), 0) / values.length);
const p = (values: readonly number[], q: number) => percentile(sorted(values), q);
const emptyWindow = (): Window => ({ client: [], server: [], roundTrip: [], roundTripBySecond: [] });

async function prepare(url: string): Promise<void> {
  await withAdmin(adminUrl, async (admin) => {
    await admin.query(`DROP DATABASE IF EXISTS ${DATABASE} WITH (FORCE)`);
    await admin.query(`CREATE DATABASE ${DATABASE}`);
  });
  const db = new pg.Client({ connectionString: url, application_name: SAMPLER_APPLICATION });
  await db.connect();
  await db.query(`CREATE TABLE app (id int PRIMARY KEY, v text)`);
  await db.query(`INSERT INTO app SELECT i, md5(i::text) FROM generate_series(1, 200000) AS i`);
  await db.query(`CREATE TABLE app_log (id bigserial PRIMARY KEY, app_id int NOT NULL, v text, at timestamptz NOT NULL DEFAULT now())`);
  await db.query(`CREATE TABLE junk (id bigserial PRIMARY KEY, expires_at timestamptz NOT NULL, payload text)`);
  await db.query(`CREATE INDEX ON junk (expires_at)`);
  await db.query('VACUUM ANALYZE app');
  await db.end();
}

/** One pace, one round: `windowSeconds` alone, then as long deleting; the three signals in each. */
async function measure(url: string, directory: string, pauseMs: number, round: number): Promise<{ alone: Window; deleting: Window; rows: number }> {
  // A pool of one: admissionOthersSample takes a pool or a pool's client, as the workers' do.
  const sampler = new pg.Pool({ connectionString: url, application_name: SAMPLER_APPLICATION, max: 1 });
  await sampler.query(`TRUNCATE junk`);
  await sampler.query(`INSERT INTO junk (expires_at, payload) SELECT now() - i * interval '1 ms', md5(i::text) FROM generate_series(1, ${JUNK_ROWS}) AS i`);
  await sampler.query('VACUUM ANALYZE junk');
  await sampler.query('CHECKPOINT');
  const startMs = Date.now();
  const warmMs = 1_000;
  const aloneFrom = startMs + warmMs;
  const deletingFrom = aloneFrom + windowSeconds * 1000;
  const deletingTo = deletingFrom + windowSeconds * 1000;
  const bench = new Pgbench(path.join(directory, `log-${pauseMs}-${round}`), url, [path.join(directory, 'foreground.sql')], { ratePerSecond: readsPerSecond, clients: 4 }, (warmMs + 2 * windowSeconds * 1000 + 2_000) / 1000);
  const server: Array<[number, number]> = [];
  const roundTrips: Array<[number, number]> = [];
  let done = false;
  const sampling = (async () => {
    let since: number | null = null;
    while (!done) {
      const sample = await admissionOthersSample(sampler, since);
      if (since !== null) for (const ms of sample.finishedMs) if (ms > 0) server.push([Date.now(), ms]);
      since = sample.at;
      await sleep(100);
    }
  })();
  const probe = new pg.Client({ connectionString: url, application_name: 'reaper bench round trip' });
  await probe.connect();
  const probing = (async () => {
    while (!done) {
      // Stamped when sent: a round trip that spans a stall counts in the second it began.
      const sentAt = Date.now();
      const before = process.hrtime.bigint();
      await probe.query('SELECT 1');
      roundTrips.push([sentAt, Number(process.hrtime.bigint() - before) / 1e6]);
      await sleep(probeEveryMs);
    }
  })();
  await sleep(deletingFrom - Date.now());
  let rows = 0;
  await Promise.all(
    Array.from({ length: DELETERS }, async (_, index) => {
      const deleter = new pg.Client({ connectionString: url, application_name: `reaper-worker-probe-${index}` });
      await deleter.connect();
      while (Date.now() < deletingTo) {
        await deleter.query('BEGIN');
        const result = await deleter.query(`DELETE FROM junk WHERE id IN (SELECT id FROM junk ORDER BY expires_at LIMIT ${BATCH} FOR UPDATE SKIP LOCKED)`);
        await deleter.query('COMMIT');
        rows += result.rowCount ?? 0;
        if (pauseMs > 0) await sleep(pauseMs);
      }
      await deleter.end();
    }),
  );
  await sleep(500);
  done = true;
  await Promise.all([sampling, probing]);
  await bench.stop();
  await Promise.all([sampler.end(), probe.end()]);
  const inWindow = (from: number, to: number): Window => ({
    client: bench.transactions(from, to).map((t) => t.ms),
    server: server.filter(([at]) => at >= from && at < to).map(([, ms]) => ms),
    roundTrip: roundTrips.filter(([at]) => at >= from && at < to).map(([, ms]) => ms),
    roundTripBySecond: meansBySecond(roundTrips, from, to),
  });
  return { alone: inWindow(aloneFrom, deletingFrom), deleting: inWindow(deletingFrom, deletingTo), rows };
}

function ratio(deleting: readonly number[], alone: readonly number[], of: (values: readonly number[]) => number): string {
  return deleting.length > 0 && alone.length > 0 ? (of(deleting) / of(alone)).toFixed(2) : '-';
}

async function main(): Promise<void> {
  const url = databaseUrl(adminUrl, DATABASE);
  const directory = mkdtempSync(path.join(os.tmpdir(), 'reaper-harm-probe-'));
  writeFileSync(path.join(directory, 'foreground.sql'), SCRIPTS[scriptName]);
  await prepare(url);
  const results: PaceResult[] = pausesMs.map((pauseMs) => ({ pauseMs, rowsPerSecond: 0, alone: emptyWindow(), deleting: emptyWindow(), clientP99ByRound: [] }));
  const started = Date.now();
  for (let round = 0; round < rounds; round += 1) {
    // Each round visits the paces in another order: the machine's slow drift falls on all alike.
    const order = results.map((_, index) => (index + round) % results.length);
    for (const index of order) {
      const result = results[index]!;
      const one = await measure(url, directory, result.pauseMs, round);
      for (const key of ['client', 'server', 'roundTrip', 'roundTripBySecond'] as const) {
        result.alone[key].push(...one.alone[key]);
        result.deleting[key].push(...one.deleting[key]);
      }
      result.rowsPerSecond += one.rows / windowSeconds / rounds;
      result.clientP99ByRound.push(p(one.deleting.client, 0.99) / p(one.alone.client, 0.99));
      process.stdout.write(`round ${round + 1}, pause ${result.pauseMs} ms: ${Math.round(one.rows / windowSeconds)} rows/s, foreground p99 ${(p(one.deleting.client, 0.99) / p(one.alone.client, 0.99)).toFixed(2)} x alone\n`);
    }
  }
  await withAdmin(adminUrl, (admin) => admin.query(`DROP DATABASE IF EXISTS ${DATABASE} WITH (FORCE)`));
  const gm = geometricMean;
  const q = (quantile: number) => (values: readonly number[]) => p(values, quantile);
  const lines = [
    `# What PostgreSQL shows of a cleanup's harm (bench/probes/harm-signals.ts), ${new Date().toISOString().slice(0, 16)}Z`,
    '',
    `${os.cpus().length} cores, load average ${os.loadavg().map((value) => value.toFixed(2)).join(' ')} at the end; ${rounds} rounds of ${windowSeconds} s alone then ${windowSeconds} s deleting per pace, each ratio pooled over the rounds (deleting ÷ alone); pgbench ${readsPerSecond} transactions/s (${scriptName}) on 4 clients; a bare DELETE loop on ${DELETERS} connections, ${BATCH} rows a transaction, a pause after each commit; ${Math.round((Date.now() - started) / 1000)} s.`,
    '',
    '| pause after each commit | rows/s | foreground (pgbench) p50 / p90 / p99 | p99 by round | others\' statement durations, as the harm law reads them: geometric mean / p90 / p99 (count alone, deleting) | `SELECT 1` round trip: p50 / p90 / p99 |',
    '|---|---|---|---|---|---|',
    ...results.map(
      (r) =>
        `| ${r.pauseMs} ms | ${Math.round(r.rowsPerSecond).toLocaleString('en-US')} | ${ratio(r.deleting.client, r.alone.client, q(0.5))} / ${ratio(r.deleting.client, r.alone.client, q(0.9))} / **${ratio(r.deleting.client, r.alone.client, q(0.99))}** | ${r.clientP99ByRound.map((value) => value.toFixed(2)).join(' ')} | **${ratio(r.deleting.server, r.alone.server, gm)}** / ${ratio(r.deleting.server, r.alone.server, q(0.9))} / ${ratio(r.deleting.server, r.alone.server, q(0.99))} (${r.alone.server.length}, ${r.deleting.server.length}) | ${ratio(r.deleting.roundTrip, r.alone.roundTrip, q(0.5))} / ${ratio(r.deleting.roundTrip, r.alone.roundTrip, q(0.9))} / ${ratio(r.deleting.roundTrip, r.alone.roundTrip, q(0.99))} |`,
    ),
    '',
    `The round trip as a law stepping once a second would read it: each whole second's mean round trip (a \`SELECT 1\` every ${probeEveryMs} ms) ÷ the mean of all the pace's alone round trips; the alone seconds are the control (how often a second reads over a line with no cleanup).`,
    '',
    '| pause | foreground p99 ÷ alone | seconds deleting: median, 10th–90th percentile | share over 1.1 / 1.2 | seconds alone: median, 10th–90th | share over 1.1 / 1.2 |',
    '|---|---|---|---|---|---|',
    ...results.map((r) => {
      const base = r.alone.roundTrip.reduce((sum, ms) => sum + ms, 0) / Math.max(1, r.alone.roundTrip.length);
      const read = (seconds: readonly number[]) => {
        const ratios = seconds.map((ms) => ms / base);
        const share = (line: number) => (ratios.filter((value) => value > line).length / Math.max(1, ratios.length)).toFixed(2);
        return `${p(ratios, 0.5).toFixed(2)}, ${p(ratios, 0.1).toFixed(2)}–${p(ratios, 0.9).toFixed(2)} | ${share(1.1)} / ${share(1.2)}`;
      };
      return `| ${r.pauseMs} ms | ${ratio(r.deleting.client, r.alone.client, q(0.99))} | ${read(r.deleting.roundTripBySecond)} | ${read(r.alone.roundTripBySecond)} |`;
    }),
    '',
    `Alone (pooled): foreground p99 ${results.map((r) => p(r.alone.client, 0.99).toFixed(2)).join(' / ')} ms; others' statements geometric mean ${results.map((r) => gm(r.alone.server).toFixed(3)).join(' / ')} ms; round trip p50 ${results.map((r) => p(r.alone.roundTrip, 0.5).toFixed(2)).join(' / ')} ms (in the order of the table).`,
    '',
  ];
  const resultsDirectory = path.join(process.cwd(), 'bench', 'results');
  mkdirSync(resultsDirectory, { recursive: true });
  const base = path.join(resultsDirectory, `${new Date().toISOString().slice(0, 10)}-harm-signals-${scriptName}-${readsPerSecond}-paces${pausesMs.join('-')}-probe${probeEveryMs}ms-rounds${rounds}-window${windowSeconds}s`);
  writeFileSync(`${base}.md`, lines.join('\n'));
  writeFileSync(
    `${base}.json`,
    JSON.stringify({ rounds, windowSeconds, script: scriptName, readsPerSecond, paces: results.map((r) => ({ pauseMs: r.pauseMs, rowsPerSecond: r.rowsPerSecond, clientP99ByRound: r.clientP99ByRound })) }, null, 1),
  );
  process.stdout.write(`${lines.join('\n')}\nwrote ${base}.md and .json\n`);
}

main().catch((error: unknown) => {
  process.stderr.write(`harm-signals: ${error instanceof Error ? error.message : String(error)}\n`);
  process.exit(1);
});
