import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { REDIS_URL } from '../test/helpers/stack.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';

/**
 * What co-batching gives N training loops on one agent (workers/agent/training.ts,
 * tinker_engine/cobatch.py): the start command as a user starts it, N clients each running
 * forward_backward + optim_step steps with small batches, all at once with TB_COBATCH_MAX=N (their
 * forward_backward ops share engine passes), against the same N loops one after another, and all at
 * once without co-batching (TB_COBATCH_MAX=1: the engine runs their ops in turn), and all at once
 * co-batched with a gather window (TB_COBATCH_WAIT_MS=$COBATCH_WAIT_MS, default 25; 0 skips that run). It prints
 * the trained tokens/s of each way and their ratio, and each loop's p99 step latency together
 * against its solo p50 (fairness: no loop waits on the others beyond the shared passes).
 *
 *   node --import tsx bench/cobatch.ts [loops=4] [steps=30] [datums=2] [seqLen=64] [model=tiny] [device]
 *
 * On the GPU: the model path and `cuda` (bench/gpu/cobatch.sh).
 */
const [loops, steps, datums, seqLen] = [4, 30, 2, 64].map((d, i) => Number(process.argv[2 + i] ?? d)) as [number, number, number, number];
const model = process.argv[6] ?? TINY_MODEL_ALIAS;
const device = process.argv[7];

type Run = { seconds: number; tokens: number; stepMs: number[][]; passes: Map<number, number[]> };

const waitMs = Number(process.env.COBATCH_WAIT_MS ?? 25);

async function run(together: boolean, cobatch: number, cobatchWaitMs = 0): Promise<Run> {
  const env: Record<string, string> = { TB_COBATCH_MAX: String(cobatch), TB_COBATCH_WAIT_MS: String(cobatchWaitMs), TB_LONG_POLL_MS: '25000', TB_SNAPSHOT_EVERY_STEPS: '0' };
  if (model !== TINY_MODEL_ALIAS) env.TB_AGENT_MODELS = `${model}=bench-model`;
  if (device) env.TB_ENGINE_DEVICE = device;
  const server = new E2EServer(env);
  try {
    await server.start();
    const base = server.baseUrl;
    const session = (await post(base, '/create_session', { tags: [], user_metadata: {}, sdk_version: '0.38.0', type: 'create_session' })).session_id;
    const batch = benchBatch(seqLen).slice(0, 1);
    const data = Array.from({ length: datums }, () => batch[0]!);
    const tokensPerStep = data.reduce((s, d) => s + d.tokens.length, 0);
    const models: string[] = [];
    for (let k = 0; k < loops; k++) {
      const cm = await post(base, '/create_model', { session_id: session, model_seq_id: k, base_model: model === TINY_MODEL_ALIAS ? TINY_MODEL_ALIAS : 'bench-model', lora_config: { rank: 32, seed: k } });
      models.push((await result(base, cm.request_id)).model_id);
    }
    const fbIds: string[] = [];
    // Each model's seq_ids go on from its warm-up: a seq_id used again is a replay of that op, answered
    // with its result without running it (before 2026-12-07 the timed steps restarted at 1, so the first
    // three of each loop were replays of the warm-up's).
    const seqs = new Map<string, number>();
    const loop = async (modelId: string, n: number, times: number[], timed = true) => {
      let seq = seqs.get(modelId) ?? 1;
      for (let i = 0; i < n; i++) {
        const t = performance.now();
        const fb = await post(base, '/forward_backward', undefined, encodeForwardBackward({ modelId, seqId: seq++, data }));
        if (timed) fbIds.push(fb.request_id);
        await result(base, fb.request_id);
        const opt = await post(base, '/optim_step', { model_id: modelId, seq_id: seq++, adam_params: BENCH_ADAM });
        await result(base, opt.request_id);
        times.push(performance.now() - t);
      }
      seqs.set(modelId, seq);
    };
    for (const m of models) await loop(m, 3, [], false); // warm-up
    const stepMs = models.map(() => [] as number[]);
    const t0 = performance.now();
    if (together) await Promise.all(models.map((m, k) => loop(m, steps, stepMs[k]!)));
    else for (const [k, m] of models.entries()) await loop(m, steps, stepMs[k]!);
    const seconds = (performance.now() - t0) / 1000;
    return { seconds, tokens: loops * steps * tokensPerStep, stepMs, passes: await passes(server.prefix, fbIds) };
  } finally {
    await server.stop();
  }
}

/** The timed forward_backward ops by the size of the engine pass they ran in: each op's engine time (ms), from its outcome record. */
async function passes(prefix: string, requestIds: string[]): Promise<Map<number, number[]>> {
  const names = new Names(prefix);
  const redis = new Redis(REDIS_URL);
  try {
    const out = new Map<number, number[]>();
    const recs = requestIds.length ? await redis.mget(requestIds.map((id) => names.outcome(id.split('/')[1]!))) : [];
    for (const raw of recs) {
      if (!raw) continue;
      const o = JSON.parse(raw) as { cobatch?: number; engine?: [number, number] };
      const size = o.cobatch ?? 1;
      if (!out.has(size)) out.set(size, []);
      if (o.engine) out.get(size)!.push(o.engine[1] - o.engine[0]);
    }
    return out;
  } finally {
    redis.disconnect();
  }
}

function pct(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]!;
}

runBench(async () => {
  const alone = await run(false, 1);
  const plain = await run(true, 1);
  const together = await run(true, loops);
  const gathered = waitMs > 0 ? await run(true, loops, waitMs) : undefined;
  const tps = (r: Run) => r.tokens / r.seconds;
  console.log(`loops=${loops} steps=${steps} datums=${datums} seqLen=${seqLen} model=${model} device=${device ?? 'default'}`);
  console.log(`one after another: ${tps(alone).toFixed(0)} trained tokens/s (${alone.seconds.toFixed(2)} s)`);
  console.log(`together, not co-batched (TB_COBATCH_MAX=1): ${tps(plain).toFixed(0)} trained tokens/s (${plain.seconds.toFixed(2)} s)`);
  console.log(`together, co-batched (TB_COBATCH_MAX=${loops}): ${tps(together).toFixed(0)} trained tokens/s (${together.seconds.toFixed(2)} s)`);
  if (gathered) console.log(`together, co-batched, gather window ${waitMs} ms (TB_COBATCH_WAIT_MS): ${tps(gathered).toFixed(0)} trained tokens/s (${gathered.seconds.toFixed(2)} s)`);
  console.log(`together / one after another = ${(tps(together) / tps(alone)).toFixed(2)}x${gathered ? `; with the gather window ${(tps(gathered) / tps(alone)).toFixed(2)}x` : ''}`);
  const ways = [['one after another', alone], ['together, co-batched', together], ...(gathered ? [[`co-batched, window ${waitMs} ms`, gathered] as const] : [])] as const;
  for (const [name, r] of ways)
    console.log(`${name}: forward_backward ops by engine pass size: ${[...r.passes].sort((a, b) => a[0] - b[0]).map(([n, ms]) => `${n}: ${ms.length} ops, engine p50 ${ms.length ? pct(ms, 50).toFixed(1) : '-'} ms`).join('; ')}`);
  for (const [name, r] of ways.slice(1))
    for (let k = 0; k < loops; k++)
      console.log(`${name}, loop ${k}: step p50 alone ${pct(alone.stepMs[k]!, 50).toFixed(1)} ms, p99 together ${pct(r.stepMs[k]!, 99).toFixed(1)} ms (${(pct(r.stepMs[k]!, 99) / pct(alone.stepMs[k]!, 50)).toFixed(2)}x)`);
});
