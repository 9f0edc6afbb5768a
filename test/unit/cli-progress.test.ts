import assert from 'node:assert/strict';
import { test } from 'node:test';
import { renderProgress } from '../../services/cli/progress';
import { formatDuration } from '../../services/cli/output';

test('the --execute progress line: candidates confirmed of counted, batches, rate and ETA', () => {
  assert.equal(
    renderProgress({ confirmed: 1_000, counted: 4_000, batches: 10, elapsedMs: 2_000 }),
    '[######------------------] 1000/4000 candidates, 10 batches confirmed, 500/s, ETA 6s',
  );
  // Nothing counted (the count failed): no bar fraction, no ETA.
  assert.match(renderProgress({ confirmed: 0, counted: null, batches: 0, elapsedMs: 0 }), /^\[-{24}\] 0 candidates, 0 batches confirmed, 0\/s, ETA \?$/);
  // More confirmed than counted (rows expired during the scan): full, never past it.
  assert.match(renderProgress({ confirmed: 120, counted: 100, batches: 2, elapsedMs: 1_000 }), /^\[#{24}\] 120\/100 .* ETA 0s$/);
  assert.equal(formatDuration(59.2), '1m00s');
  assert.equal(formatDuration(3_725), '1h02m');
});
