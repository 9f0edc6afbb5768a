import { Command, Option } from 'commander';
import { brokerNames } from '../../shared/amqp/topology';
import { eventsEnabled } from '../../shared/config/policies';
import { expiryEventRoutingKey } from '../../shared/contracts/expiry-event';
import { outboxRelayConnections } from '../../shared/db/queries/outbox';
import { context, withPool } from './common';
import { formatDuration, printResult, table } from './output';
import { eventsStatus, outboxFullLine } from './status';

/**
 * `reaper events status`: the expiry-event outbox per policy with events on (unpublished events,
 * counted up to events.maxOutbox; the oldest one's age; whether the policy's deletions are paused
 * by the limit), where the events go, and how many `reaper relay` connections the database sees.
 * The same numbers as `reaper status`'s events column, for the runbook (docs/guardrails.md "Expiry events").
 */
export function registerEventsCommands(program: Command): void {
  const events = program.command('events').description('expiry events (the transactional outbox and `reaper relay`)');
  events
    .command('status')
    .description('per policy with events on: unpublished events, oldest age, paused by events.maxOutbox; relay connections')
    .addOption(new Option('--json', 'print machine-readable JSON'))
    .action(async (options: { json?: boolean }) => {
      const { env, policies } = context();
      const withEvents = [...policies.values()].filter(eventsEnabled);
      const { outbox, relayConnections } = await withPool(env, async (pool) => ({
        outbox: await eventsStatus(pool, withEvents),
        relayConnections: await outboxRelayConnections(pool),
      }));
      const exchange = brokerNames(env.amqpPrefix).eventsExchange;
      const rows = withEvents.map((policy) => ({ policy: policy.name, exchange, routingKey: expiryEventRoutingKey(policy.name), ...outbox.get(policy.name)! }));
      printResult(!!options.json, { relayConnections, policies: rows }, () =>
        [
          withEvents.length === 0
            ? 'no policy has expiry events on (events: { enabled: true })'
            : table(
                rows.map((row) => ({ ...row, outbox: `${row.outbox}${row.paused ? '+' : ''}`, oldest: formatDuration(row.oldestAgeSeconds), paused: row.paused ? 'PAUSED (outbox full)' : 'no' })),
                ['policy', 'outbox', 'maxOutbox', 'oldest', 'paused', 'exchange', 'routingKey'],
              ),
          `reaper relay connections to the database: ${relayConnections}${relayConnections === 0 && withEvents.length > 0 ? ' (no relay is running: events only accumulate)' : ''}`,
          ...rows.filter((row) => row.paused).map((row) => outboxFullLine(row.policy, row)),
        ].join('\n'),
      );
    });
}
