/**
 * A user mistake in configuration or on the command line. Services and the CLI print its message
 * (which names the field and the value) and exit; they never print a stack trace for it.
 */
export class ConfigError extends Error {
  readonly code = 'CONFIG_INVALID';
  constructor(message: string) {
    super(message);
    this.name = 'ConfigError';
  }
}
