/**
 * The CLI's start-up loads only what parsing a command needs: the heavy packages (shared/lazy-modules.ts)
 * load on first use. Every `reaper` command, and every service, is a new Node process; the test suite
 * alone starts about 330 CLI commands, and pino, prom-client (with @opentelemetry/api), amqplib and
 * opossum were about half of each one's start-up CPU.
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import path from 'node:path';
import { test } from 'node:test';

const HEAVY = ['prom-client', '@opentelemetry/api', 'amqplib', 'pino', 'opossum', '@aws-sdk/client-s3'];

/** The packages under node_modules a fresh Node process holds after requiring `entry`. */
function packagesLoadedBy(entry: string): string[] {
  const script = `require(${JSON.stringify(entry)});
    const names = new Set(Object.keys(require.cache).flatMap((file) => {
      const inside = file.split('/node_modules/').pop();
      if (inside === file) return [];
      const parts = inside.split('/');
      return [parts[0].startsWith('@') ? parts.slice(0, 2).join('/') : parts[0]];
    }));
    process.stdout.write(JSON.stringify([...names].sort()));`;
  return JSON.parse(execFileSync(process.execPath, ['-e', script], { encoding: 'utf8' })) as string[];
}

test('loading the CLI (every command registered) loads none of the heavy packages; a service loads them when it starts', () => {
  const loaded = packagesLoadedBy(path.join(__dirname, '..', '..', 'services', 'cli', 'main.js'));
  assert.deepEqual(loaded.filter((name) => HEAVY.includes(name)), [], `loaded at CLI start: ${loaded.join(', ')}`);
  assert.ok(loaded.includes('commander') && loaded.includes('pg'), `the CLI still loads what every command needs: ${loaded.join(', ')}`);
  // The lazy getters load the real packages (what a service's start calls).
  const script = `const lazy = require(${JSON.stringify(path.join(__dirname, '..', '..', 'shared', 'lazy-modules.js'))});
    const registry = new (lazy.promClient().Registry)();
    const log = lazy.pinoModule().default({ level: 'silent' });
    process.stdout.write(JSON.stringify([typeof registry.metrics, typeof log.info, typeof lazy.amqplib().connect, typeof lazy.circuitBreakerClass()]));`;
  assert.deepEqual(JSON.parse(execFileSync(process.execPath, ['-e', script], { encoding: 'utf8' })), ['function', 'function', 'function', 'function']);
});
