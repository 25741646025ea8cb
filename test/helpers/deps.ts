/**
 * A dependency that scripts/test.sh installs (Chromium, vLLM, Docker), checked where a test needs it.
 * Missing, the test (or, from a `before` hook, every test of its suite) is skipped with the reason in
 * its title; with TB_REQUIRE_TEST_DEPS=1, which scripts/test.sh sets, it fails instead: there a
 * missing dependency is a broken install, not a reason to skip.
 */
export function needDependency(ctx: Mocha.Context, present: boolean, what: string): void {
  if (present) return;
  if (process.env.TB_REQUIRE_TEST_DEPS === '1') throw new Error(`missing ${what} (TB_REQUIRE_TEST_DEPS=1: scripts/test.sh installs it)`);
  const reason = ` (skipped: missing ${what})`;
  const runnable = ctx.test;
  const under = (suite: Mocha.Suite): Mocha.Test[] => [...suite.tests, ...suite.suites.flatMap(under)];
  if ((runnable as { type?: string } | undefined)?.type === 'test') runnable!.title += reason;
  else if (runnable?.parent) for (const t of under(runnable.parent)) t.title += reason;
  ctx.skip();
}
