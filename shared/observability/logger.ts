import type { DestinationStream, Logger } from 'pino';
import { pinoModule } from '../lazy-modules';

export type { Logger };

/** Replaces the password in a connection URL, so URLs can be logged. Not a URL: returned as is. */
export function redactUrl(value: string): string {
  try {
    const url = new URL(value);
    if (url.password) url.password = '***';
    return url.toString();
  } catch {
    // Not a URL (a path, a host name): nothing to redact.
    return value;
  }
}

/** JSON logs on stdout; every line of a service carries its name and worker id. */
export function makeLogger(options: { level: string; service: string; workerId?: string }, destination?: DestinationStream): Logger {
  const pino = pinoModule().default;
  return pino(
    {
    level: options.level,
    base: { service: options.service, ...(options.workerId ? { workerId: options.workerId } : {}) },
    // Belt and braces: URLs are passed through redactUrl, and these keys never print at all.
    redact: { paths: ['password', '*.password', 'databaseUrl', 'amqpUrl', 'webhookSecret', 'headers.authorization'], censor: '***' },
    timestamp: pino.stdTimeFunctions.isoTime,
    },
    destination ?? pino.destination(1),
  );
}
