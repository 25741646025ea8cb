import { expect } from 'chai';
import { TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/**
 * End to end as a user runs it: the start command (`npm start`'s script) brings up the API and
 * an agent with the tiny model; an unchanged Tinker SDK program trains and samples through it.
 */
type LoopResult = {
  model_id: string;
  nll: number[];
  loss_sum: number[];
  n_tokens: number;
  samples: { tokens: number[]; logprobs: number[]; stop_reason: string }[];
  greedy: { tokens: number[]; logprobs: number[]; rescored: number[]; text: string };
  base_model: string;
};

describe('Tinker SDK end to end through the start command', function () {
  const server = new E2EServer();
  before(async function () {
    this.timeout(180_000);
    await server.start();
  });
  after(async () => server.destroy());
  const runPython = (args: string[]) => server.runPython(args);

  const runLoop = (mode: 'pipelined' | 'sequential', model: string): LoopResult =>
    runPython(['test/e2e/sdk_train_loop.py', model, mode, '30']) as LoopResult;

  let pipelined: LoopResult;

  it('trains 30 pipelined steps: the mean NLL from loss_fn_outputs falls by at least half', function () {
    this.timeout(600_000);
    pipelined = runLoop('pipelined', TINY_MODEL_ALIAS);
    const { nll, loss_sum, n_tokens } = pipelined;
    expect(nll).to.have.length(30);
    expect(nll[29]!).to.be.at.most(nll[0]! / 2);
    // loss:sum is the summed NLL of the same tokens.
    nll.forEach((v, i) => expect(loss_sum[i]!).to.be.closeTo(v * n_tokens, 1e-3 * n_tokens));
  });

  it('samples from the saved weights with a logprob for every token', () => {
    expect(pipelined.samples).to.have.length(2);
    for (const s of pipelined.samples) {
      expect(s.tokens.length).to.be.within(1, 8);
      expect(s.logprobs).to.have.length(s.tokens.length);
      expect(['stop', 'length']).to.include(s.stop_reason);
    }
    expect(pipelined.base_model).to.equal(TINY_MODEL_DIR);
    // Each sampled token's logprob equals the one compute_logprobs gives the same tokens.
    const g = pipelined.greedy;
    expect(g.logprobs).to.have.length(g.tokens.length);
    g.logprobs.forEach((lp, i) => expect(lp).to.be.closeTo(g.rescored[i]!, 1e-4));
  });

  it('gives the same losses when every call is awaited one by one (the ordering is real)', function () {
    this.timeout(600_000);
    const sequential = runLoop('sequential', TINY_MODEL_DIR);
    sequential.nll.forEach((v, i) => expect(v).to.be.closeTo(pipelined.nll[i]!, 1e-4 * Math.max(1, Math.abs(v))));
  });

  it('serves a training op between the decode steps of a long sample batch of the same base model', function () {
    this.timeout(300_000);
    const out = runPython(['test/e2e/sdk_train_during_sample.py', TINY_MODEL_ALIAS, '2000', '8']) as {
      fb_latency_s: number;
      fb_done_s: number;
      sample_done_s: number;
      sample_lengths: number[];
      fb_loss: number;
    };
    console.log(
      `      [train during sample] forward_backward answered ${out.fb_latency_s.toFixed(2)} s after it was sent; ` +
        `the sample (8 x 2000 tokens) finished ${(out.sample_done_s - out.fb_done_s).toFixed(1)} s later, ${out.sample_done_s.toFixed(1)} s after its submit`,
    );
    expect(out.sample_lengths).to.deep.equal(Array(8).fill(2000));
    expect(out.fb_loss).to.be.above(0);
    // Structural, not timed: the training op did not wait for the batch to finish.
    expect(out.fb_done_s).to.be.lessThan(out.sample_done_s);
  });

  it('answers bad input with clear errors, and the training client keeps working after them', function () {
    this.timeout(300_000);
    const out = runPython(['test/e2e/sdk_bad_input.py', TINY_MODEL_ALIAS]);
    expect(out.unknown_model).to.match(/base model 'Qwen\/Qwen3-8B' is not served here; served models: .*tiny-qwen3/);
    expect(out.oov_token).to.match(/BadRequestError.*999999 is outside the vocabulary/);
    expect(out.unknown_loss).to.match(/BadRequestError.*unknown loss_fn 'no_such_loss'/);
    expect(out.after_errors_loss).to.be.a('number').and.above(0);
    expect(out.after_errors_optim).to.have.property('grad_norm');
    expect(out.oov_prompt).to.match(/999999 is outside the vocabulary/);
    expect(out.sample_ok).to.have.length(2);
  });
});
