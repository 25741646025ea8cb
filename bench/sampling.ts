import os from 'node:os';
import { performance } from 'node:perf_hooks';
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { logger } from '../queues/infra/logger.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { awaitFuture, call, startStack, type TestStack } from '../test/helpers/stack.js';
import { children } from './proc.js';

/**
 * Sampling throughput through the whole stack (HTTP → BullMQ → agent → torch engine on the CPU).
 *
 *   node --import tsx bench/sampling.ts [requests=64] [concurrency=8] [num_samples=4] [max_tokens=32]
 *     `requests` asample calls kept `concurrency` at a time in flight, each num_samples × max_tokens.
 *   node --import tsx bench/sampling.ts ratio [n=32] [max_tokens=64] [prompt_len=16] [rounds=3]
 *     n concurrent one-sample requests with distinct prompts against one request for n samples
 *     (prompts of the same length, same max_tokens); prints both tokens/s and their ratio.
 *     TB_ENGINE_DEVICE and TB_ENGINE_THREADS in the environment choose the engine's device and threads.
 *   node --import tsx bench/sampling.ts sdk [n=32] [max_tokens=64] [prompt_len=16] [rounds=5]
 *     the same comparison through the real tinker SDK against the start command (`npm start`'s
 *     script: API and agent in one process, apart from the bench's), bench/sdk_sampling_ratio.py.
 */
logger.level = (process.env.BENCH_LOG_LEVEL as typeof logger.level | undefined) ?? 'warn';

type Stack = { s: TestStack; samplingSessionId: string };

async function open(concurrency: number): Promise<Stack> {
  // The engine's device and threads from this process's environment (the GPU machine: cpu with 7 threads, then cuda:0).
  const engine = Object.fromEntries(['TB_ENGINE_DEVICE', 'TB_ENGINE_THREADS'].filter((k) => process.env[k]).map((k) => [k, process.env[k]!]));
  const s = await startStack({ longPollMs: 25_000, env: { TB_SAMPLE_CONCURRENCY: String(Math.max(concurrency, 4)), ...engine } });
  const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
  const sc = await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: session, sampling_session_seq_id: 0, base_model: TINY_MODEL_ALIAS });
  return { s, samplingSessionId: sc.json.sampling_session_id };
}

let seq = 0;
/** One asample call awaited to its end; returns the number of tokens sampled. */
async function sampleOnce(st: Stack, prompt: number[], numSamples: number, maxTokens: number, seed: number): Promise<number> {
  const i = seq++;
  const sub = await call(st.s.baseUrl, 'POST', '/asample', {
    prompt: { chunks: [{ type: 'encoded_text', tokens: prompt }] },
    num_samples: numSamples,
    sampling_params: { max_tokens: maxTokens, temperature: 1, seed, stop: [] },
    sampling_session_id: st.samplingSessionId,
    seq_id: i,
  });
  const r = await awaitFuture(st.s.baseUrl, sub.json.request_id, 'application/json', 1000);
  if (r.status !== 200 || !r.json?.sequences) throw new Error(`sample ${i} failed: ${r.body.toString().slice(0, 300)}`);
  return (r.json.sequences as { tokens: number[] }[]).reduce((n, s) => n + s.tokens.length, 0);
}

async function throughput(requests: number, concurrency: number, numSamples: number, maxTokens: number): Promise<void> {
  const st = await open(concurrency);
  try {
    const latencies: number[] = [];
    let next = 0;
    let tokens = 0;
    const t0 = performance.now();
    const worker = async () => {
      while (next < requests) {
        const i = next++;
        const t = performance.now();
        tokens += await sampleOnce(st, [5 + (i % 50), 17, 42, 99], numSamples, maxTokens, i);
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
    await st.s.stop();
  }
}

async function ratio(n: number, maxTokens: number, promptLen: number, rounds: number): Promise<void> {
  const st = await open(n);
  const prompt = (k: number) => Array.from({ length: promptLen }, (_, j) => 5 + ((k * 31 + j * 7) % 1000));
  try {
    await sampleOnce(st, prompt(0), 2, 4, 0); // warm-up
    const single: number[] = [];
    const concurrent: number[] = [];
    for (let r = 0; r < rounds; r++) {
      let t = performance.now();
      let tokens = await sampleOnce(st, prompt(r), n, maxTokens, r);
      single.push(tokens / ((performance.now() - t) / 1000));
      t = performance.now();
      const counts = await Promise.all(Array.from({ length: n }, (_, k) => sampleOnce(st, prompt(1 + r * n + k), 1, maxTokens, k)));
      tokens = counts.reduce((a, b) => a + b, 0);
      concurrent.push(tokens / ((performance.now() - t) / 1000));
    }
    const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
    const [one, many] = [median(single), median(concurrent)];
    console.log(`tiny model, prompts of ${promptLen} tokens, ${maxTokens} new tokens, median of ${rounds} rounds`);
    console.log(`1 request x ${n} samples        : ${one.toFixed(0)} sampled tokens/s  (rounds: ${single.map((x) => x.toFixed(0)).join(', ')})`);
    console.log(`${n} concurrent requests x 1 sample: ${many.toFixed(0)} sampled tokens/s  (rounds: ${concurrent.map((x) => x.toFixed(0)).join(', ')})`);
    console.log(`ratio concurrent / single: ${(many / one).toFixed(2)}`);
  } finally {
    await st.s.stop();
  }
}

/** `name=pid` of the start command's process (API + agent), its engine child and a local redis-server, where /proc shows them. */
function benchPids(serverPid: number | undefined): string {
  if (serverPid === undefined) return '';
  const pids = [`api+agent=${serverPid}`];
  const engine = children(serverPid)[0];
  if (engine) pids.push(`engine=${engine}`);
  const redis = spawnSync('pgrep', ['-x', 'redis-server'], { encoding: 'utf8' }).stdout?.trim().split(/\s+/)[0];
  if (redis) pids.push(`redis=${redis}`);
  return pids.join(',');
}

async function sdkRatio(n: number, maxTokens: number, promptLen: number, rounds: number): Promise<void> {
  const server = new E2EServer(); // the start command's defaults, as `npm start` runs it
  try {
    await server.start();
    process.env.TB_BENCH_PIDS = benchPids(server.pid);
    const script = fileURLToPath(new URL('./sdk_sampling_ratio.py', import.meta.url));
    const r = server.runPython([script, TINY_MODEL_ALIAS, String(n), String(maxTokens), String(promptLen), String(rounds)]) as {
      single: number[];
      concurrent: number[];
      single_median: number;
      concurrent_median: number;
      ratio_of_medians: number;
      median_round_ratio: number;
      cpu_ms_per_round: Record<'single' | 'concurrent', Record<string, number>>;
    };
    const list = (xs: number[]) => xs.map((x) => x.toFixed(0)).join(', ');
    console.log(`through the tinker SDK against the start command; tiny model, prompts of ${promptLen} tokens, ${maxTokens} new tokens, ${rounds} rounds`);
    console.log(`1 request x ${n} samples         : median ${r.single_median.toFixed(0)} sampled tokens/s (rounds: ${list(r.single)})`);
    console.log(`${n} concurrent requests x 1 sample: median ${r.concurrent_median.toFixed(0)} sampled tokens/s (rounds: ${list(r.concurrent)})`);
    console.log(`ratio concurrent / single: ${r.ratio_of_medians.toFixed(2)} (of the medians), ${r.median_round_ratio.toFixed(2)} (median of the rounds' ratios)`);
    for (const half of ['single', 'concurrent'] as const) {
      const c = r.cpu_ms_per_round[half];
      console.log(`CPU ms per round, ${half.padEnd(10)}: ${Object.entries(c).map(([k, v]) => `${k} ${v.toFixed(0)}`).join(', ')}`);
    }
    console.log(`load average (1 min) at the end: ${os.loadavg()[0]!.toFixed(1)}`);
  } finally {
    await server.destroy();
  }
}

const args = process.argv.slice(2);
const num = (i: number, d: number) => Number(args[i] ?? d);
const run =
  args[0] === 'ratio'
    ? ratio(num(1, 32), num(2, 64), num(3, 16), num(4, 3))
    : args[0] === 'sdk'
      ? sdkRatio(num(1, 32), num(2, 64), num(3, 16), num(4, 5))
      : throughput(num(0, 64), num(1, 8), num(2, 4), num(3, 32));
run.then(
  () => process.exit(0),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
