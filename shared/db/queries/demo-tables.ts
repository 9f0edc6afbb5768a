
/**
 * The demo's own tables: seat_reservations (row-delete policy "seat-holds") and media_assets
 * (remote-delete policy "media-assets"). They belong to the demo, the tests and the benchmark, not
 * to reaper, so `reaper migrate` does not create them in production databases; `reaper migrate
 * --with-demo-tables`, `reaper demo`, the test beds and the benchmark do. Idempotent.
 */
const DEMO_TABLES_SQL = `
-- The demo policy "seat-holds": holds on seats that lapse unless confirmed.
CREATE TABLE IF NOT EXISTS seat_reservations (
  reservation_id uuid PRIMARY KEY,
  status         text NOT NULL CHECK (status IN ('held', 'confirmed')),
  expires_at     timestamptz NOT NULL,
  seat           text,
  holder         text,
  created_at     timestamptz NOT NULL DEFAULT now(),
  updated_at     timestamptz NOT NULL DEFAULT now()
);
-- The scan reads held rows in (expiry, key) order from a keyset cursor; this index serves it whole.
CREATE INDEX IF NOT EXISTS seat_reservations_held_by_expiry
  ON seat_reservations (expires_at, reservation_id) WHERE status = 'held';

-- The demo policy "media-assets": media whose bytes live in a rate-limited remote API.
CREATE TABLE IF NOT EXISTS media_assets (
  asset_id             text PRIMARY KEY,
  status               text NOT NULL,            -- 'active' | 'deleted' (the demo marks confirmed deletions)
  retention_expires_at timestamptz NOT NULL,
  url                  text,
  metadata             jsonb,
  created_at           timestamptz NOT NULL DEFAULT now(),
  updated_at           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS media_assets_active_by_expiry
  ON media_assets (retention_expires_at, asset_id) WHERE status = 'active';
`;

/** Any connection: a pool, a pooled client or a plain client (the test beds and the benchmark use one). */
export async function demoTablesCreate(db: { query(text: string): Promise<unknown> }): Promise<void> {
  await db.query(DEMO_TABLES_SQL);
}

/**
 * Who the services' sessions on this database log in as, by application name (`reaper-scheduler`,
 * `reaper-worker`): the demo reads it while its services run to show they run as their roles.
 */
export async function serviceSessionUsers(db: { query<R extends object>(text: string): Promise<{ rows: R[] }> }): Promise<Map<string, string[]>> {
  const { rows } = await db.query<{ app: string; users: string[] }>(
    `SELECT application_name AS app, array_agg(DISTINCT usename::text ORDER BY usename::text) AS users
       FROM pg_stat_activity
      WHERE datname = current_database() AND application_name IN ('reaper-scheduler', 'reaper-worker')
      GROUP BY application_name`,
  );
  return new Map(rows.map((row) => [row.app, row.users]));
}
