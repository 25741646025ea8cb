import { expect } from 'chai';
import type { ForwardBackwardJob } from '../queues/contract/schemas.js';
import { logger } from '../queues/infra/logger.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_DIR } from '../scripts/stack.js';
import { TorchAdapter } from '../workers/adapters/torch.js';

/**
 * A custom-loss forward_backward among co-batched ones (workers/adapters/torch.ts
 * `forwardBackwardGroup`): the catalogue-loss members share one engine pass, the custom-loss member
 * runs in its own pass after it. Each member's result equals its twin model's solo run, and a
 * custom-loss member's bad datum fails that member alone. Real engine, tiny model, CPU.
 */
const log = logger.child({ test: 'custom-loss-cobatch' });

/** -(logprobs * adv).sum(), with metric custom/weighted:sum = (logprobs * adv).sum(): the SDK's encoding of the traced function. */
const SPEC = {
  name: 'weighted',
  inputs: [{ name: 'logprobs', rank: 1 as const }, { name: 'adv', rank: 1 as const }],
  graph: {
    format: 1 as const,
    nodes: [
      { op: 'placeholder' as const, name: 'logprobs', target: 'logprobs', args: [], kwargs: {} },
      { op: 'placeholder' as const, name: 'adv', target: 'adv', args: [], kwargs: {} },
      { op: 'call_function' as const, name: 'mul', target: 'operator.mul', args: [{ ref: 'logprobs' }, { ref: 'adv' }], kwargs: {} },
      { op: 'call_method' as const, name: 'sum_1', target: 'sum', args: [{ ref: 'mul' }], kwargs: {} },
      { op: 'call_function' as const, name: 'neg', target: 'operator.neg', args: [{ ref: 'sum_1' }], kwargs: {} },
      { op: 'output' as const, name: 'output', target: 'output', args: [{ tuple: [{ ref: 'neg' }, { dict: { 'custom/weighted:sum': { ref: 'sum_1' } } }] }], kwargs: {} },
    ],
  },
};

const t = (dtype: 'int64' | 'float32', data: number[]) => ({ dtype, shape: [data.length], data });
const ce = (model: string): ForwardBackwardJob => ({
  op: 'forward_backward',
  model_id: model,
  seq_id: 1,
  loss_fn: 'cross_entropy',
  loss_fn_config: {},
  forward_only: false,
  data: [{ tokens: [5, 9, 13, 21], loss_fn_inputs: { target_tokens: t('int64', [9, 13, 21, 30]) } }],
});
const custom = (model: string, adv = true): ForwardBackwardJob => ({
  op: 'forward_backward',
  model_id: model,
  seq_id: 1,
  loss_fn: 'custom',
  loss_fn_config: { loss_id: 'x' },
  forward_only: false,
  custom_loss: SPEC,
  data: [
    { tokens: [7, 8, 9], loss_fn_inputs: { target_tokens: t('int64', [8, 9, 10]), ...(adv ? { adv: t('float32', [1, -0.5, 2]) } : {}) } },
    { tokens: [40, 41, 42, 43, 44], loss_fn_inputs: { target_tokens: t('int64', [41, 42, 43, 44, 45]), adv: t('float32', [0.5, 0.5, -1, 1, 0.25]) } },
  ],
});

describe('a custom-loss forward_backward in a co-batched group', function () {
  this.timeout(300_000);
  const a = new TorchAdapter({ python: defaultPython(), device: 'cpu', log });

  before(async () => {
    ensureTinyModel(defaultPython());
    await a.start();
    await a.loadBase({ name: 'tiny', path: TINY_MODEL_DIR, aliases: ['tiny'], trainable: true, loraMaxRank: 8, topkMax: 5 });
    for (const [id, seed] of [['ce-g', 1], ['ce-s', 1], ['cu-g', 2], ['cu-s', 2], ['bad', 3]] as const)
      await a.createModel({ op: 'create_model', model_id: id, seq_id: 0, base_model: 'tiny', lora: { rank: 2, seed, train_unembed: false, train_mlp: true, train_attn: true } } as never);
  });
  after(async () => a.stop());

  it('each member equals its solo twin; a bad custom member fails alone', async () => {
    const group = await a.forwardBackwardGroup!([ce('ce-g'), custom('cu-g'), custom('bad', false)]);
    const [g0, g1, g2] = group;
    if (!g0 || !g1 || g0 instanceof Error || g1 instanceof Error) throw new Error(`a member failed: ${String(g0)} ${String(g1)}`);
    expect(g2).to.be.instanceOf(Error);
    expect((g2 as Error).message).to.include("datum 0: custom loss 'weighted' reads loss_fn_inputs['adv'], which the datum lacks");
    const s0 = await a.forwardBackward(ce('ce-s'));
    const s1 = await a.forwardBackward(custom('cu-s'));
    // Same model weights (same LoRA seed), same datums: equal up to float32 summation order of a shared pass.
    const near = (x: number, y: number) => Math.abs(x - y) <= 1e-5 * Math.max(1, Math.abs(y));
    expect(near(g0.metrics['loss:sum']!, s0.metrics['loss:sum']!), JSON.stringify([g0.metrics, s0.metrics])).to.equal(true);
    expect(Object.keys(g1.metrics).sort()).to.deep.equal(['custom/weighted:sum', 'loss:sum']);
    for (const k of Object.keys(s1.metrics)) expect(near(g1.metrics[k]!, s1.metrics[k]!), `${k}: ${JSON.stringify([g1.metrics, s1.metrics])}`).to.equal(true);
    // The loss is the negated metric: the graph ran as traced.
    expect(near(g1.metrics['loss:sum']!, -g1.metrics['custom/weighted:sum']!)).to.equal(true);
    expect(g1.loss_fn_outputs.map((o) => o.logprobs!.shape)).to.deep.equal([[3], [5]]);
  });
});
