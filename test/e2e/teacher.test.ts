import path from 'node:path';
import { expect } from 'chai';
import { E2EServer } from './server.js';

/** Preset cpu/tiny_teacher.yaml: a tiny actor trains while a tiny frozen teacher serves prompt logprobs and top-K by name. */
describe('a teacher served by name beside a training actor', function () {
  this.timeout(600_000);
  const server = new E2EServer({}, ['--preset', 'presets/cpu/tiny_teacher.yaml']);
  before(async () => server.start());
  after(async () => server.destroy());

  it('serves the teacher, bounds top-K, and refuses to train it', () => {
    const out = server.runPython(['test/e2e/sdk_teacher.py', 'tiny-qwen3', 'tiny-qwen3-teacher']);
    expect(out.caps[path.resolve('models/tiny-qwen3')]).to.deep.equal({ trainable: true, sampleable: true });
    expect(out.caps[path.resolve('models/tiny-qwen3-teacher')]).to.deep.equal({ trainable: false, sampleable: true });
    // The actor learns while the teacher, frozen, scores the prompt identically every time.
    expect(out.losses[2]).to.be.below(out.losses[0]);
    for (const lp of out.teacher_logprobs.slice(1)) lp.forEach((v: number | null, i: number) => (i ? expect(v).to.be.closeTo(out.teacher_logprobs[0][i], 1e-6) : expect(v).to.equal(null)));
    // It is another model than the actor's base.
    const diff = Math.max(...out.teacher_logprobs[0].slice(1).map((v: number, i: number) => Math.abs(v - out.actor_base_logprobs[i + 1])));
    expect(diff).to.be.above(1e-3);
    // Top-5 prompt logprobs: most likely first, and the prompt token's logprob is consistent with them.
    expect(out.topk[0]).to.equal(null);
    for (let i = 1; i < out.topk.length; i++) {
      const row = out.topk[i] as [number, number][];
      expect(row).to.have.length(5);
      for (let j = 1; j < 5; j++) expect(row[j]![1]).to.be.at.most(row[j - 1]![1]);
      expect(out.prompt_logprobs[i]).to.be.at.most(row[0]![1] + 1e-6);
      expect(out.prompt_logprobs[i]).to.be.closeTo(out.teacher_logprobs[0][i], 1e-5);
    }
    expect(out.topk_too_large).to.match(/topk_prompt_logprobs 50 exceeds the bound for this model \(20\)/);
    expect(out.train_teacher).to.match(/tiny-qwen3-teacher' is frozen here/);
  });
});
