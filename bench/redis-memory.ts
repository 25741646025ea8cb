import { rmSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { OwnRedis } from '../test/helpers/procs.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';

/**
 * Redis memory under a long run (issue 13): the stack as a user starts it (`tinker-broker start`
 * with the tiny CPU preset: API and agent together in one process apart from the bench's) on a
 * redis-server of its own, so `used_memory` and `DBSIZE` are this deployment's alone; its own port,
 * key prefix and storage dir.
 *
 * `clients` loops run one client run after another for `seconds`: a session (heartbeats every step),
 * a LoRA model, `steps` training steps (forward_backward + optim_step), after every `saveEvery` steps
 * an unnamed sampler save (save_weights_and_get_sampling_client's) and `samples` sample requests
 * from it, then unload_model and the session's finish. Nothing of a run is in use once it ended,
 * so with bounded Redis memory the figures follow the activity of the last few minutes (the
 * retention, `retention` seconds as TB_FUTURE_RETENTION_S, and TB_RESULT_TTL_AFTER_READ_S, 300 s),
 * not the number of runs so far. Every `every` seconds it prints the counts so far, `used_memory` and
 * `DBSIZE`, also for `idle` seconds after the clients stopped; at the end, the keys by family.
 *
 *   node --import tsx bench/redis-memory.ts [seconds=600] [retention=60] [clients=3] [every=30] [idle=360]
 */
const [seconds = 600, retention = 60, clients = 3, every = 30, idle = 360] = process.argv.slice(2).map(Number);
const steps = 6;
const saveEvery = 2;
const samples = 2;

const batch = benchBatch(16);
const adam = BENCH_ADAM;


const counts = { runs: 0, steps: 0, saves: 0, samples: 0 };

async function clientRun(base: string): Promise<void> {
  const session = (await post(base, '/create_session', { tags: ['bench'] })).session_id as string;
  const cm = await post(base, '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 4, seed: 0 } });
  const model = (await result(base, cm.request_id)).model_id as string;
  let seq = 1;
  for (let s = 1; s <= steps; s++) {
    await post(base, '/session_heartbeat', { session_id: session });
    const fb = await post(base, '/forward_backward', undefined, encodeForwardBackward({ modelId: model, seqId: seq++, data: batch }));
    const op = await post(base, '/optim_step', { model_id: model, seq_id: seq++, adam_params: adam });
    await result(base, fb.request_id);
    await result(base, op.request_id);
    counts.steps++;
    if (s % saveEvery !== 0) continue;
    const save = await result(base, (await post(base, '/save_weights_for_sampler', { model_id: model, seq_id: seq++, sampling_session_seq_id: s })).request_id);
    counts.saves++;
    await Promise.all(
      Array.from({ length: samples }, async (_, i) => {
        const r = await post(base, '/asample', {
          num_samples: 1,
          prompt: { chunks: [{ type: 'encoded_text', tokens: [5, 6, 7, 8] }] },
          sampling_params: { max_tokens: 8, seed: i },
          sampling_session_id: save.sampling_session_id,
          seq_id: i,
        });
        await result(base, r.request_id);
        counts.samples++;
      }),
    );
  }
  await result(base, (await post(base, '/unload_model', { model_id: model })).request_id);
  await post(base, `/sessions/${session}/finish`, { reason: { type: 'success' } });
  counts.runs++;
}

/** A key's family: its name with the ids (uuids, hashes, numbers, tinker paths) replaced by `*`. */
function family(key: string, prefix: string): string {
  return key
    .slice(prefix.length)
    .replace(/tinker:\/\/\S+/, '*')
    .replace(/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}(:(train|sample):\d+)?/g, '*')
    .replace(/\b[ts]-[0-9a-f]{16}-\d+\b|\b[culs]-[0-9a-f]{16}\b/g, '*')
    .replace(/:\d+$/, ':*');
}

async function main(): Promise<void> {
  const own = new OwnRedis();
  await own.start();
  const redis = new Redis(own.url);
  const server = new E2EServer({ REDIS_URL: own.url, TB_FUTURE_RETENTION_S: String(retention), TB_LOG_LEVEL: 'warn' });
  const t0 = performance.now();
  try {
    await server.start();
    const base = server.baseUrl;
    const mem = async () => {
      const used = Number(/used_memory:(\d+)/.exec(await redis.info('memory'))![1]);
      return { usedMiB: used / 2 ** 20, dbsize: await redis.dbsize() };
    };
    const m0 = await mem();
    console.log(`redis-memory: ${seconds} s, retention ${retention} s, ${clients} clients; a run = ${steps} steps, a sampler save every ${saveEvery} with ${samples} samples, unload, finish`);
    console.log(`t(s)  runs  steps  saves  samples  used_memory(MiB)  dbsize`);
    const line = (t: number, m: { usedMiB: number; dbsize: number }) =>
      console.log(`${String(Math.round(t)).padStart(4)}  ${String(counts.runs).padStart(4)}  ${String(counts.steps).padStart(5)}  ${String(counts.saves).padStart(5)}  ${String(counts.samples).padStart(7)}  ${m.usedMiB.toFixed(2).padStart(16)}  ${String(m.dbsize).padStart(6)}`);
    line(0, m0);
    const start = performance.now();
    const end = start + seconds * 1000;
    const timer = setInterval(() => void mem().then((m) => line((performance.now() - start) / 1000, m)), every * 1000);
    const errors: string[] = [];
    await Promise.all(
      Array.from({ length: clients }, async () => {
        while (performance.now() < end) await clientRun(base).catch((e) => errors.push(String(e)));
      }),
    );
    line((performance.now() - start) / 1000, await mem());
    console.log(`clients stopped; idle for ${idle} s`);
    // Idle: what the runs left goes within the retention, results 300 s after they were read, the
    // per-second token counters after 3 min (a finished job also stays until its queue's next completion
    // past the retention, or its read TTL).
    await new Promise((r) => setTimeout(r, idle * 1000));
    clearInterval(timer);
    const rest = await mem();
    line((performance.now() - start) / 1000, rest);
    const families = new Map<string, number>();
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'COUNT', 1000);
      cursor = next;
      for (const k of keys) families.set(family(k, server.prefix), (families.get(family(k, server.prefix)) ?? 0) + 1);
    } while (cursor !== '0');
    console.log(`after ${idle} s idle: ${rest.dbsize} keys, ${rest.usedMiB.toFixed(2)} MiB; by family: ${[...families].sort((a, b) => b[1] - a[1]).map(([k, n]) => `${k} ${n}`).join(', ')}`);
    console.log(`errors: ${errors.length}${errors.length ? ` (first: ${errors[0]})` : ''}; wall ${((performance.now() - t0) / 1000).toFixed(0)} s`);
  } finally {
    redis.disconnect();
    await server.stop();
    rmSync(server.storage, { recursive: true, force: true });
    await own.destroy();
  }
}

runBench(main);
