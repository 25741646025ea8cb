import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../scripts/stack.js';
import { E2E_KEY, freePort, PYTHON } from '../test/e2e/server.js';
import { deletePrefix, REDIS_URL } from '../test/helpers/stack.js';
import { children } from './proc.js';

/**
 * What a sample request costs the server (issue 36 item 5), through the real tinker SDK against a
 * stack of its own (key prefix, port, storage): the API (`api/main.ts`) and the agent
 * (`workers/main.ts`) as separate processes, so that each one's CPU shows, and the agent's engine.
 *
 *   node --import tsx bench/request-cost.ts ratio [n=32] [max_tokens=64] [prompt_len=16] [rounds=6]
 *     rounds of A = one request of n samples and B = n concurrent one-sample requests, same prompt,
 *     same answer lengths (EOS off), order A B B A (bench/sdk_request_cost.py); prints the CPU time
 *     (utime + stime from /proc) of the stack's processes per half, by process, and B / A. The
 *     client's CPU is not counted.
 *   node --import tsx bench/request-cost.ts inflight [n=2000] [max_tokens=4]
 *     n one-sample requests in flight at once from one client; prints how many were answered, the
 *     API's peak RSS (VmHWM) against its RSS before, and the latency of GET /api/v1/healthz polled
 *     every 20 ms meanwhile (p50, p99, max).
 *
 * BENCH_NODE_ARGS adds node flags to the API and the agent (e.g. `--cpu-prof --cpu-prof-dir=/tmp/prof`);
 * they stop with SIGTERM, so their profiles are written. BENCH_STACK_LOG=<file> keeps the stack's log
 * (with TB_LOG_LEVEL / TB_ENGINE_LOG_LEVEL to choose what it holds).
 */
const here = path.dirname(fileURLToPath(import.meta.url));

type Stack = { base: string; api: ChildProcess; agent: ChildProcess; prefix: string; storage: string; log: (chars?: number) => string };

function node(script: string, env: NodeJS.ProcessEnv, logs: string[]): ChildProcess {
  const extra = (process.env.BENCH_NODE_ARGS ?? '').split(' ').filter(Boolean);
  const c = spawn(process.execPath, [...extra, '--import', 'tsx', script], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  c.stdout!.on('data', (d) => logs.push(String(d)));
  c.stderr!.on('data', (d) => logs.push(String(d)));
  return c;
}

async function startStack(): Promise<Stack> {
  const prefix = `bench-${randomUUID().slice(0, 8)}`;
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-bench-'));
  const port = await freePort();
  const env = {
    REDIS_URL,
    TB_PREFIX: prefix,
    TB_STORAGE_DIR: storage,
    TB_PORT: String(port),
    TB_API_KEYS: E2E_KEY,
    TB_AGENT_ID: `agent-${prefix}`,
    TB_AGENT_MODELS: `${TINY_MODEL_DIR}=${TINY_MODEL_ALIAS}`,
    TB_REQUIRED_MODELS: TINY_MODEL_ALIAS,
    TB_LOG_LEVEL: process.env.TB_LOG_LEVEL ?? 'warn',
    // One torch thread: the engine's OpenMP threads spin while they wait, and on a busy machine that
    // spin is CPU time that follows the load, not the request (BENCH_ENGINE_THREADS to change).
    TB_ENGINE_THREADS: process.env.BENCH_ENGINE_THREADS ?? '1',
  };
  const logs: string[] = [];
  const agent = node('workers/main.ts', env, logs);
  const api = node('api/main.ts', env, logs);
  const base = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 180_000;
  for (;;) {
    if (api.exitCode !== null || agent.exitCode !== null) throw new Error(`stack exited early:\n${logs.join('')}`);
    try {
      const r = await fetch(`${base}/api/v1/healthz`);
      if (r.status === 200 && (await r.json()).status === 'ready') break;
    } catch {
      /* not listening yet */
    }
    if (Date.now() > deadline) throw new Error(`stack not ready:\n${logs.join('')}`);
    await new Promise((r) => setTimeout(r, 250));
  }
  return { base, api, agent, prefix, storage, log: (chars = 4000) => logs.join('').slice(-chars) };
}

async function stopStack(s: Stack): Promise<void> {
  if (process.env.BENCH_STACK_LOG) writeFileSync(process.env.BENCH_STACK_LOG, s.log(Infinity));
  const exited = (c: ChildProcess) => (c.exitCode !== null ? Promise.resolve() : new Promise((r) => c.once('exit', r)));
  s.api.kill('SIGTERM');
  s.agent.kill('SIGTERM');
  await Promise.all([exited(s.api), exited(s.agent)]);
  await deletePrefix(s.prefix);
  rmSync(s.storage, { recursive: true, force: true });
}

/** Runs bench/sdk_request_cost.py against the stack; its JSON answer. */
function python(s: Stack, args: string[], env: NodeJS.ProcessEnv = {}): Promise<any> {
  return new Promise((resolve, reject) => {
    const c = spawn(PYTHON, [path.join(here, 'sdk_request_cost.py'), ...args], {
      env: { ...process.env, ...env, TINKER_BASE_URL: s.base, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let out = '';
    let err = '';
    c.stdout!.on('data', (d) => (out += d));
    c.stderr!.on('data', (d) => (err += d));
    c.on('exit', (code) => {
      if (code !== 0) return reject(new Error(`sdk_request_cost.py ${args.join(' ')} failed (${code}):\n${err.slice(-4000)}\n--- stack ---\n${s.log()}`));
      const lines = out.trim().split('\n');
      resolve(JSON.parse(lines[lines.length - 1]!));
    });
  });
}

/** A /proc/<pid>/status field in KiB (VmRSS, VmHWM). */
function statusKiB(pid: number, field: string): number {
  const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(new RegExp(`^${field}:\\s+(\\d+)`, 'm'));
  return m ? Number(m[1]) : NaN;
}

async function ratio(n: number, maxTokens: number, promptLen: number, rounds: number): Promise<void> {
  const s = await startStack();
  try {
    const engine = children(s.agent.pid!)[0];
    const pids = `api=${s.api.pid},agent=${s.agent.pid}${engine ? `,engine=${engine}` : ''}`;
    const r = await python(s, ['ratio', TINY_MODEL_ALIAS, String(n), String(maxTokens), String(promptLen), String(rounds)], { TB_BENCH_PIDS: pids });
    const fmt = (o: Record<string, number>) => Object.entries(o).map(([k, v]) => `${k} ${v.toFixed(0)}`).join(', ');
    const sum = (o: Record<string, number>) => Object.values(o).reduce((a, b) => a + b, 0);
    console.log(`tiny model on the CPU, one prompt of ${promptLen} tokens, ${maxTokens} new tokens (EOS off), ${rounds} rounds of each half (A B B A …); API, agent and engine (torch threads: ${process.env.BENCH_ENGINE_THREADS ?? '1'}) as separate processes`);
    console.log(`sampled tokens per half: A ${r.tokens_per_half.A.join('/')}, B ${r.tokens_per_half.B.join('/')}`);
    console.log(`A = 1 request x ${n} samples : CPU ms per half ${sum(r.cpu_ms_mean.A).toFixed(0)} (${fmt(r.cpu_ms_mean.A)}); wall median ${(r.wall_s_median.A * 1000).toFixed(0)} ms`);
    console.log(`B = ${n} requests x 1 sample : CPU ms per half ${sum(r.cpu_ms_mean.B).toFixed(0)} (${fmt(r.cpu_ms_mean.B)}); wall median ${(r.wall_s_median.B * 1000).toFixed(0)} ms`);
    console.log(`per extra request (B - A) / ${n - 1}: ${Object.keys(r.cpu_ms_mean.A).map((k) => `${k} ${((r.cpu_ms_mean.B[k] - r.cpu_ms_mean.A[k]) / (n - 1)).toFixed(2)}`).join(', ')} ms`);
    console.log(`CPU ratio B / A: ${r.ratio.toFixed(2)} (of the means), ${r.ratio_of_medians.toFixed(2)} (of the medians); per round A ${r.total_ms.A.map((x: number) => x.toFixed(0)).join(' ')}, B ${r.total_ms.B.map((x: number) => x.toFixed(0)).join(' ')}`);
    console.log(`load average (1 min) at the end: ${os.loadavg()[0]!.toFixed(1)}`);
  } finally {
    await stopStack(s);
  }
}

/** GET /api/v1/healthz once; its latency in ms (a fresh connection each time is what a probe does). */
function healthz(base: string): Promise<number> {
  const t = performance.now();
  return new Promise((resolve, reject) => {
    http
      .get(`${base}/api/v1/healthz`, (res) => {
        res.resume();
        res.on('end', () => (res.statusCode === 200 ? resolve(performance.now() - t) : reject(new Error(`healthz ${res.statusCode}`))));
      })
      .on('error', reject);
  });
}

async function inflight(n: number, maxTokens: number): Promise<void> {
  const s = await startStack();
  try {
    const api = s.api.pid!;
    const rssBefore = statusKiB(api, 'VmRSS');
    const lat: number[] = [];
    let failedProbes = 0;
    let done = false;
    const probe = (async () => {
      while (!done) {
        try {
          lat.push(await healthz(s.base));
        } catch {
          failedProbes++;
        }
        await new Promise((r) => setTimeout(r, 20));
      }
    })();
    const r = await python(s, ['inflight', TINY_MODEL_ALIAS, String(n), String(maxTokens)]).finally(() => (done = true));
    await probe;
    const peak = statusKiB(api, 'VmHWM');
    lat.sort((a, b) => a - b);
    const q = (p: number) => lat[Math.min(lat.length - 1, Math.floor(p * lat.length))]!.toFixed(1);
    console.log(`${r.sent} one-sample requests (${maxTokens} tokens each) in flight at once from one SDK client: ${r.answered} answered, ${r.error_count} failed ${r.errors.length ? JSON.stringify(r.errors) : ''}; ${r.wall_s.toFixed(1)} s`);
    console.log(`API RSS: ${(rssBefore / 1024).toFixed(0)} MiB before, peak ${(peak / 1024).toFixed(0)} MiB (VmHWM)`);
    console.log(`GET /api/v1/healthz every 20 ms meanwhile: ${lat.length} probes, p50 ${q(0.5)} ms, p99 ${q(0.99)} ms, max ${lat[lat.length - 1]?.toFixed(1)} ms; ${failedProbes} failed`);
    console.log(`load average (1 min) at the end: ${os.loadavg()[0]!.toFixed(1)}`);
  } finally {
    await stopStack(s);
  }
}

const args = process.argv.slice(2);
const num = (i: number, d: number) => Number(args[i] ?? d);
const run = args[0] === 'inflight' ? inflight(num(1, 2000), num(2, 4)) : ratio(num(1, 32), num(2, 64), num(3, 16), num(4, 6));
run.then(
  () => process.exit(0),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
