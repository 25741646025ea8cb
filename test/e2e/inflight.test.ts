import { expect } from 'chai';
import { suiteRunningScript } from './server.js';

/**
 * Sampler kinds (SDK 0.38 `SamplingClientKind`): a snapshot client keeps the weights it was created
 * with; every inflight client of a training model samples that model's newest inflight save, "the
 * weights saved when the client was created, or newer", never older; a snapshot save does not
 * move the inflight target.
 */
type Lps = number[];
const maxDiff = (a: Lps, b: Lps) => Math.max(...a.map((v, i) => Math.abs(v - b[i]!)));

describe('inflight sampling clients follow the newest inflight save', function () {
  this.timeout(600_000);
  const suite = suiteRunningScript('test/e2e/sdk_inflight.py');
  let out: any;
  before(() => (out = suite.output()));

  it('trains: each step moves the prompt logprobs', () => {
    expect(out.loss2).to.be.below(out.loss1);
    expect(out.loss3).to.be.below(out.loss2);
    expect(maxDiff(out.stage1.inf_b, out.stage0.inf_a)).to.be.above(1e-2);
  });

  it('before any training, snapshot and inflight clients agree', () => {
    expect(maxDiff(out.stage0.snap0, out.stage0.inf_a)).to.be.below(1e-6);
  });

  it('after the next inflight save, the older inflight client samples the newer weights; the snapshot does not', () => {
    expect(maxDiff(out.stage1.inf_a, out.stage1.inf_b)).to.be.below(1e-6);
    expect(maxDiff(out.stage1.snap0, out.stage0.snap0)).to.be.below(1e-6);
  });

  it('a snapshot save leaves the inflight target where it was', () => {
    expect(maxDiff(out.stage2.inf_a, out.stage1.inf_b)).to.be.below(1e-6);
    expect(maxDiff(out.stage2.inf_b, out.stage1.inf_b)).to.be.below(1e-6);
    expect(maxDiff(out.stage2.snap2, out.stage2.inf_a)).to.be.above(1e-2);
  });

  it('every inflight client moves to the newest inflight save, never back', () => {
    for (const c of ['inf_a', 'inf_b']) expect(maxDiff(out.stage3[c], out.stage3.inf_c), c).to.be.below(1e-6);
    expect(maxDiff(out.stage3.inf_c, out.stage2.snap2)).to.be.above(1e-2);
    expect(maxDiff(out.stage3.snap2, out.stage2.snap2)).to.be.below(1e-6);
    expect(maxDiff(out.stage3.snap0, out.stage0.snap0)).to.be.below(1e-6);
  });
});
