import { performance } from 'node:perf_hooks';
import path from 'node:path';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { API_KEY, awaitFuture, call, REDIS_URL } from '../test/helpers/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { runBench } from './client.js';

/**
 * Concurrent one-sample requests against one many-sample request, through the whole stack started
 * from a preset (`tinker-broker start --preset`, as a user runs it). For each target (the base model by
 * each of its names, and a sampler version the actor saves), `rounds` times each:
 *   one request of `n` samples, then `n` concurrent requests of one sample (distinct prompts),
 * every sample exactly `max_tokens` tokens (`stop: []`), with `pause_s` of idleness before each round so
 * that keep-alive connections the servers close are reused. It prints tokens/s of both, their ratio,
 * failed requests, and how many sample jobs each engine's queue ran.
 *
 *   node --import tsx bench/sampling-concurrency.ts [preset=presets/cpu/tiny_vllm.yaml] [rounds=3] [n=32] [max_tokens=64] [pause_s=6]
 */
const preset = process.argv[2] ?? 'presets/cpu/tiny_vllm.yaml';
const arg = (i: number, d: number) => Number(process.argv[3 + i] ?? d);
const [rounds, n, maxTokens, pauseS] = [arg(0, 3), arg(1, 32), arg(2, 64), arg(3, 6)];
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

type Target = { label: string; body: Record<string, unknown> };

async function main(): Promise<void> {
  const server = new E2EServer({ TB_API_KEYS: API_KEY }, ['--preset', preset]);
  const t0 = performance.now();
  await server.start(900_000);
  console.log(`preset ${preset} ready in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
  const url = server.baseUrl;
  const api = (route: string, body: unknown) => call(url, 'POST', route, body);
  const result = async (requestId: string) => {
    const r = await awaitFuture(url, requestId, 'application/json', 400);
    if (r.status !== 200) throw new Error(r.body.toString());
    return r.json;
  };
  const redis = new Redis(REDIS_URL);
  try {
    // The canonical name of the preset's model directory (its sample queues are named after it).
    const base = path.resolve('models/tiny-qwen3');
    const session = (await api('/create_session', { tags: [] })).json.session_id as string;
    let samplerSeq = 0;
    const samplingSession = async (body: Record<string, unknown>) =>
      (await api('/create_sampling_session', { session_id: session, sampling_session_seq_id: samplerSeq++, ...body })).json.sampling_session_id as string;
    // A sampler version saved by the actor (its LoRA starts at zero: the point is the adapter path, not its weights).
    const cm = await api('/create_model', { session_id: session, model_seq_id: 0, base_model: 'tiny-qwen3', lora_config: { rank: 8 } });
    const modelId = (await result(cm.json.request_id)).model_id as string;
    const saved = await result((await api('/save_weights_for_sampler', { model_id: modelId, seq_id: 1, sampling_session_seq_id: samplerSeq++ })).json.request_id);
    const targets: Target[] = [];
    for (const name of ['tiny-qwen3-rollout', 'tiny-qwen3']) targets.push({ label: `base model as '${name}'`, body: { sampling_session_id: await samplingSession({ base_model: name }) } });
    targets.push({ label: 'sampler version (LoRA r8)', body: { sampling_session_id: saved.sampling_session_id } });

    const names = new Names(server.prefix);
    const queues = ['vllm', 'torch'].map((e) => new Queue(names.sampleQueue(base, e), { connection: redis, prefix: names.bull }));
    let seq = 0;
    let failures: string[] = [];
    const sample = async (t: Target, numSamples: number, prompt: number[]): Promise<number> => {
      const sub = await api('/asample', {
        ...t.body,
        seq_id: seq++,
        num_samples: numSamples,
        prompt: { chunks: [{ type: 'encoded_text', tokens: prompt }] },
        sampling_params: { max_tokens: maxTokens, temperature: 1, seed: seq, stop: [] },
      });
      if (sub.status !== 200) {
        failures.push(`asample HTTP ${sub.status}: ${sub.body.toString().slice(0, 200)}`);
        return 0;
      }
      const r = await awaitFuture(url, sub.json.request_id, 'application/json', 400);
      if (r.status !== 200 || r.json?.type !== 'sample') {
        failures.push(`sample failed: ${r.body.toString().slice(0, 300)}`);
        return 0;
      }
      return (r.json.sequences as { tokens: number[] }[]).reduce((a, s) => a + s.tokens.length, 0);
    };
    const timed = async (f: () => Promise<number[]>) => {
      const t = performance.now();
      const toks = (await f()).reduce((a, b) => a + b, 0);
      return { toks, secs: (performance.now() - t) / 1000 };
    };

    console.log(`${rounds} rounds per target; ${n} samples x ${maxTokens} tokens each way; ${pauseS} s idle before each round`);
    for (const t of targets) {
      failures = [];
      const before = await Promise.all(queues.map((q) => q.getJobCountByTypes('completed', 'failed')));
      await sample(t, 1, [7, 8, 9]); // warm-up (loads the adapter)
      const one = { toks: 0, secs: 0 };
      const many = { toks: 0, secs: 0 };
      for (let r = 0; r < rounds; r++) {
        await sleep(pauseS * 1000);
        const a = await timed(async () => [await sample(t, n, [5 + r, 17, 42, 99])]);
        one.toks += a.toks;
        one.secs += a.secs;
        await sleep(pauseS * 1000);
        const b = await timed(() => Promise.all(Array.from({ length: n }, (_, i) => sample(t, 1, [5 + ((r * n + i) % 50), 17, 42, 99]))));
        many.toks += b.toks;
        many.secs += b.secs;
      }
      const after = await Promise.all(queues.map((q) => q.getJobCountByTypes('completed', 'failed')));
      const tps1 = one.toks / one.secs;
      const tpsN = many.toks / many.secs;
      console.log(`${t.label}:`);
      console.log(`  1 request x ${n} samples : ${tps1.toFixed(0)} tok/s (${one.toks} tokens in ${one.secs.toFixed(2)} s)`);
      console.log(`  ${n} requests x 1 sample : ${tpsN.toFixed(0)} tok/s (${many.toks} tokens in ${many.secs.toFixed(2)} s)`);
      console.log(`  ratio ${(tpsN / tps1).toFixed(2)}; failed requests: ${failures.length}; sample jobs run by engine: vllm ${after[0]! - before[0]!}, torch ${after[1]! - before[1]!}`);
      for (const f of failures.slice(0, 3)) console.log(`  failure: ${f}`);
    }
    await Promise.all(queues.map((q) => q.close()));
  } finally {
    redis.disconnect();
    await server.destroy();
  }
}

runBench(main);
