import { Command, Option } from 'commander';
import { loadEnv } from '../../shared/config/env';
import { UsageError } from './common';
import { deadLettersList, deadLettersPurge, deadLettersRequeue, describeRequeue } from './dead-letters';
import { printResult, table } from './output';

/** `reaper dlq list|requeue|purge`: the dead-letter queue, for operators. */

function parseLimit(value: string): number {
  const limit = Number(value);
  if (!Number.isInteger(limit) || limit < 1 || limit > 100_000) throw new UsageError(`--limit: must be an integer from 1 to 100000 (got "${value}")`);
  return limit;
}

/** Registers `reaper dlq ...`. */
export function registerDeadLetterCommands(program: Command): void {
  const json = () => new Option('--json', 'print machine-readable JSON');
  const dlq = program.command('dlq').description('inspect and handle the dead-letter queue');
  const limitOption = () => new Option('--limit <n>', 'at most this many messages').default('100');
  dlq
    .command('list')
    .description('show dead-lettered messages with their reasons (they stay in the queue)')
    .addOption(limitOption())
    .addOption(json())
    .action(async (options: { limit: string; json?: boolean }) => {
      const env = loadEnv();
      const messages = await deadLettersList(env.amqpUrl, env.amqpPrefix, parseLimit(options.limit));
      printResult(!!options.json, messages, () => table(messages.map((m) => ({ ...m, detail: m.detail.slice(0, 80) })), ['messageId', 'policy', 'reason', 'bytes', 'detail']));
    });
  dlq
    .command('requeue')
    .description('publish dead-lettered messages back to their work queue (after you fixed the cause)')
    .addOption(limitOption())
    .option('--reason <reason>', 'only messages dead-lettered for this reason')
    .addOption(json())
    .action(async (options: { limit: string; reason?: string; json?: boolean }) => {
      const env = loadEnv();
      const result = await deadLettersRequeue(env.amqpUrl, env.amqpPrefix, { limit: parseLimit(options.limit), reason: options.reason });
      printResult(!!options.json, result, () => describeRequeue(result));
      if (result.failed > 0) process.exitCode = 1; // some stayed behind against the operator's wish
    });
  dlq
    .command('purge')
    .description('delete every message in the dead-letter queue')
    .option('--yes', 'confirm: the messages are gone for good')
    .addOption(json())
    .action(async (options: { yes?: boolean; json?: boolean }) => {
      if (!options.yes) throw new UsageError('purge deletes every dead-lettered message for good; add --yes to confirm');
      const env = loadEnv();
      const purged = await deadLettersPurge(env.amqpUrl, env.amqpPrefix);
      printResult(!!options.json, { purged }, () => `purged ${purged} message(s)`);
    });
}
