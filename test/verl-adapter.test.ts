import { expect } from 'chai';
import { Agent } from '../workers/agent.js';
import { engineOf } from '../workers/adapters/index.js';
import { TorchAdapter } from '../workers/adapters/torch.js';
import { readFileSync } from 'node:fs';
import { gpusOf, VERL_STRATEGIES, VerlAdapter, verlLaunch } from '../workers/adapters/verl.js';
import { ModelSpec } from '../presets/schema.js';
import { logger } from '../queues/infra/logger.js';
import type { BaseModelSpec } from '../queues/infra/config.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_DIR } from '../scripts/stack.js';

const log = logger.child({ test: 'verl-adapter' });
const spec = (over: Partial<BaseModelSpec> = {}): BaseModelSpec => ({
  name: '/m/a',
  path: '/m/a',
  aliases: ['a'],
  trainable: true,
  loraMaxRank: 64,
  topkMax: 20,
  ...over,
});

describe('verl adapter', () => {
  it('reads the GPUs of a device', () => {
    expect(gpusOf('cuda')).to.deep.equal([0]);
    expect(gpusOf('cuda:3')).to.deep.equal([3]);
    expect(gpusOf('cuda:0,1,2,3')).to.deep.equal([0, 1, 2, 3]);
    expect(gpusOf('cpu')).to.equal(null);
    expect(gpusOf(undefined)).to.equal(null);
    expect(gpusOf('cuda:')).to.equal(null);
  });

  it('launches one process per GPU under torchrun with the preset strategy and offload', () => {
    const l = verlLaunch('cuda:4,5', [spec({ strategy: 'fsdp2', offload: true })]);
    expect(l.nproc).to.equal(2);
    expect(l.args).to.deep.equal(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '-m', 'tinker_engine_verl']);
    expect(l.env).to.include({ CUDA_VISIBLE_DEVICES: '4,5', TB_VERL_STRATEGY: 'fsdp2', TB_VERL_OFFLOAD: '1' });
    const d = verlLaunch('cuda', [spec()]);
    expect(d.env).to.include({ CUDA_VISIBLE_DEVICES: '0', TB_VERL_STRATEGY: 'fsdp2', TB_VERL_OFFLOAD: '0' });
    expect(() => verlLaunch('cpu', [spec()])).to.throw(/runs on GPUs: device 'cpu'/);
    expect(() => verlLaunch('cuda', [spec({ strategy: 'megatron' })])).to.throw(/strategy 'megatron' is not available/);
    expect(() => verlLaunch('cuda', [spec({ strategy: 'fsdp' }), spec({ strategy: 'fsdp2' })])).to.throw(/one strategy/);
    expect(verlLaunch('cuda:1', [spec({ strategy: 'veomni' })]).env).to.include({ TB_VERL_STRATEGY: 'veomni' });
  });

  it("passes the preset's padding and checkpointing levers, over the agent's settings, and only where a model sets them", () => {
    expect(Object.keys(d0().env)).to.not.include.members(['TB_VERL_REMOVE_PADDING']);
    expect(Object.keys(d0().env)).to.not.include.members(['TB_VERL_GRAD_CKPT']);
    const l = verlLaunch('cuda:0', [spec({ removePadding: true, gradientCheckpointing: false }), spec({ name: '/m/b', path: '/m/b' })]);
    expect(l.env).to.include({ TB_VERL_REMOVE_PADDING: '1', TB_VERL_GRAD_CKPT: '0' });
    expect(() => verlLaunch('cuda', [spec({ removePadding: true }), spec({ name: '/m/b', path: '/m/b', removePadding: false })])).to.throw(/one remove_padding setting/);
    // The adapter's engine environment: the agent's settings (auto by default), the models' levers over them.
    const a = new VerlAdapter({ python: 'python3', device: 'cuda:0', log, models: [spec({ removePadding: false })] });
    const env = (a as unknown as { opts: { env: Record<string, string> } }).opts.env;
    expect(env).to.include({ TB_VERL_REMOVE_PADDING: '0', TB_VERL_GRAD_CKPT: 'auto' });
  });

  const d0 = () => verlLaunch('cuda', [spec()]);

  it('knows the strategies the Python engine runs, and the preset schema accepts exactly those', () => {
    const py = /^STRATEGIES = \(([^)]*)\)/m.exec(readFileSync('workers/python/tinker_engine_verl/settings.py', 'utf8'));
    expect(py, 'STRATEGIES in tinker_engine_verl/settings.py').to.not.equal(null);
    expect([...py![1]!.matchAll(/"(\w+)"/g)].map((m) => m[1])).to.deep.equal([...VERL_STRATEGIES]);
    const model = (strategy: string) => ModelSpec.safeParse({ name: 'a', path: '/m/a', role: 'actor', engine: 'verl', parallelism: { strategy } }).success;
    for (const s of VERL_STRATEGIES) expect(model(s), s).to.equal(true);
    expect(model('megatron')).to.equal(false);
  });

  it('is the adapter of verl agents; it trains only', async () => {
    const base = { redisUrl: 'redis://x', prefix: 'p', storageDir: '/tmp', retentionS: 1, agentId: 'a', models: [spec()], python: 'python3', sampleConcurrency: 1, engineRestart: false };
    const v = Agent.adapterFor({ ...base, engine: 'verl', engineDevice: 'cuda:0,1' }, log);
    expect(v).to.be.instanceOf(VerlAdapter);
    expect(v.kind).to.equal('verl');
    expect(engineOf(v.kind).capabilities).to.include({ trains: true, samples: false, gpuOnly: true });
    const torch = Agent.adapterFor({ ...base, engineDevice: 'cpu' }, log);
    expect(torch).to.be.instanceOf(TorchAdapter);
    expect(engineOf(torch.kind).capabilities).to.include({ trains: true, samples: true });
    expect(() => Agent.adapterFor({ ...base, engine: 'verl', engineDevice: 'cpu' }, log)).to.throw(/runs on GPUs/);
    const err = await (v as VerlAdapter).sample({} as never).then(
      () => null,
      (e: Error) => e,
    );
    expect(err?.message).to.match(/trains only/);
  });

  it('keeps the engine channel intact through torchrun (rank 0 inherits the pipes)', async function () {
    this.timeout(240_000);
    const python = defaultPython();
    ensureTinyModel(python);
    // The torch engine started the way the verl engine is (torch.distributed.run, one process):
    // the frames must pass through torchrun untouched, and closing stdin must end both.
    const a = new TorchAdapter({
      python,
      device: 'cpu',
      log,
      launch: { args: ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1', '-m', 'tinker_engine'], env: { OMP_NUM_THREADS: '1' } },
    });
    await a.start();
    try {
      expect(a.device).to.equal('cpu');
      const served = await a.loadBase({ name: 'tiny', path: TINY_MODEL_DIR, aliases: ['tiny'], trainable: true, loraMaxRank: 8, topkMax: 5 });
      expect(served.vocab_size).to.be.greaterThan(1000);
      await a.createModel({ op: 'create_model', model_id: 'm', seq_id: 0, base_model: 'tiny', lora: { rank: 2, seed: 1, train_unembed: false, train_mlp: true, train_attn: true } } as never);
      const r = await a.forwardBackward({
        op: 'forward_backward',
        model_id: 'm',
        seq_id: 1,
        loss_fn: 'cross_entropy',
        loss_fn_config: {},
        forward_only: true,
        data: [{ tokens: [5, 6, 7], loss_fn_inputs: { target_tokens: { dtype: 'int64', shape: [3], data: [6, 7, 8] } } }],
      } as never);
      expect(r.loss_fn_outputs[0]?.logprobs?.shape).to.deep.equal([3]);
      expect(r.metrics['loss:sum']).to.be.greaterThan(0);
    } finally {
      await a.stop();
    }
  });
});
