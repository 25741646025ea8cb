import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { TINY_MODEL_DIR } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/**
 * Tinker Cookbook (0.6.1) recipes run unchanged against the server: each test runs a recipe's
 * own entry point through test/e2e/cookbook/run.py (local data, the tiny model, a few steps) and
 * checks numbers from the metrics.jsonl the recipe writes itself.
 *
 * The server serves the tiny model (also under the hub name `Qwen/Qwen3-8B-Base`, which sl_loop
 * needs for the cookbook's model table) and a second tiny model as the teacher, by name.
 */
type Row = Record<string, number | string | undefined>;
type Run = { recipe: string; cmd: string[]; rc: number; seconds: number; log_path: string; metrics: Row[]; checkpoints: { state_path: string; sampler_path?: string }[] };

const num = (row: Row, key: string): number => {
  const v = row[key];
  expect(v, `${key} in step ${row.step}`).to.be.a('number');
  expect(Number.isFinite(v as number), `${key}=${v} in step ${row.step} is finite`).to.equal(true);
  return v as number;
};
/** The rows of steps 0..n-1 (RL loops log a last row of token counts only, at step n). */
const steps = (run: Run, n: number): Row[] => {
  const rows = run.metrics.filter((r) => typeof r.step === 'number' && (r.step as number) < n);
  expect(rows.map((r) => r.step)).to.deep.equal([...Array(n).keys()]);
  return rows;
};
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
/** An SFT run of `n` steps from the random model: its NLL starts about uniform over the vocabulary and its last `tail` steps average below `below`. */
const sftFromRandom = (run: Run, n: number, tail: number, below: number) => {
  const nll = steps(run, n).map((r) => num(r, 'train_mean_nll'));
  expect(nll[0]).to.be.closeTo(Math.log(1029), 0.5);
  expect(mean(nll.slice(-tail))).to.be.below(below);
};

describe('Tinker Cookbook recipes, unchanged, against the server', function () {
  this.timeout(600_000);
  const server = new E2EServer({}, ['--preset', 'presets/cpu/cookbook.yaml']);
  const workdir = mkdtempSync(path.join(os.tmpdir(), 'tb-cookbook-'));
  const cookbook = (recipe: string, ...args: string[]): any =>
    server.runPython(['test/e2e/cookbook/run.py', recipe, '--workdir', workdir, ...args], 1_200_000);

  before(async function () {
    this.timeout(240_000);
    await server.start();
  });
  after(async () => {
    await server.destroy();
    rmSync(workdir, { recursive: true, force: true });
  });

  it('renders with role_colon and the qwen3 family from the tiny tokenizer loaded by path', () => {
    const out = server.runPython(['test/e2e/cookbook/renderers_check.py', TINY_MODEL_DIR]);
    for (const name of ['role_colon', 'qwen3', 'qwen3_disable_thinking', 'qwen3_instruct']) {
      const checks = out[name];
      for (const [check, ok] of Object.entries(checks)) expect(ok, `${name}: ${check} (${checks.error ?? ''})`).to.equal(true);
    }
    expect(out.qwen3).to.include({ prompt_matches_template: true, example_matches_template: true, think_tokens_single: true });
  });

  // The recipe runs with a Qwen3 renderer; that it tokenizes as the chat template does (one
  // token for <think>) is the renderer check's part above.
  it('chat_sl with the qwen3_disable_thinking renderer: the NLL falls', () => {
    const nll = steps(cookbook('chat_sl', 'renderer_name=qwen3_disable_thinking'), 12).map((r) => num(r, 'train_mean_nll'));
    expect(mean(nll.slice(-3))).to.be.below(nll[0]! - 1.5);
  });

  it('chat_sl on a local JSONL: the NLL falls over the steps', () => {
    const run: Run = cookbook('chat_sl');
    const nll = steps(run, 12).map((r) => num(r, 'train_mean_nll'));
    expect(nll[0]).to.be.closeTo(Math.log(1029), 0.5); // a random model: about uniform over the vocabulary
    expect(mean(nll.slice(-3))).to.be.below(nll[0]! - 1.5);
    expect(run.checkpoints.at(-1)!.state_path).to.match(/^tinker:\/\/.+\/weights\/final$/);
  });

  it('sl_loop (hub dataset id and model name resolved locally): the NLL falls', () => {
    const run: Run = cookbook('sl_loop');
    const nll = steps(run, 8).map((r) => num(r, 'train_mean_nll'));
    expect(mean(nll.slice(-2))).to.be.below(nll[0]! - 0.5);
  });

  it('rl_loop (GSM8K layout, local; importance_sampling): every step completes with a finite reward', () => {
    for (const row of steps(cookbook('rl_loop'), 3)) expect(num(row, 'reward/total')).to.be.within(0, 1);
  });

  // RL that really updates the policy in rl_loop, the cookbook's minimal loop, with its default
  // loss (stable_reinforce: sampling clients with record_stability_info, datums with provenance
  // whose prompt targets are padded with 0) and with gspo (sequence_ratio_mask). Its reward is
  // the recipe's own grader: 1 for the right \boxed{} answer, else 0. A random model never earns
  // it (every advantage 0: rl_loop skips the training step, as the plain run above does), and the
  // tiny model cannot add, so every local problem has the same answer (12, data.RL_LOOP_TOTAL) and
  // SFT on rl_loop's own prompts teaches half "\boxed{12}", half "No idea." (data.rl_loop_sft_rows;
  // deterministic: fixed data and order, CPU training). After it both whole answers have
  // probability 0.20 (the rest goes to garbled mixtures of the two), so most groups of 4 samples
  // are mixed. rl_loop resumes from that state (run.py's resume_from writes it into the recipe's
  // checkpoints.jsonl). The probabilities are read exactly (prompt logprobs of the saved weights,
  // every local problem) before and after 6 RL steps. Sampling is unseeded, so runs differ: in 5
  // runs of each loss P(correct) ended at 0.34-0.40 (1.7-2.0 times higher) and P(No idea.) at
  // 0.067-0.098 (2.1-3.0 times lower); the bounds, 1.25 times and 0.75 times, leave a wide margin.
  // The sampled reward rose too, but 16 samples a step make it too noisy to assert.
  let rlLoopSft: Run;
  it('SFT on rl_loop\'s prompts (the boxed answer or "No idea."): the NLL falls', function () {
    this.timeout(1_200_000); // 48 steps of 16 prompts of ~250 tokens: 3-4 minutes on 2 busy cores
    rlLoopSft = cookbook('rl_loop_sft');
    sftFromRandom(rlLoopSft, 48, 4, 0.5);
  });

  for (const lossFn of ['', 'gspo']) {
    it(`rl_loop from the SFT state with ${lossFn ? `loss_fn=${lossFn}` : 'its default loss (stable_reinforce)'}: the rewarded answer becomes more likely`, function () {
      if (!rlLoopSft) throw new Error('needs the SFT run above, which failed');
      const sft = rlLoopSft.checkpoints.at(-1)!;
      const rl: Run = cookbook('rl_loop_from_sft', `resume_from=${sft.state_path}`, `loss_fn=${lossFn}`);
      expect(rl.cmd.join(' ')).to.not.match(lossFn ? /loss_fn=importance_sampling/ : /loss_fn=/);
      const rows = steps(rl, 6);
      for (const row of rows) expect(num(row, 'reward/total')).to.be.within(0, 1);
      // Trained from the SFT state: the recipe earned reward (a random model earns none).
      expect(Math.max(...rows.map((r) => num(r, 'reward/total')))).to.be.above(0);
      const before = sft.sampler_path as string;
      const after = rl.checkpoints.at(-1)!.sampler_path as string;
      const probe = server.runPython(['test/e2e/cookbook/policy_probe.py', 'rl_loop', TINY_MODEL_DIR, 'role_colon', workdir, before, after]);
      const [c0, c1] = [mean(probe.correct[before]), mean(probe.correct[after])];
      const [g0, g1] = [mean(probe.give_up[before]), mean(probe.give_up[after])];
      console.log(`      ${lossFn || 'stable_reinforce'}: P(\\boxed{12}) ${c0.toFixed(4)} -> ${c1.toFixed(4)}; P(No idea.) ${g0.toFixed(4)} -> ${g1.toFixed(4)}; reward by step ${rows.map((r) => num(r, 'reward/total').toFixed(2)).join(' ')}`);
      expect(c0, 'P(correct) after SFT').to.be.within(0.05, 0.6);
      expect(g0, 'P(No idea.) after SFT').to.be.within(0.05, 0.6);
      expect(c1, `P(correct) after RL (was ${c0})`).to.be.above(1.25 * c0);
      expect(g1, `P(No idea.) after RL (was ${g0})`).to.be.below(0.75 * g0);
    });
  }

  const checkRl = (run: Run, n: number) => {
    for (const row of steps(run, n)) {
      num(row, 'env/all/reward/total');
      num(row, 'optim/kl_sample_train_v1');
      num(row, 'optim/kl_sample_train_v2');
      num(row, 'optim/entropy');
      num(row, 'grad_norm');
      // Sampler and trainer score the sampled tokens alike (same weights, temperature 1).
      expect(Math.abs(num(row, 'optim/kl_sample_train_v1'))).to.be.below(0.05);
    }
  };

  it('math_rl env=arithmetic (importance_sampling): every step completes with finite reward and KL', () => {
    checkRl(cookbook('math_rl'), 3);
  });

  it('math_rl with loss_fn=ppo (and compute_post_kl): every step completes with finite reward and KL', () => {
    const run: Run = cookbook('math_rl_ppo');
    checkRl(run, 3);
    for (const row of steps(run, 3)) num(row, 'kl_pre_post_v1');
  });

  it('DPO on local comparisons (forward_backward_custom, compute_logprobs): the loss falls from ln 2', () => {
    const rows = steps(cookbook('dpo'), 4);
    const loss = rows.map((r) => num(r, 'dpo_loss'));
    expect(loss[0]).to.be.closeTo(Math.LN2, 1e-4); // policy == reference at step 0
    expect(loss[3]).to.be.below(loss[0]! - 0.1);
    expect(num(rows[3]!, 'accuracy')).to.be.above(0.5);
    expect(num(rows[3]!, 'chosen_reward')).to.be.above(num(rows[3]!, 'rejected_reward'));
  });

  it('on-policy distillation from a teacher served by name: teacher_kl every step', () => {
    for (const row of steps(cookbook('distill_on_policy'), 3)) {
      num(row, 'teacher_kl');
      num(row, 'teacher_kl/dataset_0');
      num(row, 'optim/kl_sample_train_v1');
    }
  });

  it('multi-teacher on-policy distillation: one teacher_kl per teacher; the base model as teacher starts at 0', () => {
    const rows = steps(cookbook('distill_multi_teacher'), 3);
    for (const row of rows) {
      num(row, 'teacher_kl');
      num(row, 'teacher_kl/dataset_0');
      num(row, 'teacher_kl/dataset_1');
    }
    // Dataset 1's teacher is the student's own base model: before any update the student (a
    // zero LoRA) and that teacher give the same logprobs, so the KL estimate is ~0.
    expect(Math.abs(num(rows[0]!, 'teacher_kl/dataset_1'))).to.be.below(1e-3);
    // The other teacher is another model.
    expect(num(rows[0]!, 'teacher_kl/dataset_0')).to.not.equal(num(rows[0]!, 'teacher_kl/dataset_1'));
  });

  it('off-policy top-K distillation (2-D cross_entropy on the teacher top-K prompt logprobs): the loss falls', () => {
    const loss = steps(cookbook('distill_off_policy_topk'), 8).map((r) => num(r, 'train/loss:sum'));
    expect(mean(loss.slice(-2))).to.be.below(0.95 * loss[0]!);
  });

  // RL that really updates the policy, in the direction of its reward. A random model earns the
  // same reward on every sample (no stop sequence within max_tokens), so every advantage is 0 and
  // nothing is learnt. The SFT state (deterministic: fixed data and order, CPU training) answers
  // concisely (fits in max_tokens=10: format reward) or verbosely ("The answer is a + b = c.", cut
  // off: -0.1). Measured at RL step 0 over 6 runs: 63-88% of samples earn the format reward and
  // 38-88% (mean 65%) of the groups of 4 are mixed, so a step without any mixed group among its 8
  // has a chance of about 0.35^8 ≈ 2e-4; a step without one changes nothing, so 4 such steps in a
  // row have about (2e-4)^4 (grad_norm > 0 is asserted over the run). Every mixed group favours the concise samples over the verbose ones (a
  // verbose answer never scores above a concise one unless its truncated sum happens to be right:
  // ~1% of samples), so RL lowers the probability of starting the verbose answer. That probability
  // is read exactly (prompt logprobs of the saved weights, 64 fixed problems) before and after the
  // RL steps: 0.19 after SFT. Sampling is unseeded (the recipe sets no seed), so runs differ. With 4
  // steps, 7 of 8 runs ended at 0.005-0.018, 10-40 times lower, but one stable_reinforce run only at
  // 0.126 (CI, 2026-12-01): too close to the bound. With 6 steps (the recipe's max_steps here):
  // 0.0001-0.0055 (stable_reinforce) and 0.0013-0.029 (gspo) in 3 runs each, 7-1900 times
  // lower. The bound, half,
  // leaves a wide margin; the sampled format rate rose too but 32 samples a step make it too noisy to assert.
  let sft: Run;
  it('SFT on the arithmetic environment\'s prompts (concise or verbose answers): the NLL falls', () => {
    sft = cookbook('arithmetic_sft');
    sftFromRandom(sft, 64, 8, 2);
  });

  for (const lossFn of ['', 'gspo']) {
    it(`RL from the SFT state with ${lossFn ? `loss_fn=${lossFn}` : 'the default loss (stable_reinforce)'}: the penalised answer becomes less likely`, function () {
      if (!sft) throw new Error('needs the SFT run above, which failed');
      const state = sft.checkpoints.at(-1)!.state_path;
      const rl: Run = cookbook('math_rl_from_sft', `load_checkpoint_path=${state}`, `loss_fn=${lossFn}`);
      expect(rl.cmd.join(' ')).to.not.match(/loss_fn=importance_sampling/);
      const rows = steps(rl, 6);
      checkRl(rl, 6);
      // The RL policy starts from the SFT weights: far more certain than the random base model
      // (whose entropy is about ln 1029 = 6.9, as in the plain math_rl run).
      expect(num(rows[0]!, 'optim/entropy')).to.be.below(3);
      expect(Math.max(...rows.map((r) => num(r, 'grad_norm')))).to.be.above(1e-3);
      const before = sft.checkpoints.at(-1)!.sampler_path as string;
      const after = (rl.checkpoints.at(-1) as { sampler_path: string }).sampler_path;
      const probe = server.runPython(['test/e2e/cookbook/policy_probe.py', 'math_rl', TINY_MODEL_DIR, 'role_colon', before, after]);
      expect(probe.verbose_token).to.equal(' The');
      const [p0, p1] = [mean(probe.paths[before]), mean(probe.paths[after])];
      const fmt = rows.map((r) => num(r, 'env/all/format').toFixed(2)).join(' ');
      console.log(`      ${lossFn || 'stable_reinforce'}: P(verbose) ${p0.toFixed(4)} -> ${p1.toFixed(4)}; format by step ${fmt}; mixed groups at step 0 ${num(rows[0]!, 'env/all/by_group/frac_mixed')}`);
      expect(p0, 'P(verbose) after SFT').to.be.within(0.05, 0.6);
      expect(p1, `P(verbose) after RL (was ${p0})`).to.be.below(p0 / 2);
    });
  }

  it('a recipe naming a model the server does not serve fails at once, naming the model and the served ones', () => {
    const unserved = path.join(workdir, 'Qwen/Qwen3-8B-Base'); // the tiny tokenizer, under a path not served
    const t0 = Date.now();
    let message = '';
    try {
      cookbook('chat_sl', `model_name=${unserved}`);
    } catch (e) {
      message = String(e);
    }
    expect(message).to.match(/NotFoundError.*base model '.*Qwen3-8B-Base' is not served here; served models: .*tiny-qwen3/);
    expect(Date.now() - t0).to.be.below(60_000);
  });
});
