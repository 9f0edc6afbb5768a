import { formatDuration } from './output';

/**
 * The `--execute` progress line: candidates confirmed by the broker (checkpointed) of the candidates
 * counted before the scan, batches confirmed, rate and ETA. Drawn only on a terminal (stderr is a
 * TTY) and never with --json: piped output stays exactly what it was.
 */

export interface ProgressSnapshot {
  /** Candidates in confirmed, checkpointed windows. */
  confirmed: number;
  /** Candidates the plan counted before the scan (null: not counted). */
  counted: number | null;
  batches: number;
  elapsedMs: number;
}

const BAR_WIDTH = 24;

export function renderProgress(snapshot: ProgressSnapshot): string {
  const { confirmed, counted, batches, elapsedMs } = snapshot;
  const seconds = elapsedMs / 1000;
  const rate = seconds > 0 ? confirmed / seconds : 0;
  // Rows can expire while the scan runs (the count is a lower bound) or change (an upper one): clamp.
  const fraction = counted && counted > 0 ? Math.min(1, confirmed / counted) : confirmed > 0 || counted === 0 ? 1 : 0;
  const filled = Math.round(fraction * BAR_WIDTH);
  const bar = `[${'#'.repeat(filled)}${'-'.repeat(BAR_WIDTH - filled)}]`;
  const of = counted === null ? `${confirmed}` : `${confirmed}/${counted}`;
  const left = counted === null ? null : Math.max(0, counted - confirmed);
  const eta = left === null ? '?' : left === 0 ? '0s' : rate > 0 ? formatDuration(left / rate) : '?';
  return `${bar} ${of} candidates, ${batches} batches confirmed, ${Math.round(rate)}/s, ETA ${eta}`;
}

/** Redraws one line on a terminal stream; `done()` ends it with a newline. */
export function makeProgressLine(stream: NodeJS.WriteStream): { draw(text: string): void; done(): void } {
  let drawn = false;
  return {
    draw(text) {
      stream.write(`\r\x1b[2K${text}`);
      drawn = true;
    },
    done() {
      if (drawn) stream.write('\n');
      drawn = false;
    },
  };
}
