import { expect } from 'chai';
import { suiteRunningScript } from './server.js';

/** SDK 0.38 sampling fields against the engine's own full prompt logprobs. */
describe('sampling fields of SDK 0.38', function () {
  this.timeout(600_000);
  const suite = suiteRunningScript('test/e2e/sdk_sampling_fields.py');
  let out: any;
  before(() => (out = suite.output()));

  it('prompt_logprobs_last_n: the last N entries (and their top-K) are the full ones, earlier entries None', () => {
    const n = out.full.length;
    expect(out.last3).to.have.length(n);
    out.last3.forEach((v: number | null, i: number) => {
      if (i < n - 3) expect(v, `entry ${i}`).to.equal(null);
      else expect(v, `entry ${i}`).to.be.closeTo(out.full[i], 1e-6);
    });
    out.last3_topk.forEach((row: [number, number][] | null, i: number) => {
      if (i < n - 3) expect(row, `top-K ${i}`).to.equal(null);
      else {
        expect(row!.map((c) => c[0])).to.deep.equal(out.full_topk[i].map((c: [number, number]) => c[0]));
        row!.forEach((c, j) => expect(c[1]).to.be.closeTo(out.full_topk[i][j][1], 1e-6));
      }
    });
  });

  it('target_prompt_logprobs: each requested id scored at its position, as the prompt logprobs and top-K say; 0.0 for -1', () => {
    expect(out.target).to.have.length(out.full.length - 1);
    out.target.forEach((row: number[], i: number) => {
      expect(row).to.have.length(3);
      expect(row[0], `row ${i} prompt token`).to.be.closeTo(out.full[i + 1], 1e-6);
      expect(row[1], `row ${i} top-1`).to.be.closeTo(out.full_topk[i + 1][0][1], 1e-6);
      expect(row[2]).to.equal(0);
    });
    expect(out.raw_target_bad_shape).to.match(/^400 .*target_prompt_logprobs must have shape \[len\(prompt\) - 1, K\] = \[7, K\]/);
  });

  it('topk_sample_logprobs: per generated token, the top-K of its distribution; greedy picks the first, scored as compute_logprobs does', () => {
    expect(out.greedy_topk).to.have.length(out.greedy_tokens.length);
    out.greedy_topk.forEach((row: [number, number][], t: number) => {
      expect(row).to.have.length(4);
      for (let j = 1; j < 4; j++) expect(row[j]![1]).to.be.at.most(row[j - 1]![1]);
      expect(row[0]![0], `token ${t}`).to.equal(out.greedy_tokens[t]);
      expect(row[0]![1], `token ${t}`).to.be.closeTo(out.greedy_rescored[t], 1e-4);
    });
  });

  it('prompt_alt_tokens_k (temperature 0): k draws per prompt position after the first, the argmax with its top-1 logprob', () => {
    expect(out.alt_tokens).to.have.length(out.full.length - 1);
    out.alt_tokens.forEach((row: number[], i: number) => {
      expect(row).to.deep.equal([out.full_topk[i + 1][0][0], out.full_topk[i + 1][0][0]]);
      out.alt_logprobs[i].forEach((v: number) => expect(v).to.be.closeTo(out.full_topk[i + 1][0][1], 1e-6));
    });
  });

  it('prompt_logprobs_last_n needs prompt logprobs and at most len(prompt) - 1', () => {
    // The SDK checks these itself (ValueError) before it sends; the server refuses them too (raw HTTP).
    expect(out.last_n_without_logprobs).to.match(/Error.*prompt_logprobs_last_n/);
    expect(out.last_n_too_long).to.match(/Error.*prompt_logprobs_last_n/);
    expect(out.raw_without_logprobs).to.match(/^400 .*prompt_logprobs_last_n requires prompt_logprobs/);
    expect(out.raw_too_long).to.match(/^400 .*prompt_logprobs_last_n 8 must be between 1 and len\(prompt\) - 1 = 7/);
  });
});
