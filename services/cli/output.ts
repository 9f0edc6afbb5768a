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
