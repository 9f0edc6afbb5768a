/**
 * Adaptive row-delete admission (issue 18), pure: no clock, no database; every input is an
 * argument, so a test drives it with a signal it controls. Four parts, one file each:
 *  - adaptive-law.ts: the law (the pressure, the step of the shared rate, the start, the size of a
 *    statement, alone or not), as docs/design.md "Adaptive row-delete admission" states it;
 *  - adaptive-signal.ts: what one worker reads of the database and smooths (its own statements'
 *    latency against a quiet-time baseline; the other clients seen at each admission);
 *  - adaptive-worker.ts: what one worker keeps between its takes, and how each event changes it;
 *  - adaptive-constants.ts: the constants, each with why it has its value.
 * The I/O (the samples, the take statement, the metrics) is rows.ts; the SQL is
 * shared/db/queries/admission.ts. This file gathers the four for their callers.
 */
export { ADAPTIVE } from './adaptive-constants';
export * from './adaptive-law';
export * from './adaptive-signal';
export * from './adaptive-worker';
export * from './adaptive-harm';
