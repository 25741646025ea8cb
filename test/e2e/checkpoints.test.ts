import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/** Checkpoints, resume and sampler versions through the real SDK, including a restart of the whole stack. */
describe('checkpoints through the SDK', function () {
  this.timeout(600_000);
  const server = new E2EServer();
  before(async () => server.start());
  after(async () => server.destroy());
  const run = (...args: string[]) => server.runPython(['test/e2e/sdk_checkpoints.py', TINY_MODEL_ALIAS, ...args]);

  it('resumes from save_state with the optimizer exactly, and without it from a fresh Adam state', () => {
    const out = run('resume');
    const [orig, withOpt, without] = out.step_loss as number[];
    const [a0, a1, a2] = out.loaded_loss as number[];
    // Loaded weights are identical.
    expect(Math.abs(a1! - a0!)).to.be.below(1e-6);
    expect(Math.abs(a2! - a0!)).to.be.below(1e-6);
    // The step's own loss is computed before the update: the same on all three.
    expect(Math.abs(without! - orig!)).to.be.below(1e-6);
    // One identical step: with the optimizer state the result is the original's, to 1e-6 ...
    expect(Math.abs(withOpt! - orig!)).to.be.below(1e-6);
    const [o, w, wo] = out.after_loss as number[];
    expect(Math.abs(w! - o!)).to.be.below(1e-6 * Math.max(1, Math.abs(o!)));
    // ... and without it Adam starts over, so the step (hence the next loss) differs.
    expect(Math.abs(wo! - o!)).to.be.above(1e-4);
    expect(out.weights_info).to.deep.include({ is_lora: true, lora_rank: 4 });
    expect(new Set(out.ids).size).to.equal(3);
  });

  it('serves a step-5 sampler checkpoint unchanged after 10 more steps and after a restart of the whole stack', async () => {
    const out = run('sampler');
    const at = out.at_save as (number | null)[];
    expect(at[0]).to.equal(null);
    expect(at).to.have.length(8);
    (out.after_training as (number | null)[]).forEach((v, i) => (i ? expect(v).to.be.closeTo(at[i]!, 1e-6) : expect(v).to.equal(null)));
    // The live weights did move: the newer checkpoint scores differently.
    const maxDiff = Math.max(...(out.live as (number | null)[]).slice(1).map((v, i) => Math.abs(v! - at[i + 1]!)));
    expect(maxDiff).to.be.above(1e-3);
    expect(out.checkpoints).to.include.members(['sampler_weights/step-5', 'sampler_weights/step-15']);

    await server.stop();
    await server.start();
    const again = run('rescore', out.path).after_restart as (number | null)[];
    again.forEach((v, i) => (i ? expect(v).to.be.closeTo(at[i]!, 1e-6) : expect(v).to.equal(null)));
  });

  it('answers bad checkpoint input with user errors and leaves the model unchanged', () => {
    const out = run('bad');
    expect(out.missing).to.match(/NotFoundError.*never-saved does not exist/);
    expect(out.incompatible).to.match(/BadRequestError.*has LoRA \(rank 8.*has \(rank 4/);
    expect(out.sampler_path).to.match(/BadRequestError.*not a training checkpoint/);
    expect(out.malformed).to.match(/BadRequestError.*is not a tinker path/);
    expect(out.duplicate_name).to.match(/already exists; pass overwrite=True/);
    expect(out.unchanged).to.equal(true);
    expect(out.still_trains).to.be.a('number');
  });
});
