import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { BACKLOG_PASS_DUTY, backlogPassGapMs } from '../../services/scheduler/backlog-gauges';

describe('backlog gauges: the gap between two passes', () => {
  test('the configured interval while a pass is cheap', () => {
    assert.equal(backlogPassGapMs(10_000, 5), 10_000);
    assert.equal(backlogPassGapMs(10_000, 100), 10_000);
  });

  test('at least BACKLOG_PASS_DUTY times the last pass once it is slow: the gauges stay within 1% of one connection', () => {
    assert.equal(BACKLOG_PASS_DUTY, 100);
    assert.equal(backlogPassGapMs(10_000, 330), 33_000);
    for (const passMs of [101, 330, 2_000, 60_000]) {
      const gap = backlogPassGapMs(10_000, passMs);
      assert.ok(passMs / (passMs + gap) <= 1 / BACKLOG_PASS_DUTY, `${passMs} ms pass, ${gap} ms gap`);
    }
  });
});
