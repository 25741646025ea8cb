import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { performance } from 'node:perf_hooks';
import { Worker } from 'node:worker_threads';
import { Redis } from 'ioredis';
import { loadAgentConfig } from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../scripts/stack.js';
import { awaitFuture, call, deletePrefix, REDIS_URL } from '../test/helpers/stack.js';
import { encodeForwardBackward, encodeForwardBackwardMessage, i32, i64 } from '../test/helpers/wire.js';
import { Agent } from '../workers/agent.js';
import { runBench } from './client.js';

/**
 * The API under hostile sizes: an API process of its own (its RSS read from /proc) and an agent
 * with the tiny model; for `seconds`, `senders` clients send requests that claim huge tensors
 * (sparse [1, 4e7], dense [1, 1e9]), datums past the context, seq_ids far ahead and replays with
 * another payload, while a prober times `/healthz` every 20 ms. Prints the status counts, healthz
 * latency, the API's RSS and the deployment's Redis keys and memory.
 *
 *   node --import tsx bench/hostile.ts [seconds=20] [senders=4] [kinds=all|small]
 *
 * `small` leaves out the 34 MiB body of the 3M-token datum (its cost is reading the body);
 * senders=0 gives the healthz baseline of the same machine.
 */
const seconds = Number(process.argv[2] ?? 20);
const senders = Number(process.argv[3] ?? 4);
const smallOnly = process.argv[4] === 'small';
logger.level = 'warn';

const freePort = () =>
  new Promise<number>((resolve) => {
    const srv = createServer();
    srv.listen(0, '127.0.0.1', () => {
      const p = (srv.address() as { port: number }).port;
      srv.close(() => resolve(p));
    });
  });

const rssMiB = (pid: number) => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))![1]) / 1024;
function pct(ms: number[], p: number): string {
  const s = [...ms].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(p * s.length))]!.toFixed(1);
}

async function main(): Promise<void> {
  const prefix = `bench-${randomUUID().slice(0, 8)}`;
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-bench-'));
  const port = await freePort();
  const env = {
    ...process.env,
    REDIS_URL,
    TB_PREFIX: prefix,
    TB_STORAGE_DIR: storage,
    TB_API_KEYS: 'tml-bench',
    TB_PORT: String(port),
    TB_LOG_LEVEL: 'warn',
    TB_AGENT_ID: `agent-${prefix}`,
    TB_AGENT_MODELS: `${TINY_MODEL_DIR}=${TINY_MODEL_ALIAS}`,
  };
  ensureTinyModel(defaultPython());
  const agent = new Agent(loadAgentConfig(env));
  await agent.start();
  const api = spawn(process.execPath, ['--import', 'tsx', 'api/main.ts'], { env, stdio: ['ignore', 'inherit', 'inherit'] });
  const base = `http://127.0.0.1:${port}`;
  const key = { key: 'tml-bench' };
  for (;;) {
    const r = await fetch(`${base}/healthz`).catch(() => null);
    if (r?.status === 200) break;
    await new Promise((r) => setTimeout(r, 200));
  }
  const redis = new Redis(REDIS_URL);
  try {
    const session = (await call(base, 'POST', '/create_session', { tags: [] }, key)).json.session_id;
    const cm = await call(base, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2 } }, key);
    await awaitFuture(base, cm.json.request_id).catch(() => undefined);
    const modelId = cm.json.model_id as string;
    const sparse = (seq: number) =>
      encodeForwardBackwardMessage({
        model_id: modelId,
        seq_id: seq,
        loss_fn: 'cross_entropy',
        data: [{ model_input: [{ encoded_text: { tokens: i32([5]) } }], loss_fn_inputs: { target_tokens: { sparse_csr: { values: Buffer.alloc(0), crow_indices: i64([0, 0]), col_indices: Buffer.alloc(0) }, dtype: 2, shape: [1, 4e7] } } }],
      });
    const dense = (seq: number) =>
      encodeForwardBackwardMessage({
        model_id: modelId,
        seq_id: seq,
        loss_fn: 'cross_entropy',
        data: [{ model_input: [{ encoded_text: { tokens: i32([5]) } }], loss_fn_inputs: { target_tokens: { dense: i64([1]), dtype: 2, shape: [1, 1e9] } } }],
      });
    const long = Array.from({ length: 3_000_000 }, (_, i) => i % 1000);
    const tooLong = encodeForwardBackward({ modelId, seqId: 1, data: [{ tokens: long, targets: long }] });
    const kinds: [string, (i: number) => Promise<number>][] = [
      ['sparse [1,4e7] (139 B)', async (i) => (await call(base, 'POST', '/forward_backward', undefined, { ...key, raw: sparse(1 + (i % 8)) })).status],
      ['dense claim [1,1e9]', async (i) => (await call(base, 'POST', '/forward_backward', undefined, { ...key, raw: dense(1 + (i % 8)) })).status],
      [`3M-token datum (${(tooLong.length / 2 ** 20).toFixed(0)} MiB)`, async () => (await call(base, 'POST', '/forward_backward', undefined, { ...key, raw: tooLong })).status],
      ['seq_id far ahead', async (i) => (await call(base, 'POST', '/optim_step', { model_id: modelId, seq_id: 1e6 + i, adam_params: { learning_rate: 1 } }, key)).status],
      ['replay, other payload', async (i) => (await call(base, 'POST', '/optim_step', { model_id: modelId, seq_id: 1, adam_params: { learning_rate: 1e-3 * (i % 5) } }, key)).status],
    ];
    if (smallOnly) kinds.splice(2, 1);
    const counts = new Map<string, Map<number, number>>();
    const rss0 = rssMiB(api.pid!);
    const mem0 = Number(/used_memory:(\d+)/.exec(await redis.info('memory'))![1]);
    let rssMax = rss0;
    const health: number[] = [];
    const end = performance.now() + seconds * 1000;
    // The prober runs on a thread of its own, so the senders' event loop does not delay its timings.
    const prober = new Promise<void>((resolve) => {
      const w = new Worker(
        `const { parentPort, workerData } = require('node:worker_threads');
         (async () => {
           const out = [];
           while (Date.now() < workerData.end) {
             const t = performance.now();
             await fetch(workerData.url);
             out.push(performance.now() - t);
             await new Promise((r) => setTimeout(r, 20));
           }
           parentPort.postMessage(out);
         })();`,
        { eval: true, workerData: { url: `${base}/healthz`, end: Date.now() + seconds * 1000 } },
      );
      w.once('message', (out: number[]) => {
        health.push(...out);
        resolve();
      });
    });
    const rssTimer = setInterval(() => (rssMax = Math.max(rssMax, rssMiB(api.pid!))), 200);
    let n = 0;
    await Promise.all(
      Array.from({ length: senders }, async (_, w) => {
        for (let i = w; performance.now() < end; i += senders) {
          const [name, send] = kinds[i % kinds.length]!;
          const status = await send(i);
          n++;
          const c = counts.get(name) ?? new Map<number, number>();
          c.set(status, (c.get(status) ?? 0) + 1);
          counts.set(name, c);
        }
      }),
    );
    await prober;
    clearInterval(rssTimer);
    const rss1 = rssMiB(api.pid!);
    const mem1 = Number(/used_memory:(\d+)/.exec(await redis.info('memory'))![1]);
    let keys = 0;
    const kindsOfKeys = new Map<string, number>();
    let cursor = '0';
    do {
      const [next, k] = await redis.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 1000);
      cursor = next;
      keys += k.length;
      for (const x of k) {
        const kind = x.slice(prefix.length).split(':').slice(0, 2).join(':').replace(/[0-9a-f-]{8,}.*/, '…');
        kindsOfKeys.set(kind, (kindsOfKeys.get(kind) ?? 0) + 1);
      }
    } while (cursor !== '0');
    console.log(`hostile requests: ${n} in ${seconds} s from ${senders} senders`);
    for (const [name, c] of counts) console.log(`  ${name}: ${[...c].map(([s, k]) => `${k}× ${s}`).join(', ')}`);
    console.log(`healthz: ${health.length} probes, p50 ${pct(health, 0.5)} ms, p99 ${pct(health, 0.99)} ms, max ${pct(health, 1)} ms`);
    console.log(`API RSS: ${rss0.toFixed(0)} MiB before, ${rssMax.toFixed(0)} MiB max, ${rss1.toFixed(0)} MiB after`);
    console.log(`Redis keys by kind: ${[...kindsOfKeys].sort((a, b) => b[1] - a[1]).slice(0, 6).map(([k, n]) => `${k} ${n}`).join(', ')}`);
    console.log(`Redis: ${keys} keys under the prefix; used_memory ${(mem0 / 2 ** 20).toFixed(1)} → ${(mem1 / 2 ** 20).toFixed(1)} MiB (whole server)`);
  } finally {
    api.kill('SIGTERM');
    await new Promise((r) => api.once('exit', r));
    await agent.stop();
    redis.disconnect();
    await deletePrefix(prefix);
    rmSync(storage, { recursive: true, force: true });
  }
}

runBench(main);
