import { after, before } from 'node:test';
import pino from 'pino';
import { ReconnectingConnection } from '../../shared/amqp/connection';
import { makeTopology } from '../../shared/amqp/topology';
import { openTestBroker, type TestBroker } from './broker';
import { makeTestBed, type TestBed } from './testbed';

/** What a suite that drives the run executor in-process needs: its own database and broker prefix, a broker client to drain queues, and a publishing connection. */
export interface ExecutorWorld {
  bed: TestBed;
  broker: TestBroker;
  connection: ReconnectingConnection;
}

/**
 * Registers the suite's before/after: a test bed (`label` names its database), a broker client,
 * and a connection declaring `policies`' topology under the bed's prefix; all closed after. The
 * returned object is filled in by the time the suite's tests run.
 */
export function executorSuite(label: string, policies: readonly string[]): ExecutorWorld {
  const world: Partial<ExecutorWorld> = {};
  before(async () => {
    world.bed = await makeTestBed(label);
    world.broker = await openTestBroker(world.bed.amqpUrl);
    world.connection = new ReconnectingConnection({
      url: world.bed.amqpUrl,
      connectionName: label.replace(/_/g, '-'),
      topology: makeTopology({ prefix: world.bed.prefix, policies: [...policies], deliveryLimit: 20 }),
      log: pino({ level: 'silent' }),
    });
    await world.connection.start();
  });
  after(async () => {
    await world.connection?.close();
    await world.broker?.close();
    await world.bed?.close();
  });
  return world as ExecutorWorld;
}
