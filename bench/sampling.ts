import { performance } from 'node:perf_hooks';
import { logger } from '../queues/logger.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { awaitFuture, call, startStack } from '../test/helpers/stack.js';

/**
 * Sampling throughput through the whole stack: `requests` asample calls kept `concurrency` at a
 * time in flight against the tiny model's base, each `num_samples` × `max_tokens` tokens.
 *
 *   node --import tsx bench/sampling.ts [requests=64] [concurrency=8] [num_samples=4] [max_tokens=32]
 */
const arg = (i: number, d: number) => Number(process.argv[2 + i] ?? d);
const [requests, concurrency, numSamples, maxTokens] = [arg(0, 64), arg(1, 8), arg(2, 4), arg(3, 32)];
logger.level = 'warn';

async function main(): Promise<void> {
  const s = await startStack({ longPollMs: 25_000 });
  try {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const sc = await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: session, sampling_session_seq_id: 0, base_model: TINY_MODEL_ALIAS });
    const latencies: number[] = [];
    let next = 0;
    let tokens = 0;
    const t0 = performance.now();
    const worker = async () => {
      while (next < requests) {
        const i = next++;
        const t = performance.now();
        const sub = await call(s.baseUrl, 'POST', '/asample', {
          prompt: { chunks: [{ type: 'encoded_text', tokens: [5 + (i % 50), 17, 42, 99] }] },
          num_samples: numSamples,
          sampling_params: { max_tokens: maxTokens, temperature: 1, seed: i, stop: [] },
          sampling_session_id: sc.json.sampling_session_id,
          seq_id: i,
        });
        const r = await awaitFuture(s.baseUrl, sub.json.request_id, 'application/x-protobuf');
        if (r.status !== 200) throw new Error(`sample ${i} failed: ${r.body.toString()}`);
        tokens += numSamples * maxTokens;
        latencies.push(performance.now() - t);
      }
    };
    await Promise.all(Array.from({ length: concurrency }, worker));
    const secs = (performance.now() - t0) / 1000;
    latencies.sort((a, b) => a - b);
    const q = (p: number) => latencies[Math.min(latencies.length - 1, Math.floor(p * latencies.length))]!.toFixed(0);
    console.log(`tiny model, ${requests} requests x ${numSamples} samples x ${maxTokens} tokens, ${concurrency} in flight`);
    console.log(`throughput: ${(requests / secs).toFixed(1)} requests/s, ${(tokens / secs).toFixed(0)} sampled tokens/s`);
    console.log(`latency per request: p50 ${q(0.5)} ms, p90 ${q(0.9)} ms`);
  } finally {
    await s.stop();
  }
}

main().then(
  () => process.exit(0),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
