'use strict';
/**
 * A mocha reporter: mocha's spec output on the terminal, and the counts of each suite (a top-level
 * `describe` of a test file) written as JSON to the file named by `--reporter-option json=PATH`.
 * scripts/test.sh reads that file (scripts/test_report.py).
 *
 * A test that never ran (its `before`/`beforeEach` hook failed) counts as not run under the hook's
 * error, not as passed or failed; mocha itself counts the hook as one failure. The JSON:
 *   { "suites": [{ "file", "title", "passed", "failed", "pending", "pendingTitles",
 *                  "errors": [{ "what", "message", "notRun" }] }] }
 * where each error is a failed hook (or an error outside any test) and `notRun` the tests it kept
 * from running.
 */
const fs = require('node:fs');
const path = require('node:path');
const Mocha = require('mocha');

const { EVENT_RUN_END, EVENT_TEST_FAIL, EVENT_TEST_PENDING } = Mocha.Runner.constants;

class SpecAndJson extends Mocha.reporters.Spec {
  constructor(runner, options = {}) {
    super(runner, options);
    const out = (options.reporterOption || options.reporterOptions || {}).json;
    if (!out) throw new Error('scripts/mocha-report.cjs needs --reporter-option json=PATH');
    const pending = new Set();
    const errors = []; // [runnable, error] of every failure that is not a test's own
    runner.on(EVENT_TEST_PENDING, (test) => pending.add(test));
    runner.on(EVENT_TEST_FAIL, (runnable, err) => {
      if (runnable.type !== 'test') errors.push([runnable, err]);
    });
    runner.once(EVENT_RUN_END, () => {
      fs.writeFileSync(out, `${JSON.stringify({ suites: summarise(runner.suite, pending, errors) }, null, 1)}\n`);
    });
  }
}

/** Every test under `suite`, its nested suites included. */
function testsUnder(suite) {
  return [...suite.tests, ...suite.suites.flatMap(testsUnder)];
}

function summarise(root, pending, errors) {
  const rel = (file) => (file ? path.relative(process.cwd(), file) : '');
  const bySuite = new Map(); // a top-level suite (or a file, for tests outside any describe) -> its row
  const rowFor = (runnable) => {
    let top = runnable.parent;
    while (top && top.parent && top.parent !== root) top = top.parent;
    if (top === root) top = null;
    const key = top || `file:${rel(runnable.file)}`;
    if (!bySuite.has(key)) {
      bySuite.set(key, {
        file: rel(top ? top.file : runnable.file),
        title: top ? top.title : '(outside any describe)',
        passed: 0,
        failed: 0,
        pending: 0,
        pendingTitles: [],
        errors: [],
      });
    }
    return bySuite.get(key);
  };

  // A title under its row's suite, without the suite's own title in front.
  const within = (row, full) => (full.startsWith(`${row.title} `) ? full.slice(row.title.length + 1) : full);

  const counted = new Set();
  for (const test of testsUnder(root)) {
    const row = rowFor(test);
    if (test.state === 'failed') row.failed++;
    else if (test.state === 'passed') row.passed++;
    else if (pending.has(test) || test.isPending()) {
      row.pending++;
      row.pendingTitles.push(within(row, test.fullTitle()));
    } else continue;
    counted.add(test);
  }
  // The tests left: each one did not run because of the innermost failed hook above it.
  for (const [runnable, err] of errors) {
    const scope = runnable.type === 'hook' ? runnable.parent : null;
    const notRun = scope ? testsUnder(scope).filter((t) => !counted.has(t)) : [];
    for (const t of notRun) counted.add(t);
    const message = String((err && err.message) || err).split('\n')[0];
    const row = rowFor(runnable);
    const what = within(row, typeof runnable.fullTitle === 'function' ? runnable.fullTitle() : String(runnable.title));
    row.errors.push({ what, message, notRun: notRun.length });
  }
  // Tests that neither ran nor sit under a failed hook (mocha stopped early).
  for (const test of testsUnder(root)) {
    if (counted.has(test)) continue;
    const row = rowFor(test);
    const last = row.errors.find((e) => e.what === '(mocha stopped before these tests)');
    if (last) last.notRun++;
    else row.errors.push({ what: '(mocha stopped before these tests)', message: 'not run', notRun: 1 });
  }
  return [...bySuite.values()];
}

module.exports = SpecAndJson;
