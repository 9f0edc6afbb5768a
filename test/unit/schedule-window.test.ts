/**
 * Unit tests for schedule windows (shared/schedule/window.ts) and the policy key `window`: open or
 * closed at an instant, the next opening and closing, across midnight and on both DST change days
 * of Europe/Berlin, and validation that names the field and the value.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ConfigError } from '../../shared/config/errors';
import { parsePolicies } from '../../shared/config/policies';
import { windowIsOpen, windowStateAt, type ScheduleWindow } from '../../shared/schedule/window';
import { DELAY_TIERS_MS } from '../../shared/amqp/topology';
import { outsideWindow } from '../../services/worker/window-gate';

const at = (iso: string) => new Date(iso);
const BERLIN_NIGHT: ScheduleWindow = { start: '01:00', end: '05:00', timeZone: 'Europe/Berlin' };

function state(window: ScheduleWindow, iso: string): string {
  const found = windowStateAt(window, at(iso));
  return found.open ? `open until ${found.closesAt?.toISOString()}` : `closed until ${found.opensAt.toISOString()}`;
}

test('a window within a day, in winter (CET, UTC+1): open from start to end local time', () => {
  // 01:00-05:00 Berlin in winter is 00:00-04:00 UTC.
  assert.equal(state(BERLIN_NIGHT, '2026-01-15T23:59:59Z'), 'closed until 2026-01-16T00:00:00.000Z');
  assert.equal(state(BERLIN_NIGHT, '2026-01-16T00:00:00Z'), 'open until 2026-01-16T04:00:00.000Z');
  assert.equal(state(BERLIN_NIGHT, '2026-01-16T03:59:59Z'), 'open until 2026-01-16T04:00:00.000Z');
  assert.equal(state(BERLIN_NIGHT, '2026-01-16T04:00:00Z'), 'closed until 2026-01-17T00:00:00.000Z');
  // In summer (CEST, UTC+2) the same window is 23:00-03:00 UTC.
  assert.equal(state(BERLIN_NIGHT, '2026-07-15T22:59:00Z'), 'closed until 2026-07-15T23:00:00.000Z');
  assert.equal(state(BERLIN_NIGHT, '2026-07-15T23:30:00Z'), 'open until 2026-07-16T03:00:00.000Z');
});

test('a window across midnight is open late in the evening and early in the morning', () => {
  const overnight: ScheduleWindow = { start: '22:00', end: '04:00', timeZone: 'UTC' };
  assert.equal(state(overnight, '2026-03-10T21:59:59Z'), 'closed until 2026-03-10T22:00:00.000Z');
  assert.equal(state(overnight, '2026-03-10T22:00:00Z'), 'open until 2026-03-11T04:00:00.000Z');
  assert.equal(state(overnight, '2026-03-11T00:00:00Z'), 'open until 2026-03-11T04:00:00.000Z');
  assert.equal(state(overnight, '2026-03-11T03:59:59Z'), 'open until 2026-03-11T04:00:00.000Z');
  assert.equal(state(overnight, '2026-03-11T04:00:00Z'), 'closed until 2026-03-11T22:00:00.000Z');
  assert.equal(state(overnight, '2026-03-11T12:00:00Z'), 'closed until 2026-03-11T22:00:00.000Z');
});

test('DST forward (Berlin, 2026-03-29 02:00 -> 03:00): the window follows local time, 3 hours long that night', () => {
  // Opens 01:00 CET = 00:00Z; 05:00 CEST = 03:00Z: open 3 hours of real time, not 4.
  assert.equal(state(BERLIN_NIGHT, '2026-03-28T23:30:00Z'), 'closed until 2026-03-29T00:00:00.000Z');
  assert.equal(state(BERLIN_NIGHT, '2026-03-29T00:00:00Z'), 'open until 2026-03-29T03:00:00.000Z');
  assert.equal(windowIsOpen(BERLIN_NIGHT, at('2026-03-29T02:59:59Z')), true);
  assert.equal(windowIsOpen(BERLIN_NIGHT, at('2026-03-29T03:00:00Z')), false);
  // The next night is in summer time: 23:00Z.
  assert.equal(state(BERLIN_NIGHT, '2026-03-29T03:00:00Z'), 'closed until 2026-03-29T23:00:00.000Z');
});

test('DST forward: a start inside the skipped hour opens at the jump', () => {
  const skipped: ScheduleWindow = { start: '02:30', end: '04:00', timeZone: 'Europe/Berlin' };
  // 02:30 does not exist on 2026-03-29; the clocks jump at 01:00Z from 02:00 CET to 03:00 CEST.
  assert.equal(state(skipped, '2026-03-29T00:10:00Z'), 'closed until 2026-03-29T01:00:00.000Z');
  assert.equal(windowIsOpen(skipped, at('2026-03-29T00:59:59Z')), false);
  assert.equal(state(skipped, '2026-03-29T01:00:00Z'), 'open until 2026-03-29T02:00:00.000Z');
});

test('DST back (Berlin, 2026-10-25 03:00 -> 02:00): the window is 5 hours long that night, a repeated hour opens twice', () => {
  // 01:00 CEST = 23:00Z the day before; 05:00 CET = 04:00Z.
  assert.equal(state(BERLIN_NIGHT, '2026-10-24T22:59:00Z'), 'closed until 2026-10-24T23:00:00.000Z');
  assert.equal(state(BERLIN_NIGHT, '2026-10-24T23:00:00Z'), 'open until 2026-10-25T04:00:00.000Z');
  assert.equal(windowIsOpen(BERLIN_NIGHT, at('2026-10-25T03:59:59Z')), true);
  const repeated: ScheduleWindow = { start: '02:00', end: '02:45', timeZone: 'Europe/Berlin' };
  assert.equal(state(repeated, '2026-10-25T00:00:00Z'), 'open until 2026-10-25T00:45:00.000Z');
  assert.equal(state(repeated, '2026-10-25T00:50:00Z'), 'closed until 2026-10-25T01:00:00.000Z');
  assert.equal(state(repeated, '2026-10-25T01:00:00Z'), 'open until 2026-10-25T01:45:00.000Z');
  assert.equal(state(repeated, '2026-10-25T01:45:00Z'), 'closed until 2026-10-26T01:00:00.000Z');
});

test('seconds are honoured, and no window means always open', () => {
  const short: ScheduleWindow = { start: '12:00:10', end: '12:00:30', timeZone: 'UTC' };
  assert.equal(state(short, '2026-05-01T12:00:09Z'), 'closed until 2026-05-01T12:00:10.000Z');
  assert.equal(state(short, '2026-05-01T12:00:29.999Z'), 'open until 2026-05-01T12:00:30.000Z');
  assert.equal(state(short, '2026-05-01T12:00:30Z'), 'closed until 2026-05-02T12:00:10.000Z');
  assert.deepEqual(windowStateAt(undefined, at('2026-05-01T12:00:00Z')), { open: true, closesAt: null });
});

const policyWith = (window: string) => `
policies:
  - name: seat-holds
    kind: row-delete
    schedule: "* * * * *"
    table: seat_reservations
    key: reservation_id
    expiresAt: expires_at
    window: ${window}
`;

test('policy key window: parsed when valid, refused naming the field and the value otherwise', () => {
  const parsed = parsePolicies(policyWith('{ start: "01:00", end: "05:00", timeZone: "Europe/Berlin" }'), 'p.yaml', {});
  assert.deepEqual(parsed.get('seat-holds')!.window, BERLIN_NIGHT);
  const refused = (window: string, pattern: RegExp) =>
    assert.throws(() => parsePolicies(policyWith(window), 'p.yaml', {}), (error: Error) => error instanceof ConfigError && pattern.test(error.message));
  refused('{ start: "25:00", end: "05:00", timeZone: "UTC" }', /policies\.0\.window\.start: must be a time of day .*\(got "25:00"\)/);
  refused('{ start: "1:00", end: "05:00", timeZone: "UTC" }', /policies\.0\.window\.start: .*\(got "1:00"\)/);
  refused('{ start: "01:00", end: "05:60", timeZone: "UTC" }', /policies\.0\.window\.end: .*\(got "05:60"\)/);
  refused('{ start: "01:00", end: "05:00", timeZone: "Europe/Berlinn" }', /policies\.0\.window\.timeZone: must be an IANA time zone .*\(got "Europe\/Berlinn"\)/);
  refused('{ start: "01:00", end: "01:00", timeZone: "UTC" }', /policies\.0\.window\.end: start and end must differ .*\(got "01:00"\)/);
  refused('{ start: "01:00", end: "05:00", timeZone: "UTC", days: 1 }', /policies\.0\.window/);
});

test('worker gate: outside the window a batch goes to a delay tier until the opening, capped by the longest tier', () => {
  const policy = parsePolicies(policyWith('{ start: "01:00", end: "05:00", timeZone: "UTC" }'), 'p.yaml', {}).get('seat-holds')!;
  assert.equal(outsideWindow(policy, at('2026-05-01T02:00:00Z')), null, 'open: the handler runs');
  const soon = outsideWindow(policy, at('2026-05-01T00:59:40Z'));
  assert.equal(soon?.delayMs, 20_000, 'the time until the opening');
  assert.match(soon!.reason, /^outside window \(01:00-05:00 UTC\), opens at 2026-05-01T01:00:00\.000Z$/);
  assert.equal(outsideWindow(policy, at('2026-05-01T12:00:00Z'))?.delayMs, DELAY_TIERS_MS[DELAY_TIERS_MS.length - 1], 'capped by the longest tier');
  assert.equal(outsideWindow({ ...policy, window: undefined }, at('2026-05-01T12:00:00Z')), null, 'no window: always admitted');
});
