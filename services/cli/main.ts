import { Command, CommanderError } from 'commander';
import { ConfigError } from '../../shared/config/errors';
import { registerAdmissionCommands } from './admission';
import { registerApprovalCommands } from './approvals';
import { registerAuditCommand } from './audit';
import { NotFoundError, UsageError } from './common';
import { registerDeadLetterCommands } from './dlq';
import { registerDoctorCommand } from './doctor';
import { registerEventsCommands } from './events';
import { registerHoldCommands } from './holds';
import { registerPartitionsCommand } from './partitions';
import { registerPauseCommands } from './pause';
import { registerPlanCommand } from './plan';
import { registerRestoreCommand } from './restore';
import { addRolesCommand } from './roles';
import { registerRunListCommands } from './run-list';
import { registerRunCommands } from './runs';
import { registerSchemaCommands } from './schema';
import { registerServiceCommands } from './services';
import { registerSqlCommands } from './sql';
import { registerStatusCommand } from './status';

/**
 * The operator CLI's entry point: it only wires the command groups, each in its own file, and maps
 * errors to exit codes (0 success, 1 failure or "not found", 2 usage error).
 */
export function makeProgram(): Command {
  const program = new Command('reaper')
    .description('Expires data reliably: scheduler, workers and operator commands.')
    .version(packageVersion(), '-V, --version', 'print the version')
    .exitOverride()
    .configureOutput({ writeErr: (text) => process.stderr.write(text) });

  registerServiceCommands(program);
  registerRunCommands(program);
  registerRunListCommands(program);
  registerPauseCommands(program);
  registerStatusCommand(program);
  registerDeadLetterCommands(program);
  registerPlanCommand(program);
  registerPartitionsCommand(program);
  registerApprovalCommands(program);
  registerHoldCommands(program);
  registerAuditCommand(program);
  registerAdmissionCommands(program);
  registerRestoreCommand(program);
  registerSqlCommands(program);
  registerEventsCommands(program);

  addRolesCommand(program);
  registerDoctorCommand(program);
  registerSchemaCommands(program);

  // Operator commands stop on SIGINT/SIGTERM at once (the services drain instead: runService).
  // Explicit handlers matter when the command is PID 1 (a container, a Kubernetes Job): the kernel
  // delivers no signal to PID 1 that it has not installed a handler for.
  // Commands that publish a run themselves (`execute`, `trigger`/`replay --execute`) handle Ctrl-C
  // on their own: they stop at the next window boundary and hand the run back (services/cli/runs.ts).
  program.hook('preAction', (_program, action) => {
    const drainsItself = ['scheduler', 'worker', 'relay', 'execute'].includes(action.name()) || action.opts().execute === true;
    if (!drainsItself) stopOnSignals();
  });

  return program;
}

export async function main(argv: string[]): Promise<number> {
  const program = makeProgram();
  try {
    await program.parseAsync(argv);
    return typeof process.exitCode === 'number' ? process.exitCode : 0;
  } catch (error) {
    if (error instanceof CommanderError) {
      // --help and --version end here with exit code 0; a bad option or argument with 1 → usage (2).
      return error.exitCode === 0 ? 0 : 2;
    }
    if (error instanceof UsageError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 2;
    }
    if (error instanceof NotFoundError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 1;
    }
    if (error instanceof ConfigError) {
      process.stderr.write(`reaper: ${error.message}\n`);
      return 1;
    }
    process.stderr.write(`reaper: ${(error as Error).message}\n`);
    return 1;
  }
}

function packageVersion(): string {
  // dist/services/cli/main.js -> package.json at the package root (also /app in the image).
  const { version } = require('../../../package.json') as { version: string };
  return version;
}

const SIGNAL_EXIT_CODES = { SIGINT: 130, SIGTERM: 143 } as const;

/** Exits 130/143 on SIGINT/SIGTERM (the shell's convention), after saying so on stderr. */
function stopOnSignals(): void {
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    process.once(signal, () => {
      process.stderr.write(`reaper: stopped by ${signal}\n`);
      process.exit(SIGNAL_EXIT_CODES[signal]);
    });
  }
}

/** Entry point: exits with main's code once stdout is flushed (a pipe may still be draining). */
export function runCli(): void {
  void main(process.argv).then((code) => process.stdout.write('', () => process.exit(code)));
}

if (require.main === module) runCli();
