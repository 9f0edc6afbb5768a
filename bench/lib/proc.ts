import { readFileSync, readdirSync } from 'node:fs';

/**
 * Linux /proc readers: memory and CPU of the processes the benchmark starts (and of the servers it
 * talks to). Everything here reads counters the kernel keeps anyway, so sampling costs the
 * measured processes nothing.
 */

/** Clock ticks per second for utime/stime in /proc/<pid>/stat (USER_HZ; 100 on every Linux we run on). */
const CLOCK_TICKS = 100;

/** VmHWM (peak resident set) and VmRSS of a live process, in MiB; null when it is gone. */
export function memoryOf(pid: number): { peakRssMb: number; rssMb: number } | null {
  let status: string;
  try {
    status = readFileSync(`/proc/${pid}/status`, 'utf8');
  } catch {
    return null; // exited between our decision to look and the read
  }
  const field = (name: string): number => {
    const match = new RegExp(`^${name}:\\s+(\\d+) kB`, 'm').exec(status);
    return match ? Number(match[1]) / 1024 : 0;
  };
  return { peakRssMb: field('VmHWM'), rssMb: field('VmRSS') };
}

/** User plus system CPU seconds a live process has used so far; 0 when it is gone. */
export function cpuSecondsOf(pid: number): number {
  let stat: string;
  try {
    stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  } catch {
    return 0; // exited: its CPU is no longer attributable, and callers sample before stopping
  }
  // The command name (field 2) may contain spaces and parentheses: fields are counted after the last ')'.
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  // After the name: state is field 3, so utime (14) and stime (15) are at offsets 11 and 12.
  return (Number(fields[11]) + Number(fields[12])) / CLOCK_TICKS;
}

/** Pids whose command name (from /proc/<pid>/comm) is `name`, e.g. RabbitMQ's "beam.smp". */
export function pidsNamed(name: string): number[] {
  const pids: number[] = [];
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      if (readFileSync(`/proc/${entry}/comm`, 'utf8').trim() === name) pids.push(Number(entry));
    } catch {
      // The process ended while we listed /proc: not ours to count.
    }
  }
  return pids;
}

/** The RabbitMQ server's pid: the beam.smp that booted rabbit (rabbitmqctl runs a short-lived beam.smp too). */
export function rabbitmqServerPid(): number | null {
  for (const pid of pidsNamed('beam.smp')) {
    try {
      if (readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').join(' ').includes('rabbit boot')) return pid;
    } catch {
      // Ended while we looked: not the server.
    }
  }
  return null;
}
