/** How the CLI prints for people and for programs: JSON, aligned tables, durations, wrapped lines. */

/** Prints a result as JSON (--json) or as aligned text for people. */
export function printResult(json: boolean, value: unknown, asText: () => string): void {
  process.stdout.write(json ? `${JSON.stringify(value, null, 2)}\n` : `${asText()}\n`);
}

export function table(rows: ReadonlyArray<object>, columns: string[]): string {
  if (rows.length === 0) return '(none)';
  const cells = rows.map((row) => columns.map((column) => formatCell((row as Record<string, unknown>)[column])));
  const widths = columns.map((column, index) => Math.max(column.length, ...cells.map((line) => line[index]!.length)));
  const line = (values: string[]) => values.map((value, index) => value.padEnd(widths[index]!)).join('  ').trimEnd();
  return [line(columns), ...cells.map(line)].join('\n');
}

function formatCell(value: unknown): string {
  if (value === null || value === undefined) return '-';
  return String(value);
}

/**
 * The width human output is laid out for: the terminal's, or 120 columns when stdout is not a
 * terminal (a pipe, a log, a test), so what is captured reads the same everywhere.
 */
export function outputWidth(): number {
  return process.stdout.isTTY && process.stdout.columns ? process.stdout.columns : 120;
}

/**
 * `text` broken at spaces into lines of at most `width` characters (a word longer than a line is
 * cut, never lost), every line after the first indented by `indent` spaces.
 */
export function wrap(text: string, width: number, indent = 0): string {
  const lines: string[] = [];
  let line = '';
  const room = () => width - (lines.length === 0 ? 0 : indent);
  for (const word of text.split(/\s+/).filter((part) => part !== '')) {
    let rest = word;
    while (rest !== '') {
      const candidate = line === '' ? rest : `${line} ${rest}`;
      if (candidate.length <= room()) {
        line = candidate;
        rest = '';
      } else if (line !== '') {
        lines.push(line);
        line = '';
      } else {
        lines.push(rest.slice(0, room()));
        rest = rest.slice(room());
      }
    }
  }
  if (line !== '' || lines.length === 0) lines.push(line);
  return lines.map((text, index) => (index === 0 ? text : `${' '.repeat(indent)}${text}`)).join('\n');
}

/**
 * A duration for people: `850ms`, `4.2s`, `42s`, `4m05s`, `23h51m`, `3d04h`. Whole seconds round
 * up (an ETA of 59.2 s is `1m00s`, never an early `59s`).
 */
export function formatDuration(seconds: number): string {
  if (!Number.isFinite(seconds)) return '?';
  if (seconds <= 0) return '0s';
  if (seconds < 1) return `${Math.max(1, Math.round(seconds * 1000))}ms`;
  if (seconds < 10) return `${(Math.ceil(seconds * 10) / 10).toFixed(1).replace(/\.0$/, '')}s`;
  const s = Math.ceil(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  if (s < 48 * 3600) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
  return `${Math.floor(s / 86400)}d${String(Math.floor((s % 86400) / 3600)).padStart(2, '0')}h`;
}

/** Fields every log line carries that say nothing to the person at the terminal. */
const LOG_LINE_PLUMBING = new Set(['level', 'time', 'pid', 'hostname', 'service', 'workerId', 'msg']);
const LOG_LEVEL_WORDS: Record<number, string> = { 10: 'trace', 20: 'debug', 30: 'info', 40: 'warning', 50: 'error', 60: 'fatal' };

/**
 * A pino destination for a CLI command in front of a person: each JSON log line becomes one line
 * of text on `stream`, `reaper: warning: <message> (key value, ...)`, so no raw JSON mixes with
 * what the command prints. A line that is not JSON passes through as it is.
 */
export function humanLogDestination(stream: NodeJS.WritableStream): { write(line: string): void } {
  return {
    write(line) {
      let entry: Record<string, unknown>;
      try {
        entry = JSON.parse(line) as Record<string, unknown>;
      } catch {
        stream.write(line); // not a log line (nothing in reaper writes one): shown unchanged
        return;
      }
      const details = Object.entries(entry)
        .filter(([key]) => !LOG_LINE_PLUMBING.has(key))
        .map(([key, value]) => `${key} ${typeof value === 'string' ? value : JSON.stringify(value)}`);
      const level = LOG_LEVEL_WORDS[entry.level as number] ?? String(entry.level);
      stream.write(`reaper: ${level}: ${String(entry.msg ?? '')}${details.length > 0 ? ` (${details.join(', ')})` : ''}\n`);
    },
  };
}
