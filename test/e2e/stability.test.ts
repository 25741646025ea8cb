import { expect } from 'chai';
import { suiteRunningScript } from './server.js';

/**
 * stable_reinforce through the SDK: what the server refuses (each with a message naming the
 * problem) and a good request on recorded samples, whose loss is the docs/losses.md formula on
 * the returned logprobs and the sampler's recorded ones.
 */
describe('stable_reinforce: provenance and stability records', function () {
  this.timeout(600_000);
  const suite = suiteRunningScript('test/e2e/sdk_stability.py');
  let out: any;
  before(() => (out = suite.output()));

  it('refuses datums without provenance, unrecorded or foreign sequences, wrong tokens and prompt advantages', () => {
    expect(out.no_provenance).to.match(/BadRequestError.*loss_fn 'stable_reinforce' needs provenance on every datum/);
    expect(out.not_recorded).to.match(/BadRequestError.*has no stability record: sample it with record_stability_info=True/);
    expect(out.other_session).to.match(/BadRequestError.*was sampled in session .* belongs to session/);
    expect(out.wrong_token).to.match(/BadRequestError.*data\[0\]\.target_tokens: position 3 is token \d+, but its provenance \(sampled tokens of sequence .*, offset 0\) recorded \d+/);
    expect(out.prompt_advantage).to.match(/BadRequestError.*nonzero advantages only on sampled tokens, but position 0 is not a sampled token/);
  });

  // The second datum pads its prompt targets with 0, as the cookbook's rl_loop does: accepted
  // (targets under a prompt span are not scored), and its sampled tokens still checked.
  it('trains on recorded samples (prompt targets as given or padded with 0): loss:sum is -sum(min(r, 4) * A * lp) over the sampled tokens', () => {
    const ob = out.n_prompt - 1;
    let loss = 0;
    out.good_logprobs.forEach((lps: number[], i: number) => {
      const a = i === 0 ? 1 : -1;
      lps.slice(ob).forEach((lp, k) => {
        const r = Math.exp(lp - out.sampled_logprobs[i][k]);
        loss -= Math.min(r, 4) * a * lp;
      });
    });
    expect(out.good_loss).to.be.closeTo(loss, 1e-4 * Math.max(1, Math.abs(loss)));
    // Same weights sampled and scored: the ratio is 1 up to float32 noise.
    out.good_logprobs.forEach((lps: number[], i: number) =>
      lps.slice(ob).forEach((lp, k) => expect(lp).to.be.closeTo(out.sampled_logprobs[i][k], 1e-4)),
    );
  });
});
