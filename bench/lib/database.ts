import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { migrate } from '../../shared/db/migrate';
import { demoTablesCreate } from '../../shared/db/queries/demo-tables';

/**
 * The benchmark's own databases. The seed is generated once per size into the seed database, then
 * every contender gets the bench database as a file copy of it (CREATE DATABASE ... TEMPLATE):
 * byte-identical rows, indexes, statistics and visibility map for reaper, the raw DELETE and pg-boss
 * alike, and far cheaper than inserting millions of rows again before each contender.
 *
 * Both names carry a random suffix per run (like the broker prefix): two benchmark runs on one
 * server (two engineers, two worktrees) would otherwise drop each other's databases mid-figure.
 * A run creates and drops only its own two names.
 */

/** reaper_bench_<8 hex> and reaper_bench_<8 hex>_seed: lower case, so no quoting is needed. */
export function benchDatabaseNames(): { bench: string; seed: string } {
  const suffix = randomBytes(4).toString('hex');
  return { bench: `reaper_bench_${suffix}`, seed: `reaper_bench_${suffix}_seed` };
}

/** What one seed holds. Only `candidates` rows are expired AND held; every other row must survive. */
export interface Seed {
  candidates: number;
  futureHeld: number;
  expiredConfirmed: number;
  totalRows: number;
  seedSeconds: number;
}

export function databaseUrl(adminUrl: string, database: string): string {
  const url = new URL(adminUrl);
  url.pathname = `/${database}`;
  return url.toString();
}

export async function withAdmin<T>(adminUrl: string, work: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: adminUrl, application_name: 'reaper-bench-admin' });
  await client.connect();
  try {
    return await work(client);
  } finally {
    await client.end();
  }
}


/**
 * application_name of the benchmark's own connections that watch a contender (run-state polls, the
 * CPU meters' backend lists, figure 7's wait sampler). They start with "reaper " (a space, not
 * "reaper-"): reaper's adaptive admission leaves sessions named reaper... out of the application's
 * load, as it leaves out its own, and these are the measurement, not the application (at 20 Hz the
 * wait sampler alone kept a statement running in a few percent of reaper's samples, read as load);
 * the CPU meters count reaper's backends by "reaper-%", which these do not match.
 */
export const OBSERVER_APPLICATION = 'reaper bench observer';
export const SAMPLER_APPLICATION = 'reaper bench sampler';

export class BenchDatabases {
  readonly url: string;
  /** The seed database: a figure with a table of its own adds it here after seed() (then fresh() copies it). */
  readonly seedUrl: string;
  /** This run's bench database (every contender's copy of the seed). */
  readonly name: string;
  private readonly seedName: string;

  constructor(
    readonly adminUrl: string,
    names = benchDatabaseNames(),
  ) {
    this.name = names.bench;
    this.seedName = names.seed;
    this.url = databaseUrl(adminUrl, this.name);
    this.seedUrl = databaseUrl(adminUrl, this.seedName);
  }

  /**
   * Seeds `candidates` expired held rows plus as many rows that must NOT be deleted (half held
   * until the year 2999, half expired but confirmed), interleaved in the heap as real traffic
   * would leave them. Everything is a function of the row number: the same size always gives the
   * same ids and expiries. Expiries carry microseconds (a millisecond copy would match nothing).
   */
  async seed(candidates: number): Promise<Seed> {
    if (candidates % 2 !== 0) throw new Error(`candidates must be even (got ${candidates})`);
    const started = Date.now();
    await this.dropAll();
    await withAdmin(this.adminUrl, (admin) => admin.query(`CREATE DATABASE ${this.seedName}`));
    await migrate(this.seedUrl);
    const client = new pg.Client({ connectionString: this.seedUrl, application_name: 'reaper-bench-seed' });
    await client.connect();
    try {
      await demoTablesCreate(client);
      // Row i: i % 4 in {0, 1} expired held (the candidates), 2 held until 2999, 3 expired but confirmed.
      // Expiry = base + i ms + (i * 7919 mod 997) us: strictly increasing in i, sub-millisecond digits set.
      await client.query(
        `INSERT INTO seat_reservations (reservation_id, status, expires_at, seat, holder, created_at, updated_at)
         SELECT md5('bench-hold-' || i)::uuid,
                CASE WHEN i % 4 = 3 THEN 'confirmed' ELSE 'held' END,
                CASE WHEN i % 4 = 2 THEN timestamptz '2999-01-01 00:00:00+00' ELSE timestamptz '2020-01-01 00:00:00+00' END
                  + (i * 1000 + (i * 7919) % 997) * interval '1 microsecond',
                'seat-' || i, 'guest-' || (i % 10007),
                timestamptz '2019-12-31 00:00:00+00', timestamptz '2019-12-31 00:00:00+00'
         FROM generate_series(1::bigint, $1::bigint) AS i`,
        [candidates * 2],
      );
      // Statistics and the visibility map are copied with the files: every clone starts planned and vacuumed.
      await client.query('VACUUM (ANALYZE) seat_reservations');
    } finally {
      await client.end();
    }
    return {
      candidates,
      futureHeld: candidates / 2,
      expiredConfirmed: candidates / 2,
      totalRows: candidates * 2,
      seedSeconds: (Date.now() - started) / 1000,
    };
  }

  /** The bench database anew, as a file copy of the seed (FILE_COPY: a checkpoint and a copy, no WAL for the data). */
  async fresh(): Promise<void> {
    await withAdmin(this.adminUrl, async (admin) => {
      await admin.query(`DROP DATABASE IF EXISTS ${this.name} WITH (FORCE)`);
      await admin.query(`CREATE DATABASE ${this.name} TEMPLATE ${this.seedName} STRATEGY FILE_COPY`);
    });
  }

  /** Drops this run's two databases, never another run's. */
  async dropAll(): Promise<void> {
    await withAdmin(this.adminUrl, async (admin) => {
      await admin.query(`DROP DATABASE IF EXISTS ${this.name} WITH (FORCE)`);
      await admin.query(`DROP DATABASE IF EXISTS ${this.seedName} WITH (FORCE)`);
    });
  }

  pool(max: number, applicationName: string): pg.Pool {
    const pool = new pg.Pool({ connectionString: this.url, max, application_name: applicationName });
    pool.on('error', () => undefined); // an idle client killed by DROP DATABASE ... FORCE is expected
    return pool;
  }
}

/** The database clock as reaper writes it: UTC ISO 8601 with six fractional digits. */
export async function databaseNowIso(db: pg.Pool | pg.Client): Promise<string> {
  return (await db.query<{ now: string }>('SELECT reaper_iso(clock_timestamp()) AS now')).rows[0]!.now;
}

export interface RowCounts {
  expiredHeldLeft: number;
  futureHeldLeft: number;
  expiredConfirmedLeft: number;
}

export async function countSeatRows(db: pg.Pool): Promise<RowCounts> {
  const row = (
    await db.query<{ expired_held: number; future_held: number; expired_confirmed: number }>(
      `SELECT count(*) FILTER (WHERE status = 'held' AND expires_at < timestamptz '2100-01-01')::int AS expired_held,
              count(*) FILTER (WHERE status = 'held' AND expires_at >= timestamptz '2100-01-01')::int AS future_held,
              count(*) FILTER (WHERE status = 'confirmed')::int AS expired_confirmed
       FROM seat_reservations`,
    )
  ).rows[0]!;
  return { expiredHeldLeft: row.expired_held, futureHeldLeft: row.future_held, expiredConfirmedLeft: row.expired_confirmed };
}

/**
 * The (expiry, key) of the n-th candidate in scan order: a cutoff that makes a run see exactly the
 * first n candidates (the seed's expiries are unique).
 */
export async function cutoffAfterCandidates(db: pg.Pool, n: number): Promise<string> {
  const result = await db.query<{ expiry: string }>(
    `SELECT reaper_iso(expires_at) AS expiry FROM seat_reservations WHERE status = 'held' AND expires_at < timestamptz '2100-01-01'
     ORDER BY expires_at, reservation_id OFFSET $1 LIMIT 1`,
    [n - 1],
  );
  if (!result.rows[0]) throw new Error(`fewer than ${n} candidates`);
  return result.rows[0].expiry;
}

/**
 * `count` expired, active media assets `<prefix><i>` (expiries an hour ago, one per millisecond with
 * sub-millisecond jitter), for the remote-delete figures. With `url`, each gets
 * `https://media.invalid/<asset id>` (the media API's figures); without, none (object storage).
 */
export async function seedExpiredAssets(db: pg.Pool, options: { prefix: string; count: number; url: boolean }): Promise<void> {
  await db.query(
    `INSERT INTO media_assets (asset_id, status, retention_expires_at, url)
     SELECT $2 || i, 'active', now() - interval '1 hour' + i * interval '1 millisecond' + random() * interval '1 millisecond',
            CASE WHEN $3 THEN 'https://media.invalid/' || $2 || i END
     FROM generate_series(1, $1) i`,
    [options.count, options.prefix, options.url],
  );
}
