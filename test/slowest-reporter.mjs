// A second reporter for test/run.js: one line per test file with its duration (the runner's own
// file-level `test:complete`, whose name is the file) and when it ended, so run.js prints the
// slowest at the end and how long the parallel group ran below its concurrency.
// Node's usual reporter keeps writing to the terminal; this one writes to the file given by
// --test-reporter-destination.
export default async function* slowestReporter(source) {
  for await (const event of source) {
    if (event.type === 'test:complete' && event.data.file && event.data.name === event.data.file) {
      yield `${JSON.stringify({ file: event.data.file, ms: event.data.details?.duration_ms ?? 0, endedAt: Date.now() })}\n`;
    }
  }
}
