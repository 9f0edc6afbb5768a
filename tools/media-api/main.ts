/**
 * Runs the stand-in media API as its own process (demo, benchmark).
 *
 *   node dist/tools/media-api/main.js [--port N] [--rate R] [--burst B]
 *
 * Prints one JSON line `{"url": "http://127.0.0.1:PORT"}` to stdout once
 * listening, and closes cleanly on SIGTERM / SIGINT.
 */
import { parseArgs } from 'node:util';
import { startMediaApi, type MediaApiOptions } from './server';

function numberFlag(name: string, raw: string | undefined): number | undefined {
  if (raw === undefined) return undefined;
  const value = Number(raw);
  if (raw.trim() === '' || !Number.isFinite(value) || value < 0) {
    throw new Error(`--${name} must be a non-negative number, got ${JSON.stringify(raw)}`);
  }
  return value;
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      port: { type: 'string' },
      rate: { type: 'string' },
      burst: { type: 'string' },
    },
    strict: true,
  });

  const options: MediaApiOptions = {
    port: numberFlag('port', values.port) ?? 0,
    ratePerSecond: numberFlag('rate', values.rate),
    burst: numberFlag('burst', values.burst),
  };
  const api = await startMediaApi(options);
  process.stdout.write(`${JSON.stringify({ url: api.url })}\n`);

  const shutdown = (): void => {
    api.close().then(
      () => process.exit(0),
      (err: unknown) => {
        console.error(err);
        process.exit(1);
      },
    );
  };
  process.once('SIGTERM', shutdown);
  process.once('SIGINT', shutdown);
}

main().catch((err: unknown) => {
  console.error(err instanceof Error ? err.message : err);
  process.exit(1);
});
