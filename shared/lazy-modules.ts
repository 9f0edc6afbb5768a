/**
 * Heavy packages loaded on first use rather than when a module that may use them is imported. The
 * CLI imports every command's module to parse its arguments, and most commands never log through
 * pino, build metrics, connect to the broker or wrap a remote client in a circuit breaker; loading
 * all four at every start cost about 70 ms of CPU per CLI command (0.46 against 0.39 s, docs/testing.md;
 * test/unit/lazy-modules.test.ts fails when the CLI loads one at start). The services load them at
 * once anyway. Types come from `import type` in each user, so nothing here is `any`.
 */
import type * as Amqp from 'amqplib';
import type CircuitBreakerClass from 'opossum';
import type * as Pino from 'pino';
import type * as PromClient from 'prom-client';

export function promClient(): typeof PromClient {
  return require('prom-client') as typeof PromClient;
}

export function amqplib(): typeof Amqp {
  return require('amqplib') as typeof Amqp;
}

export function pinoModule(): typeof Pino {
  return require('pino') as typeof Pino;
}

export function circuitBreakerClass(): typeof CircuitBreakerClass {
  return require('opossum') as typeof CircuitBreakerClass;
}
