import { appendFileSync, readFileSync } from 'node:fs';

/**
 * With REAPER_TEST_CPU=1, preloaded into every test file's process by test/run.js (`--require`,
 * like timeouts.ts). When the file's process exits it appends one JSON line to the file named by
 * REAPER_TEST_CPU_LOG: the file and the CPU seconds of its process plus those of every process it
 * spawned and reaped (the kernel's cutime/cstime, i.e. RUSAGE_CHILDREN: services, CLI runs, psql,
 * pgbench). Processes still running at the exit are not in it. Linux only (/proc); elsewhere nothing.
 */
const log = process.env.REAPER_TEST_CPU_LOG;
// Not in the runner itself (`node --test`, which loads the preload too and whose children are all the files).
if (log && !process.execArgv.includes('--test')) {
  process.on('exit', () => {
    try {
      const stat = readFileSync('/proc/self/stat', 'utf8');
      const [utime, stime, cutime, cstime] = stat.slice(stat.lastIndexOf(')') + 2).split(' ').slice(11, 15).map(Number) as [number, number, number, number];
      // Clock ticks: 100 a second on every Linux build Node runs on.
      const seconds = (utime + stime + cutime + cstime) / 100;
      appendFileSync(log, `${JSON.stringify({ file: process.argv[1], seconds })}\n`);
    } catch {
      // not Linux: no line
    }
  });
}
