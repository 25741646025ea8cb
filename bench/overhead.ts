import { performance } from 'node:perf_hooks';
import { logger } from '../queues/logger.js';
import { EngineProcess } from '../workers/engine.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../scripts/stack.js';
import { awaitFuture, call, startStack } from '../test/helpers/stack.js';
import { encodeForwardBackward, type TestDatum } from '../test/helpers/wire.js';

/**
 * Broker overhead: the same training step (forward_backward + optim_step on the tiny model)
 * run (a) straight on the engine over its stdio channel and (b) through the whole stack
 * (HTTP → gate → BullMQ → agent → engine → job state → long-poll), pipelined as the SDK does.
 *
 *   node --import tsx bench/overhead.ts [steps=50] [batch=8] [seqLen=64]
 */
const steps = Number(process.argv[2] ?? 50);
const batchSize = Number(process.argv[3] ?? 8);
const seqLen = Number(process.argv[4] ?? 64);
logger.level = 'warn';

const batch: TestDatum[] = Array.from({ length: batchSize }, (_, b) => {
  const toks = Array.from({ length: seqLen + 1 }, (_, i) => (b * 31 + i * 7) % 1000);
  return { tokens: toks.slice(0, -1), targets: toks.slice(1), weights: Array(seqLen).fill(1) };
});
const adam = { learning_rate: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };

function stats(ms: number[]): string {
  const s = [...ms].sort((a, b) => a - b);
  const q = (p: number) => s[Math.min(s.length - 1, Math.floor(p * s.length))]!.toFixed(1);
  return `p50 ${q(0.5)} ms, p90 ${q(0.9)} ms, mean ${(ms.reduce((a, b) => a + b, 0) / ms.length).toFixed(1)} ms`;
}

async function direct(): Promise<number[]> {
  const e = new EngineProcess({ python: defaultPython(), log: logger });
  e.start();
  await e.call('hello', {});
  await e.call('load_base', { name: TINY_MODEL_DIR, path: TINY_MODEL_DIR });
  await e.call('create_model', { model_id: 'bench', base_model: TINY_MODEL_DIR, lora: { rank: 8, seed: 0, train_unembed: true, train_mlp: true, train_attn: true } });
  const data = batch.map((d) => ({
    tokens: d.tokens,
    loss_fn_inputs: {
      target_tokens: { dtype: 'int64', shape: [seqLen], data: d.targets },
      weights: { dtype: 'float32', shape: [seqLen], data: d.weights },
    },
  }));
  const times: number[] = [];
  for (let i = 0; i < steps; i++) {
    const t = performance.now();
    await e.call('forward_backward', { model_id: 'bench', loss_fn: 'cross_entropy', loss_fn_config: {}, forward_only: false, data });
    await e.call('optim_step', { model_id: 'bench', adam });
    times.push(performance.now() - t);
  }
  await e.stop();
  return times;
}

async function throughStack(): Promise<{ steps: number[]; createModel: number }> {
  const s = await startStack({ longPollMs: 25_000 });
  try {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    let t = performance.now();
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 8, seed: 0 } });
    const modelId = (await awaitFuture(s.baseUrl, cm.json.request_id)).json.model_id;
    const createModel = performance.now() - t;
    const times: number[] = [];
    let seq = 1;
    for (let i = 0; i < steps; i++) {
      t = performance.now();
      const fb = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId: seq++, data: batch }) });
      const op = await call(s.baseUrl, 'POST', '/optim_step', { model_id: modelId, seq_id: seq++, adam_params: adam });
      await awaitFuture(s.baseUrl, fb.json.request_id, 'application/x-protobuf');
      await awaitFuture(s.baseUrl, op.json.request_id);
      times.push(performance.now() - t);
    }
    return { steps: times, createModel };
  } finally {
    await s.stop();
  }
}

async function main(): Promise<void> {
  ensureTinyModel(defaultPython());
  const d = await direct();
  const st = await throughStack();
  const med = (a: number[]) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)]!;
  console.log(`tiny model, batch ${batchSize} x ${seqLen} tokens, ${steps} steps (forward_backward + optim_step)`);
  console.log(`engine direct : ${stats(d)}`);
  console.log(`through stack : ${stats(st.steps)}`);
  console.log(`broker overhead per step (median difference): ${(med(st.steps) - med(d)).toFixed(1)} ms`);
  console.log(`create_model future round trip: ${st.createModel.toFixed(1)} ms`);
}

main().then(
  () => process.exit(0),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
