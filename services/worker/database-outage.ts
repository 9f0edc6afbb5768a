import type { Logger } from 'pino';
import type { Pool } from '../../shared/db/pool';
import type { QueueConsumer } from './queue-consumer';

/**
 * When the database is unreachable the worker stops consuming, so an outage costs each in-flight
 * batch one delivery, not its whole delivery limit, and consumes again once `SELECT 1` answers.
 */
export interface DatabaseOutage {
  /** Cancels every consumer (once, whichever batch noticed first); resolves when they are cancelled. */
  pause(): Promise<void>;
  /** The pause under way, until consumption resumes; null while consuming. */
  readonly pausing: Promise<void> | null;
  /** Probes until `SELECT 1` works again, then consumes again; redelivered batches then find the database. */
  resumeWhenDatabaseAnswers(): Promise<void>;
}

export function makeDatabaseOutage(deps: { pool: Pool; consumer: QueueConsumer; log: Logger; stopping: () => boolean }): DatabaseOutage {
  const { pool, consumer, log } = deps;
  let pausing: Promise<void> | null = null;
  let probing = false;
  return {
    pause() {
      if (pausing) return pausing;
      log.warn('database unavailable: consumption paused');
      pausing = consumer.pause();
      return pausing;
    },
    get pausing() {
      return pausing;
    },
    async resumeWhenDatabaseAnswers() {
      if (probing) return;
      probing = true;
      for (let attempt = 0; !deps.stopping(); attempt++) {
        try {
          await pool.query('SELECT 1');
          break;
        } catch {
          await new Promise((resolve) => setTimeout(resolve, Math.min(5_000, 250 * 2 ** attempt)));
        }
      }
      pausing = null;
      probing = false;
      log.info('database answers again: consumption resumed');
      await consumer.resume();
    },
  };
}
