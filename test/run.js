#!/usr/bin/env node
// Runs the compiled test suite with Node's test runner, three or four files at a time (each file has
// its own database and broker prefix; see `concurrency` below). `npm test` builds first
// (pretest). Files are listed here rather than by directory: Node 20 would also run every .js
// under a "test" folder (the support code).
// `npm test -- test/unit/policies.test.ts` runs one file; flags (--test-name-pattern=...) pass on.
// Files named *.timed.test.ts measure against the clock (a rate, a cron tick, a detection bound):
// they run after the parallel group, two at once on an idle machine and one at a time on a busy one,
// so the other files' load on a 2-core machine does not decide their result (alone, one of them
// kept the machine about a quarter busy: two at once leave each most of a core). Files named
// *.serial.test.ts stop a server or raise a broker alarm for everyone: they run last, alone.
//
// Every test and hook has a timeout (120 s, REAPER_TEST_TIMEOUT_MS overrides it; an explicit
// `timeout` option wins): from Node 22 `--test-timeout` bounds each test and hook; on Node 20 it
// bounds a whole file (killed without its `after` hooks, reported without the name of the test
// that hung), so there the preload test/support/timeouts.ts gives each test and hook the option
// instead. `--test-force-exit` ends a file once its tests are done even when a test that timed
// out still holds a socket or a timer. Before the run, leftovers of earlier runs that were
// killed (older than an hour) are removed (test/support/sweeper.ts). A test that needs a tool the
// machine lacks is skipped with one line naming it (test/support/requirements.ts); the skips are
// counted at the end, and REAPER_TEST_REQUIRE_ALL=1 makes each of them a failure instead.
//
// REAPER_TEST_CPU=1 (Linux) measures where the CPU goes, per file, and prints a table at the end:
// the CPU of each file's process and of all it spawned and reaped (test/support/cpu-usage.ts,
// preloaded), the CPU of the PostgreSQL backends of the file's databases (sampled every 500 ms: a
// backend is given to the file whose process holds the other end of the first connection seen to
// its database, and a backend that lives less than 500 ms is missed), and the processes in the
// file's tree that used most, also by sampling. Rows in parentheses are the servers' other
// processes (PostgreSQL's own, RabbitMQ: their CPU in the node column); last, the whole machine's.
const { spawn } = require('node:child_process');
const { mkdtempSync, readdirSync, readFileSync, readlinkSync, rmSync } = require('node:fs');
const { tmpdir } = require('node:os');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const dist = path.join(root, 'dist');
const args = process.argv.slice(2);
const flags = args.filter((arg) => arg.startsWith('--'));
const chosen = args.filter((arg) => !arg.startsWith('--'));

function testFiles(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) return testFiles(full);
    return entry.name.endsWith('.test.js') ? [full] : [];
  });
}

/** The share of all CPUs' time spent idle over the next `ms` (from /proc/stat; 1 where it cannot be read, e.g. not Linux). */
async function cpuIdleShare(ms) {
  const read = () => {
    const fields = readFileSync('/proc/stat', 'utf8').split('\n')[0].trim().split(/\s+/).slice(1).map(Number);
    return { idle: fields[3] + (fields[4] || 0), total: fields.reduce((sum, n) => sum + n, 0) };
  };
  try {
    const before = read();
    await new Promise((resolve) => setTimeout(resolve, ms));
    const after = read();
    return after.total > before.total ? (after.idle - before.idle) / (after.total - before.total) : 1;
  } catch {
    return 1;
  }
}

/** Every process now: pid to { id (pid and start time: pids are reused), comm, ppid, ticks (user+system, 1/100 s) }. */
function processes() {
  const all = new Map();
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    try {
      const stat = readFileSync(`/proc/${name}/stat`, 'utf8');
      const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      all.set(Number(name), { id: `${name}/${fields[19]}`, comm: stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')')), ppid: Number(fields[1]), ticks: Number(fields[11]) + Number(fields[12]) });
    } catch {
      // gone meanwhile
    }
  }
  return all;
}

const cmdline = (pid) => readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean);

/** The pid holding the client end of a TCP connection to PostgreSQL from local `port` (undefined if none is seen). */
function clientOf(port, pids) {
  const wanted = `:${port.toString(16).toUpperCase().padStart(4, '0')}`;
  let inode;
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    for (const line of readFileSync(table, 'utf8').split('\n').slice(1)) {
      const fields = line.trim().split(/\s+/);
      if (fields[1]?.endsWith(wanted) && fields[2]?.endsWith(':1538')) inode = fields[9];
    }
  }
  if (inode === undefined) return undefined;
  for (const pid of pids) {
    try {
      if (readdirSync(`/proc/${pid}/fd`).some((fd) => readlinkSync(`/proc/${pid}/fd/${fd}`) === `socket:[${inode}]`)) return pid;
    } catch {
      // gone meanwhile
    }
  }
  return undefined;
}

/** A process's command name and its first two arguments that are neither flags nor preloads (`node reaper worker`). */
function commandOf(comm, args) {
  const rest = args.slice(1).filter((arg, i, all) => !arg.startsWith('-') && !['--require', '-r', '--import'].includes(all[i - 1]));
  return [comm, ...rest.slice(0, 2).map((arg) => path.basename(arg))].join(' ');
}

/** REAPER_TEST_CPU=1: samples every 500 ms; call sample(runnerPid) while a group runs, then table(). */
function cpuSampler() {
  const fileOf = new Map(); // id of a file's process or a descendant -> the file
  const what = new Map(); // such an id -> its command, shortened
  const pidOf = new Map(); // such an id -> its pid
  const databaseFile = new Map(); // database -> file
  const top = new Map(); // process id -> { key: file or server row, what, first, max }
  const machine = () => readFileSync('/proc/stat', 'utf8').split('\n')[0].trim().split(/\s+/).slice(1).map(Number);
  const machineBefore = machine();
  const note = (id, key, label, ticks, existedAtStart) => {
    const entry = top.get(id) ?? { key, what: label, first: existedAtStart ? ticks : 0, max: 0 };
    entry.max = Math.max(entry.max, ticks);
    top.set(id, entry);
  };
  let first = true;
  function sample(runnerPid) {
    const all = processes();
    const fileOfPid = (pid) => {
      const info = all.get(pid);
      if (!info) return undefined;
      if (fileOf.has(info.id)) return fileOf.get(info.id);
      let file;
      if (info.ppid === runnerPid) file = cmdline(pid).find((arg) => arg.endsWith('.test.js'));
      else if (info.ppid > 1) file = fileOfPid(info.ppid);
      if (file !== undefined) {
        fileOf.set(info.id, file);
        pidOf.set(info.id, pid);
        what.set(info.id, info.ppid === runnerPid ? 'the test process' : commandOf(info.comm, cmdline(pid)));
      }
      return file;
    };
    for (const [pid, info] of all) {
      try {
        const file = fileOfPid(pid);
        if (file !== undefined) {
          note(info.id, file, what.get(info.id), info.ticks, false);
        } else if (info.comm === 'postgres') {
          const title = cmdline(pid).join(' ');
          const database = /\b(reaper_test_[a-z0-9_]+)/.exec(title)?.[1];
          const port = /127\.0\.0\.1\((\d+)\)/.exec(title)?.[1];
          if (database && !databaseFile.has(database) && port) {
            const client = clientOf(Number(port), [...pidOf].filter(([id, p]) => all.get(p)?.id === id).map(([, p]) => p));
            if (client !== undefined) databaseFile.set(database, fileOf.get(all.get(client).id));
          }
          const key = database ? databaseFile.get(database) ?? `(PostgreSQL, database ${database} of no file seen)` : '(PostgreSQL, other processes)';
          note(info.id, key, 'postgres', info.ticks, first && !database);
        } else if (info.comm === 'beam.smp' || info.comm === 'epmd') {
          note(info.id, '(RabbitMQ)', info.comm, info.ticks, first);
        }
      } catch {
        // gone meanwhile
      }
    }
    first = false;
  }
  function table(wallByFile, nodeByFile) {
    const rows = new Map(); // key -> { postgres, sampled: Map(what -> s) }
    for (const { key, what: label, first: start, max } of top.values()) {
      const row = rows.get(key) ?? { postgres: 0, sampled: new Map() };
      const seconds = (max - start) / 100;
      if (label === 'postgres' && !key.startsWith('(')) row.postgres += seconds;
      else row.sampled.set(label, (row.sampled.get(label) ?? 0) + seconds);
      rows.set(key, row);
    }
    for (const file of nodeByFile.keys()) if (!rows.has(file)) rows.set(file, { postgres: 0, sampled: new Map() });
    const sum = (map) => [...map.values()].reduce((a, b) => a + b, 0);
    const lines = [...rows].map(([key, row]) => {
      const node = nodeByFile.get(key) ?? sum(row.sampled);
      return { key, wall: (wallByFile.get(key) ?? 0) / 1000, node, postgres: row.postgres, total: node + row.postgres, row };
    });
    lines.sort((a, b) => b.total - a.total);
    const fixed = (n) => n.toFixed(1).padStart(7);
    console.log('# CPU by file (seconds; node: its process and all it spawned and reaped; postgres: its databases\' backends; sampled: the processes of its tree seen alive, and the largest of them):');
    console.log(`#  ${'wall'.padStart(7)} ${'node'.padStart(7)} ${'postgres'.padStart(8)} ${'total'.padStart(7)}  file / most`);
    for (const { key, wall, node, postgres, total, row } of lines) {
      const most = [`sampled ${sum(row.sampled).toFixed(1)}`, ...[...row.sampled].sort((a, b) => b[1] - a[1]).slice(0, 3).map(([label, s]) => `${label} ${s.toFixed(1)}`)].join('; ');
      console.log(`#  ${fixed(wall)} ${fixed(node)} ${fixed(postgres).padStart(8)} ${fixed(total)}  ${key.startsWith('(') ? key : path.relative(dist, key)}  [${most}]`);
    }
    const totals = lines.filter((line) => !line.key.startsWith('('));
    const machineAfter = machine();
    const busy = (fields) => fields.reduce((a, b) => a + b, 0) - fields[3] - (fields[4] || 0);
    const total = (field) => totals.reduce((seconds, line) => seconds + line[field], 0).toFixed(0);
    const { user, system } = process.cpuUsage();
    console.log(`#  totals over ${totals.length} files: node ${total('node')} s, postgres ${total('postgres')} s; whole machine busy ${((busy(machineAfter) - busy(machineBefore)) / 100).toFixed(0)} s, of which this sampling ${((user + system) / 1e6).toFixed(0)} s`);
  }
  return { sample, table };
}

/**
 * The parallel group's tail: how long, at its end, fewer files ran than it could run at once, and
 * which file ended last (a long file started late lengthens the whole run by what it has left).
 */
function underUsedTail(spans, atOnce) {
  // Node 20's runner starts the files in alphabetical order whatever order they are given in (the
  // longest first would shorten this tail; measured 8-11 s in whole runs on 2026-12-06).
  const end = Math.max(...spans.map((span) => span.end));
  const length = end - Math.min(...spans.map((span) => span.start));
  const running = (at) => spans.filter((span) => span.start <= at && span.end > at).length;
  // From the end backwards, second by second, while fewer than atOnce ran.
  let tail = 0;
  while (tail < length && running(end - tail - 1_000) < atOnce) tail += 1_000;
  const last = spans.reduce((a, b) => (b.end > a.end ? b : a));
  return `${(tail / 1000).toFixed(0)} s at the end below ${atOnce} files at once (the last to end: ${path.relative(dist, last.file)}, ${((last.end - last.start) / 1000).toFixed(0)} s long)`;
}

async function main() {
  const files = chosen.length > 0 ? chosen.map((file) => path.join(dist, file.replace(/\.ts$/, '.js'))) : testFiles(path.join(dist, 'test')).sort();
  if (files.length === 0) {
    console.error('no compiled test files found under dist/test (run `npm run build`)');
    return 1;
  }
  // Only when a file needs the servers: the unit tests run without them (CI runs them on Node 24 too).
  if (!process.env.REAPER_TEST_NO_SWEEP && files.some((file) => !file.includes(`${path.sep}unit${path.sep}`))) {
    const { sweepLeftovers, describeSweep } = require(path.join(dist, 'test', 'support', 'sweeper.js'));
    const lines = await sweepLeftovers().then(describeSweep, (error) => [`leftover sweep failed (the run goes on): ${error.message}`]);
    for (const line of lines) console.log(`# ${line}`);
  }
  const skipLog = path.join(mkdtempSync(path.join(tmpdir(), 'reaper-skips-')), 'skips');
  const env = { ...process.env, REAPER_TEST_SKIP_LOG: skipLog };
  const timeoutMs = Number(process.env.REAPER_TEST_TIMEOUT_MS || 120_000);
  if (!Number.isInteger(timeoutMs) || timeoutMs <= 0) {
    console.error(`REAPER_TEST_TIMEOUT_MS must be a positive whole number of milliseconds, got ${JSON.stringify(process.env.REAPER_TEST_TIMEOUT_MS)}`);
    return 1;
  }
  // Files of the parallel group at once: REAPER_TEST_CONCURRENCY, else by the machine's state at
  // the start. An idle 2-core machine runs 4 (the parallel group took 372 s at 3; 4 was 5-20 %
  // faster on the same files; 6 only 4 % more, 304 s against 317 s, 2026-12-07, with a longer tail).
  // One already busy (another job, CI's busy loops) runs 5: the suite is CPU-bound (81 % of both
  // cores idle-run, 60 % of its processes' CPU is their start-up), and beside other runnable work
  // its share of the CPU grows with the files it runs; under two busy loops on both cores the
  // parallel group took 537 s at 3 and 399 s at 5, every file green (2026-12-07). The timing-bound
  // files run in the timed group. Busy means less than half of the CPU idle over one second now:
  // the load average would still count the build that just ran (2.6 on an idle machine right after
  // `npm ci` and tsc). The timed group runs two files at once when idle, one when busy (below); the
  // serial group one at a time whatever this says.
  const idleShare = await cpuIdleShare(1_000);
  const busy = idleShare < 0.5;
  const concurrency = Number(process.env.REAPER_TEST_CONCURRENCY || (busy ? 5 : 4));
  if (!Number.isInteger(concurrency) || concurrency <= 0 || concurrency > 16) {
    console.error(`REAPER_TEST_CONCURRENCY must be a whole number of files from 1 to 16, got ${JSON.stringify(process.env.REAPER_TEST_CONCURRENCY)}`);
    return 1;
  }
  console.log(`# ${concurrency} files at once in the parallel group (${process.env.REAPER_TEST_CONCURRENCY ? 'REAPER_TEST_CONCURRENCY' : `CPU ${(idleShare * 100).toFixed(0)} % idle over 1 s: ${busy ? 'busy' : 'idle'}`})`);
  const perTestTimeout = Number(process.versions.node.split('.')[0]) >= 22 ? [`--test-timeout=${timeoutMs}`] : ['--require', path.join(dist, 'test', 'support', 'timeouts.js')];
  const cpu = process.env.REAPER_TEST_CPU === '1' ? cpuSampler() : undefined;
  const cpuLog = path.join(path.dirname(skipLog), 'cpu');
  if (cpu) env.REAPER_TEST_CPU_LOG = cpuLog;
  const preload = [...perTestTimeout, ...(cpu ? ['--require', path.join(dist, 'test', 'support', 'cpu-usage.js')] : []), '--test-force-exit'];
  // The timed files two at once when idle: in the serial group, one at a time, the six of them took
  // 86 s with the machine about 25 % busy (2026-12-07, AMD host).
  const timedAtOnce = busy ? 1 : 2;
  const serial = files.filter((file) => file.endsWith('.serial.test.js'));
  const timed = files.filter((file) => file.endsWith('.timed.test.js'));
  const parallel = files.filter((file) => !file.endsWith('.serial.test.js') && !file.endsWith('.timed.test.js'));
  let status = 0;
  // Per-file durations (test/slowest-reporter.mjs) beside the usual output: the slowest are printed at the end.
  const timings = path.join(path.dirname(skipLog), 'timings');
  const reporters = [`--test-reporter=${process.stdout.isTTY ? 'spec' : 'tap'}`, '--test-reporter-destination=stdout', `--test-reporter=${path.join(root, 'test', 'slowest-reporter.mjs')}`, `--test-reporter-destination=${timings}`];
  const userReporter = flags.some((flag) => flag.startsWith('--test-reporter'));
  // One migrated database the test beds copy instead of each migrating its own
  // (test/support/template-database.ts): dropped when the files are done. Without one (the servers
  // not reachable yet, say) every test bed migrates as before and says why it could not, if it cannot.
  let template;
  if (!process.env.REAPER_TEST_TEMPLATE_DATABASE && files.some((file) => !file.includes(`${path.sep}unit${path.sep}`))) {
    const templates = require(path.join(dist, 'test', 'support', 'template-database.js'));
    template = await templates.makeTemplateDatabase().then(
      (name) => ({ name, drop: () => templates.dropTemplateDatabase(name) }),
      (error) => void console.log(`# no template database (each test bed migrates its own): ${error.message}`),
    );
    if (template) env[templates.TEMPLATE_DATABASE_VARIABLE] = template.name;
  }
  const byFile = new Map();
  // Each group's wall time, printed at the end (issue 43 item 4 measures npm test's time by them).
  const groupSeconds = [];
  for (const [group, atOnce, name] of [[parallel, concurrency, 'parallel'], [timed, timedAtOnce, 'timed'], [serial, 1, 'serial']]) {
    if (group.length === 0) continue;
    rmSync(timings, { force: true });
    const groupStarted = Date.now();
    const child = spawn(process.execPath, [...preload, '--test', `--test-concurrency=${atOnce}`, ...(userReporter ? [] : reporters), ...flags, ...group], { cwd: root, stdio: 'inherit', env });
    const sampling = cpu && setInterval(() => cpu.sample(child.pid), 500);
    const code = await new Promise((resolve) => child.on('close', resolve).on('error', () => resolve(null)));
    clearInterval(sampling);
    if (code !== 0) status = code ?? 1;
    groupSeconds.push(`${name} ${((Date.now() - groupStarted) / 1000).toFixed(0)} s (${group.length} files${name === 'timed' ? `, ${atOnce} at once` : ''})`);
    let lines = [];
    try {
      lines = readFileSync(timings, 'utf8').split('\n').filter(Boolean);
    } catch {
      // no timings (a user reporter, or nothing ran)
    }
    const spans = [];
    for (const line of lines) {
      const { file, ms, endedAt } = JSON.parse(line);
      byFile.set(file, (byFile.get(file) ?? 0) + ms);
      if (endedAt) spans.push({ file, start: endedAt - ms, end: endedAt });
    }
    if (name === 'parallel' && spans.length > atOnce) groupSeconds.push(`of which ${underUsedTail(spans, atOnce)}`);
  }
  const slowest = [...byFile].sort((a, b) => b[1] - a[1]).slice(0, 10);
  if (slowest.length > 0) {
    console.log(`# slowest files (seconds, each file start to end; ${concurrency} run at once in the parallel group):`);
    for (const [file, ms] of slowest) console.log(`#   ${(ms / 1000).toFixed(1).padStart(6)}  ${path.relative(dist, file)}`);
  }
  if (groupSeconds.length > 0) console.log(`# wall time: ${groupSeconds.join(', ')}`);
  if (cpu) {
    let lines = [];
    try {
      lines = readFileSync(cpuLog, 'utf8').split('\n').filter(Boolean);
    } catch {
      // no file's process reported
    }
    cpu.table(byFile, new Map(lines.map((line) => JSON.parse(line)).map(({ file, seconds }) => [file, seconds])));
  }
  let skips = [];
  try {
    skips = readFileSync(skipLog, 'utf8').split('\n').filter(Boolean);
  } catch {
    // no file: nothing was skipped
  }
  rmSync(path.dirname(skipLog), { recursive: true, force: true });
  await template?.drop().catch((error) => console.log(`# the template database ${template.name} was not dropped (the sweeper will): ${error.message}`));
  console.log(`# skipped for a missing tool: ${skips.length}${skips.length > 0 ? ' (REAPER_TEST_REQUIRE_ALL=1 makes these failures)' : ''}`);
  for (const line of skips) console.log(`#   ${line}`);
  return status;
}

main().then(
  (status) => process.exit(status),
  (error) => {
    console.error(error);
    process.exit(1);
  },
);
