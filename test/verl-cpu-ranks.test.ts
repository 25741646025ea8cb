import os from 'node:os';
import { expect } from 'chai';
import { cpuRanksOf, verlLaunch } from '../workers/adapters/verl.js';
import type { BaseModelSpec } from '../queues/infra/config.js';

/**
 * The verl adapter's launch on CPU ranks (issue 37 item 1; the run itself: test/e2e/verl-ranks.test.ts):
 * a `cpu` agent starts its models' `parallelism.data` ranks under torchrun with no GPU visible.
 */
type Spec = BaseModelSpec & { dataParallel?: number };
const spec = (over: Partial<Spec> = {}): Spec => ({ name: '/m/a', path: '/m/a', aliases: ['a'], trainable: true, loraMaxRank: 64, topkMax: 20, ...over });

describe('verl adapter on CPU ranks', () => {
  const saved = process.env.OMP_NUM_THREADS;
  afterEach(() => {
    if (saved === undefined) delete process.env.OMP_NUM_THREADS;
    else process.env.OMP_NUM_THREADS = saved;
  });

  it('starts parallelism.data ranks under torchrun, no GPU visible, the cores split between them', () => {
    delete process.env.OMP_NUM_THREADS;
    const l = verlLaunch('cpu', [spec({ dataParallel: 4, strategy: 'veomni' })]);
    expect(l.nproc).to.equal(4);
    expect(l.args).to.deep.equal(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=4', '-m', 'tinker_engine_verl']);
    expect(l.env).to.include({ CUDA_VISIBLE_DEVICES: '', TB_VERL_STRATEGY: 'veomni', TB_VERL_OFFLOAD: '0' });
    expect(l.env.OMP_NUM_THREADS).to.equal(String(Math.max(1, Math.floor(os.availableParallelism() / 4))));
    process.env.OMP_NUM_THREADS = '3';
    expect(verlLaunch('cpu', [spec({ dataParallel: 2 })]).env.OMP_NUM_THREADS, "the operator's setting stays").to.equal('3');
  });

  it('reads the rank count only on a cpu device, and only when the models agree', () => {
    expect(cpuRanksOf('cpu', [spec({ dataParallel: 2 }), spec({ name: '/m/b', path: '/m/b' })])).to.equal(2);
    expect(cpuRanksOf('cpu', [spec()])).to.equal(null);
    expect(cpuRanksOf('cuda:0,1', [spec({ dataParallel: 2 })])).to.equal(null);
    expect(() => cpuRanksOf('cpu', [spec({ dataParallel: 2 }), spec({ dataParallel: 4 })])).to.throw(/one rank count; the agent's models ask for parallelism.data 2, 4/);
    // On GPUs the device decides (presets/schema.ts checks that data equals the GPU count).
    expect(verlLaunch('cuda:0,1', [spec({ dataParallel: 2 })]).env.CUDA_VISIBLE_DEVICES).to.equal('0,1');
  });

  it('refuses a cpu agent whose models set no rank count, naming both ways to run', () => {
    expect(() => verlLaunch('cpu', [spec()])).to.throw(/runs on GPUs: device 'cpu' is not cuda, cuda:N or cuda:N,M,… \(on CPU ranks: device cpu and the model's parallelism.data = the rank count\)/);
    expect(() => verlLaunch(undefined, [spec({ dataParallel: 2 })])).to.throw(/runs on GPUs: device ''/);
  });
});
