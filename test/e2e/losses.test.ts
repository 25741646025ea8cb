import { expect } from 'chai';
import path from 'node:path';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/**
 * Every loss against a torch reference: `sdk_losses.py` drives the server through the Tinker SDK
 * (forward_backward, optim_step, save_weights_for_sampler) and recomputes the target logprobs,
 * the summed loss, the gradient, the clip and the AdamW step itself from the initial adapter the
 * server saved, in float32 on the CPU. Logprobs, loss:sum and every LoRA tensor after the step must
 * agree within 1e-5. The SDK 0.38 cases: per-token clip thresholds, cispo's default, gspo (with and
 * without thresholds) and stable_reinforce on real samples recorded with record_stability_info,
 * whose datums carry provenance and deliberately wrong `logprobs` (the server uses its record).
 */
type CaseResult = {
  model_id: string;
  loss_fn: string;
  max_logprob_diff: number;
  logprob_shapes_ok: boolean;
  loss_server: number;
  loss_ref: number;
  grad_norm_server: number;
  grad_norm_ref: number;
  grad_clip_norm: number;
  max_param_diff: number;
  n_params_compared: number;
  keys_equal: boolean;
  max_update: number;
  // ratio-based losses only
  max_ratio?: number;
  min_ratio?: number;
  n_ratio_gt_2?: number;
  ppo_clipped_tokens?: number;
  tokens_outside_clip?: number;
  n_tokens?: number;
  n_pos_adv?: number;
  n_neg_adv?: number;
};

const CASES: Record<string, string> = {
  cross_entropy: 'cross_entropy',
  cross_entropy_topk: 'cross_entropy',
  cross_entropy_negative: 'cross_entropy',
  importance_sampling: 'importance_sampling',
  ppo: 'ppo',
  cispo: 'cispo',
  dro: 'dro',
  ppo_per_token: 'ppo',
  cispo_default: 'cispo',
  gspo: 'gspo',
  gspo_thresholds: 'gspo',
  stable_reinforce: 'stable_reinforce',
};
const TOL = 1e-5;

describe('losses match a torch reference (logprobs, loss:sum, parameters after one AdamW step)', function () {
  const server = new E2EServer();
  let results: Record<string, CaseResult>;

  before(async function () {
    this.timeout(300_000);
    await server.start();
    results = server.runPython(
      ['test/e2e/sdk_losses.py', TINY_MODEL_ALIAS, path.resolve('models/tiny-qwen3'), server.storage],
      240_000,
    ) as Record<string, CaseResult>;
  });
  after(async () => server.destroy());

  it('runs every case', () => {
    expect(Object.keys(results).sort()).to.deep.equal(Object.keys(CASES).sort());
  });

  for (const [name, lossFn] of Object.entries(CASES)) {
    it(`${name}: logprobs, loss:sum, grad_norm and updated LoRA weights agree within 1e-5`, () => {
      const r = results[name]!;
      const ctx = `${name}: ${JSON.stringify(r)}`;
      expect(r.loss_fn, ctx).to.equal(lossFn);
      expect(r.logprob_shapes_ok, ctx).to.equal(true);
      expect(r.max_logprob_diff, ctx).to.be.below(TOL);
      expect(Math.abs(r.loss_server - r.loss_ref), ctx).to.be.below(TOL * Math.max(1, Math.abs(r.loss_ref)));
      // The reported norm is the one before clipping.
      expect(Math.abs(r.grad_norm_server - r.grad_norm_ref), ctx).to.be.below(TOL * Math.max(1, r.grad_norm_ref));
      expect(r.keys_equal, ctx).to.equal(true);
      expect(r.n_params_compared, ctx).to.be.above(0);
      expect(r.max_param_diff, ctx).to.be.below(TOL);
      expect(r.max_update, ctx).to.be.above(1e-4);
      // Where a clip is set, it really clips.
      if (r.grad_clip_norm > 0) expect(r.grad_norm_ref, ctx).to.be.above(2 * r.grad_clip_norm);
    });
  }

  it('exercises the ratio losses where they differ: ratios above 2, clipped tokens, advantages of both signs', () => {
    for (const name of ['importance_sampling', 'ppo', 'cispo', 'dro']) {
      const r = results[name]!;
      const ctx = `${name}: ${JSON.stringify(r)}`;
      expect(r.n_pos_adv, ctx).to.be.above(0);
      expect(r.n_neg_adv, ctx).to.be.above(0);
    }
    // importance_sampling is exact: ratios above 2 are not truncated.
    expect(results.importance_sampling!.n_ratio_gt_2).to.be.above(0);
    expect(results.importance_sampling!.max_ratio).to.be.above(2);
    for (const name of ['ppo', 'cispo']) {
      const r = results[name]!;
      const ctx = `${name}: ${JSON.stringify(r)}`;
      // Some tokens inside and some outside [0.9, 1.1]; for PPO some take the clipped (zero-gradient) branch.
      expect(r.tokens_outside_clip, ctx).to.be.above(0);
      expect(r.tokens_outside_clip, ctx).to.be.below(r.n_tokens!);
      expect(r.ppo_clipped_tokens, ctx).to.be.above(0);
    }
    // Per-token thresholds replace the config's: other tokens are clipped than with [0.9, 1.1].
    expect(results.ppo_per_token!.tokens_outside_clip).to.be.above(0);
    expect(results.ppo_per_token!.tokens_outside_clip).to.not.equal(results.ppo!.tokens_outside_clip);
    // cispo's default clip is one-sided [0, 4]: the ratios 0.37 .. 3.3 are all inside it.
    expect(results.cispo_default!.tokens_outside_clip).to.equal(0);
    expect(results.cispo_default!.min_ratio).to.be.below(0.5);
  });
});
