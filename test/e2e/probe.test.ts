import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/**
 * Every public method of the pinned SDK against the server. What does not work is a documented
 * gap (README, "Known gaps"), and must fail exactly as documented.
 */
const GAPS: Record<string, RegExp> = {
  'RestClient.export_session_trace': /session trace export is not available on this server/,
  'RestClient.whoami': /whoami requires JWT auth/,
};

describe('every public SDK method', function () {
  this.timeout(600_000);
  const server = new E2EServer();
  before(async () => server.start());
  after(async () => server.destroy());

  it('runs without raising, except the documented gaps', () => {
    const out = server.runPython(['test/e2e/sdk_probe.py', TINY_MODEL_ALIAS]) as Record<string, string>;
    expect(Object.keys(out).length).to.be.above(50);
    const failures = Object.entries(out).filter(([k, v]) => v !== 'ok' && !GAPS[k]?.test(v));
    expect(failures, JSON.stringify(failures, null, 1)).to.deep.equal([]);
    for (const k of Object.keys(GAPS)) expect(out[k], k).to.match(GAPS[k]!);
  });
});
