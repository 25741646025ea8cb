import { spawn, type ChildProcess } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { stat } from 'node:fs/promises';
import http from 'node:http';
import { createServer } from 'node:net';
import path from 'node:path';
import type { BaseModelSpec } from '../../queues/config.js';
import type { Logger } from '../../queues/logger.js';
import type { ServedModel } from '../../queues/registry.js';
import { SampleResult, type CreateModelJob, type ForwardBackwardJob, type OptimStepJob, type SampleJob, type SaveSamplerJob } from '../../queues/schemas.js';
import { EngineError } from '../engine.js';
import type { EngineAdapter } from './adapter.js';

/**
 * The vLLM engine (sampling only): each base model is served by a vLLM OpenAI-compatible server,
 * started here (`vllm serve`, one per model) or attached to (`TB_VLLM_URL`). Everything that turns
 * a Tinker job into a vLLM request, and a vLLM answer into a Tinker result or error, is in the
 * "translation" section below; docs/engines/vllm.md states the semantics and where they differ
 * from the torch engine (docs/engine-protocol.md `sample`).
 *
 * Sampler versions are PEFT adapter directories: loaded on first use with `/v1/load_lora_adapter`
 * under a name derived from the directory, kept in an LRU of `maxAdapters`, unloaded with
 * `/v1/unload_lora_adapter` (never while a request uses them). Training ops are user errors.
 */

// ---------------------------------------------------------------------------------------------
// Translation (pure functions; test/vllm-adapter.test.ts checks them against recorded responses)
// ---------------------------------------------------------------------------------------------

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
    '--disable-uvicorn-access-log',
  ];
  // On the CPU: float32 like the torch engine, and no graph compilation (fast start, no compiler needed).
  if (cpu) args.push('--dtype', spec.dtype ?? 'float32', '--enforce-eager');
  else if (spec.dtype) args.push('--dtype', spec.dtype);
  args.push(...(o.extraArgs ?? []));
  const env: Record<string, string> = {
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: 'True',
    HF_HUB_OFFLINE: '1',
    TRANSFORMERS_OFFLINE: '1',
  };
  if (cpu) {
    env.VLLM_TARGET_DEVICE = 'cpu';
    env.VLLM_CPU_KVCACHE_SPACE = process.env.VLLM_CPU_KVCACHE_SPACE ?? '1';
  }
  const gpus = /^cuda:([\d,]+)$/.exec(o.device ?? '');
  if (gpus) env.CUDA_VISIBLE_DEVICES = gpus[1]!;
  return { args, env };
}

/** What the agent needs from the model directory: the torch engine reads the same files. */
export type ModelFiles = { arch: string; vocabSize: number; eosTokenId: number | null };

function readJson(file: string): any {
  return JSON.parse(readFileSync(file, 'utf8'));
}

/**
 * Architecture and vocabulary size from config.json, and the tokenizer's EOS id (tokenizer_config.json's
 * `eos_token`, looked up in tokenizer.json): the same EOS the torch engine stops at (`tokenizer.eos_token_id`).
 */
export function readModelFiles(dir: string): ModelFiles {
  const cfgFile = path.join(dir, 'config.json');
  if (!existsSync(cfgFile)) throw new EngineError('server', `model directory ${dir} has no config.json`);
  const cfg = readJson(cfgFile);
  const text = cfg.text_config ?? {};
  const vocabSize = Number(cfg.vocab_size ?? text.vocab_size);
  if (!Number.isInteger(vocabSize) || vocabSize <= 0) throw new EngineError('server', `${cfgFile} has no vocab_size`);
  const arch = String((cfg.architectures ?? [])[0] ?? cfg.model_type ?? 'unknown');
  return { arch, vocabSize, eosTokenId: tokenizerEos(dir) };
}

function tokenizerEos(dir: string): number | null {
  const read = (f: string) => (existsSync(path.join(dir, f)) ? readJson(path.join(dir, f)) : {});
  const tc = read('tokenizer_config.json');
  let eos = tc.eos_token ?? read('special_tokens_map.json').eos_token;
  if (eos && typeof eos === 'object') eos = eos.content;
  if (typeof eos !== 'string') return null;
  for (const [id, t] of Object.entries<any>(tc.added_tokens_decoder ?? {})) if (t?.content === eos) return Number(id);
  const tok = read('tokenizer.json');
  for (const t of tok.added_tokens ?? []) if (t?.content === eos) return Number(t.id);
  const vocab = tok.model?.vocab;
  if (vocab && !Array.isArray(vocab) && typeof vocab[eos] === 'number') return vocab[eos];
  return null;
}

/** The entry of `GET /v1/models` that serves `spec` (by name, alias or directory; else the only base model). */
export function findServedModel(models: unknown, spec: BaseModelSpec, url: string): { id: string; maxModelLen: number } {
  const data: any[] = Array.isArray((models as any)?.data) ? (models as any).data : [];
  const bases = data.filter((m) => m && (m.parent === null || m.parent === undefined));
  const names = new Set([spec.name, ...spec.aliases]);
  const hit =
    bases.find((m) => names.has(m.id)) ??
    bases.find((m) => typeof m.root === 'string' && path.resolve(m.root) === path.resolve(spec.path)) ??
    (bases.length === 1 ? bases[0] : undefined);
  if (!hit) throw new EngineError('server', `the vLLM server at ${url} serves ${bases.map((m) => m.id).join(', ') || 'no model'}, not ${spec.name}`);
  const maxModelLen = Number(hit.max_model_len);
  if (!Number.isInteger(maxModelLen) || maxModelLen <= 0) throw new EngineError('server', `the vLLM server at ${url} reports no max_model_len for ${hit.id}`);
  return { id: String(hit.id), maxModelLen };
}

/**
 * SampleJob → `POST /v1/completions` body. The prompt goes as token ids; every sampling field is
 * sent (nothing falls back to the server's defaults). EOS: vLLM would also stop at every EOS id
 * of the model's generation_config.json; the torch engine stops only at the tokenizer's EOS. So
 * vLLM's own EOS handling is always off (`ignore_eos`) and the tokenizer's EOS, when `stop_at_eos`,
 * is a stop token id, which vLLM keeps in the output like the torch engine.
 */
export function completionRequest(job: SampleJob, model: string, eosTokenId: number | null): Record<string, unknown> {
  const p = job.sampling_params;
  const stopIds = [...p.stop_tokens];
  if (p.stop_at_eos && eosTokenId !== null && !stopIds.includes(eosTokenId)) stopIds.push(eosTokenId);
  const body: Record<string, unknown> = {
    model,
    prompt: job.prompt,
    n: job.num_samples,
    max_tokens: p.max_tokens,
    temperature: p.temperature,
    top_p: p.top_p,
    top_k: p.top_k > 0 ? p.top_k : -1,
    min_p: 0,
    presence_penalty: 0,
    frequency_penalty: 0,
    repetition_penalty: 1,
    stop_token_ids: stopIds,
    ignore_eos: true,
    logprobs: 0,
    return_token_ids: true,
    return_tokens_as_token_ids: true,
    skip_special_tokens: false,
    stream: false,
  };
  if (p.seed !== null) body.seed = p.seed;
  if (p.stop_strings.length) body.stop = p.stop_strings;
  if (job.prompt_logprobs || job.topk_prompt_logprobs > 0) body.prompt_logprobs = job.topk_prompt_logprobs;
  return body;
}

const bad = (what: string) => new EngineError('server', `vLLM returned an unexpected completion: ${what}`);

/**
 * `/v1/completions` answer → SampleResult, as the torch engine answers `sample`: one sequence per
 * choice (by `index`), its `token_ids` (the stop token, and the tokens that completed a stop string,
 * included; vLLM trims only the text), the processed logprob of each, `stop` or `length`; prompt
 * logprobs `[null, lp(prompt[1]), …]` and top-K rows most likely first.
 */
export function completionResult(job: SampleJob, body: unknown): SampleResult {
  const choices: any[] = (body as any)?.choices;
  if (!Array.isArray(choices) || choices.length !== job.num_samples)
    throw bad(`expected ${job.num_samples} choices, got ${Array.isArray(choices) ? choices.length : 'none'}`);
  const sorted = [...choices].sort((a, b) => Number(a.index) - Number(b.index));
  const sequences = sorted.map((c, i) => {
    const lp = c.logprobs?.token_logprobs;
    // `token_ids` needs return_token_ids (vLLM ≥ 0.10.2); older servers still name the ids in logprobs.tokens ("token_id:N").
    const tokens: unknown[] = Array.isArray(c.token_ids)
      ? c.token_ids
      : Array.isArray(c.logprobs?.tokens)
        ? c.logprobs.tokens.map((t: string) => Number(/^token_id:(-?\d+)$/.exec(t)?.[1] ?? NaN))
        : [];
    if (!Array.isArray(lp) || lp.length !== tokens.length || tokens.length === 0) throw bad(`choice ${i}: ${tokens.length} tokens and ${Array.isArray(lp) ? lp.length : 'no'} logprobs`);
    if (!tokens.every((t) => Number.isInteger(t))) throw bad(`choice ${i}: token ids are not integers`);
    if (!lp.every((x: unknown) => typeof x === 'number' && Number.isFinite(x))) throw bad(`choice ${i}: a logprob is missing or not finite`);
    const reason = c.finish_reason;
    if (reason !== 'stop' && reason !== 'length') throw bad(`choice ${i} finished with '${reason}' (aborted?)`);
    return { tokens: tokens as number[], logprobs: lp as number[], stop_reason: reason as 'stop' | 'length' };
  });

  const wantLps = job.prompt_logprobs;
  const k = job.topk_prompt_logprobs;
  let promptLps: (number | null)[] | null = null;
  let topk: ([number, number][] | null)[] | null = null;
  if (wantLps || k > 0) {
    const rows: unknown = sorted[0]?.prompt_logprobs;
    if (!Array.isArray(rows) || rows.length !== job.prompt.length) throw bad(`prompt_logprobs has ${Array.isArray(rows) ? rows.length : 'no'} rows for a prompt of ${job.prompt.length}`);
    promptLps = [null];
    topk = [null];
    for (let i = 1; i < rows.length; i++) {
      const row = rows[i] as Record<string, { logprob: number }> | null;
      const own = row?.[String(job.prompt[i])]?.logprob;
      if (typeof own !== 'number') throw bad(`prompt_logprobs[${i}] lacks the prompt token ${job.prompt[i]}`);
      promptLps.push(own);
      // The row holds the prompt token and the K most likely (K+1 entries when the prompt token is not among them).
      // JSON object keys that look like integers come back in numeric order, so sort by logprob.
      const entries = Object.entries(row!).map(([id, v]) => [Number(id), v.logprob] as [number, number]);
      entries.sort((a, b) => b[1] - a[1]);
      topk.push(entries.slice(0, k));
    }
  }
  return SampleResult.parse({ sequences, prompt_logprobs: wantLps ? promptLps : null, topk_prompt_logprobs: k > 0 ? topk : null });
}

/** The message of a vLLM error body: `{"error": {"message"}}` (OpenAI), `{"detail"}` (FastAPI), or text. */
export function vllmMessage(body: unknown): string {
  const b = body as any;
  if (typeof b === 'string') return b.trim() || '(empty body)';
  if (typeof b?.error?.message === 'string') return b.error.message;
  if (typeof b?.message === 'string') return b.message;
  if (typeof b?.detail === 'string') return b.detail;
  if (Array.isArray(b?.detail)) return b.detail.map((d: any) => `${(d.loc ?? []).join('.')}: ${d.msg}`).join('; ');
  return JSON.stringify(b);
}

/**
 * A vLLM HTTP error → the Tinker error category: what vLLM refuses as a bad request (400, 422) is the
 * client's (user) with vLLM's message; anything else is the server's.
 */
export function vllmError(status: number, body: unknown, what: string): EngineError {
  const msg = vllmMessage(body);
  if (status === 400 || status === 422) return new EngineError('user', `vLLM refused the ${what}: ${msg}`);
  return new EngineError('server', `vLLM ${what} failed (HTTP ${status}): ${msg}`);
}

/** The LoRA name of a sampler version: its directory and the adapter file's identity (a rewritten directory is another version). */
export function loraName(dir: string, mtimeNs: bigint, size: number): string {
  const h = createHash('sha256').update(`${path.resolve(dir)}\0${mtimeNs}\0${size}`).digest('hex').slice(0, 16);
  const base = path.basename(dir).replace(/[^a-zA-Z0-9_.-]/g, '_').slice(0, 40);
  return `tb-${base}-${h}`;
}

export const ADAPTER_FILES = ['adapter_config.json', 'adapter_model.safetensors'] as const;

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

export type HttpReply = { status: number; body: unknown };

/** A small JSON client over node:http (keep-alive; no timeout on completions, which may wait in vLLM's queue). */
export class VllmClient {
  private readonly agent = new http.Agent({ keepAlive: true, maxSockets: 256 });

  constructor(readonly url: string) {}

  request(method: 'GET' | 'POST', route: string, body?: unknown, timeoutMs = 0): Promise<HttpReply> {
    const u = new URL(route, this.url);
    const payload = body === undefined ? undefined : Buffer.from(JSON.stringify(body));
    return new Promise((resolve, reject) => {
      const req = http.request(
        u,
        {
          method,
          agent: this.agent,
          headers: payload ? { 'content-type': 'application/json', 'content-length': payload.length } : {},
        },
        (res) => {
          const chunks: Buffer[] = [];
          res.on('data', (c: Buffer) => chunks.push(c));
          res.on('error', (e) => reject(this.unreachable(route, e)));
          res.on('end', () => {
            const text = Buffer.concat(chunks).toString('utf8');
            let parsed: unknown = text;
            if ((res.headers['content-type'] ?? '').includes('json')) {
              try {
                parsed = JSON.parse(text);
              } catch {
                /* keep the text */
              }
            }
            resolve({ status: res.statusCode ?? 0, body: parsed });
          });
        },
      );
      if (timeoutMs) req.setTimeout(timeoutMs, () => req.destroy(new Error(`no answer within ${timeoutMs} ms`)));
      req.on('error', (e) => reject(this.unreachable(route, e)));
      req.end(payload);
    });
  }

  private unreachable(route: string, e: Error): EngineError {
    const code = (e as NodeJS.ErrnoException).code;
    return new EngineError('server', `the vLLM server at ${this.url} is unreachable (${route}: ${code ?? e.message})`);
  }

  close(): void {
    this.agent.destroy();
  }
}

// ---------------------------------------------------------------------------------------------
// One served base model: its server, LoRA adapters (LRU) and sampling
// ---------------------------------------------------------------------------------------------

type Lora = { name: string; dir: string; ready: Promise<void>; users: number; lastUsed: number; settled: boolean };

export class VllmModel {
  private readonly loras = new Map<string, Lora>();
  private readonly unloading = new Map<string, Promise<void>>();
  private clock = 0;

  constructor(
    readonly client: VllmClient,
    /** The `model` name of the base in requests. */
    readonly servedName: string,
    readonly eosTokenId: number | null,
    readonly maxAdapters: number,
    private readonly log: Logger,
  ) {}

  /** Names of the adapters loaded now, least recently used first. */
  loadedAdapters(): string[] {
    return [...this.loras.values()].sort((a, b) => a.lastUsed - b.lastUsed).map((l) => l.name);
  }

  async sample(job: SampleJob): Promise<SampleResult> {
    for (let attempt = 0; ; attempt++) {
      const lora = job.adapter_dir === null ? null : await this.acquire(job.adapter_dir);
      try {
        const res = await this.client.request('POST', '/v1/completions', completionRequest(job, lora?.name ?? this.servedName, this.eosTokenId));
        // The server no longer knows the adapter (it restarted, or someone unloaded it): load it again, once.
        if (res.status === 404 && lora && attempt === 0) {
          this.log.warn('vLLM lost a sampler adapter; loading it again', { lora: lora.name, dir: lora.dir });
          this.forget(lora);
          continue;
        }
        if (res.status !== 200) throw vllmError(res.status, res.body, 'completion');
        return completionResult(job, res.body);
      } finally {
        if (lora) this.release(lora);
      }
    }
  }

  /** The adapter of a sampler directory, loaded on first use; the caller releases it. */
  private async acquire(dir: string): Promise<Lora> {
    const abs = path.resolve(dir);
    for (const f of ADAPTER_FILES)
      if (!existsSync(path.join(abs, f))) throw new EngineError('user', `adapter_dir ${abs} is not a PEFT adapter directory (no ${f})`);
    const st = await stat(path.join(abs, 'adapter_model.safetensors'), { bigint: true });
    const name = loraName(abs, st.mtimeNs, Number(st.size));
    let lora = this.loras.get(name);
    if (!lora) {
      const created: Lora = { name, dir: abs, ready: Promise.resolve(), users: 0, lastUsed: 0, settled: false };
      created.ready = this.load(created).finally(() => (created.settled = true));
      this.loras.set(name, created);
      lora = created;
    }
    lora.users++;
    lora.lastUsed = ++this.clock;
    try {
      await lora.ready;
    } catch (e) {
      lora.users--;
      if (this.loras.get(name) === lora) this.loras.delete(name);
      throw e;
    }
    return lora;
  }

  private async load(lora: Lora): Promise<void> {
    await this.unloading.get(lora.name); // an unload of the same name finishes first
    const res = await this.client.request('POST', '/v1/load_lora_adapter', { lora_name: lora.name, lora_path: lora.dir });
    if (res.status === 200) {
      this.log.info('loaded sampler adapter', { lora: lora.name, dir: lora.dir });
      return;
    }
    const msg = vllmMessage(res.body);
    // Names are derived from the files, so an adapter of this name is this one (a server we attached to kept it).
    if (res.status === 400 && /already been loaded/.test(msg)) return;
    if (res.status === 404)
      throw new EngineError('server', `the vLLM server at ${this.client.url} cannot read the sampler adapter ${lora.dir} (${msg}); it must see the same storage directory as the agents`);
    throw vllmError(res.status, res.body, `load of sampler adapter ${lora.dir}`);
  }

  private release(lora: Lora): void {
    lora.users--;
    lora.lastUsed = ++this.clock;
    this.evict();
  }

  private forget(lora: Lora): void {
    if (this.loras.get(lora.name) === lora) this.loras.delete(lora.name);
  }

  /** Beyond the bound, unloads the least recently used adapters that no request is using. */
  private evict(): void {
    while (this.loras.size > this.maxAdapters) {
      const idle = [...this.loras.values()].filter((l) => l.users === 0 && l.settled).sort((a, b) => a.lastUsed - b.lastUsed)[0];
      if (!idle) return;
      this.loras.delete(idle.name);
      const p = this.unload(idle.name).finally(() => {
        if (this.unloading.get(idle.name) === p) this.unloading.delete(idle.name);
      });
      this.unloading.set(idle.name, p);
    }
  }

  private async unload(name: string): Promise<void> {
    try {
      const res = await this.client.request('POST', '/v1/unload_lora_adapter', { lora_name: name });
      if (res.status === 200 || res.status === 404) this.log.info('unloaded sampler adapter', { lora: name });
      else this.log.warn('vLLM did not unload a sampler adapter', { lora: name, status: res.status, error: vllmMessage(res.body) });
    } catch (e) {
      this.log.warn('vLLM did not unload a sampler adapter', { lora: name, error: String((e as Error).message) });
    }
  }

  /** Unloads every adapter this agent loaded (on an attached server, which outlives the agent). */
  async unloadAll(): Promise<void> {
    const names = [...this.loras.keys()];
    this.loras.clear();
    await Promise.all(names.map((n) => this.unload(n)));
  }
}

// ---------------------------------------------------------------------------------------------
// The server process
// ---------------------------------------------------------------------------------------------

async function freePort(host: string): Promise<number> {
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

class VllmServer {
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
    killers.add(this.killGroup);
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

/** Process groups of running vLLM servers, killed if the agent process exits without stopping them. */
const killers = new Set<(signal?: NodeJS.Signals) => void>();
process.once('exit', () => {
  for (const k of killers) k('SIGKILL');
});

// ---------------------------------------------------------------------------------------------
// The adapter
// ---------------------------------------------------------------------------------------------

export type VllmAdapterOptions = {
  log: Logger;
  /** `cpu`, `cuda`, `cuda:N[,M…]` (the agent's device); undefined lets vLLM choose. */
  device?: string | undefined;
  /** Attach to these servers (one per base model, in loadBase order) instead of starting `vllm serve`. */
  urls?: string[] | undefined;
  /** The `vllm` executable. @defaultValue `TB_VLLM_BIN`, else `.venv-vllm/bin/vllm` when it exists, else `vllm` */
  bin?: string;
  /** Sampler versions kept loaded per base model. @defaultValue `TB_VLLM_MAX_ADAPTERS` or 8 */
  maxAdapters?: number;
  /** How long a server may take to become healthy. @defaultValue `TB_VLLM_START_TIMEOUT_S` or 1200 s */
  startTimeoutMs?: number;
};

function defaultBin(): string {
  if (process.env.TB_VLLM_BIN) return process.env.TB_VLLM_BIN;
  const venv = path.resolve('.venv-vllm/bin/vllm');
  return existsSync(venv) ? venv : 'vllm';
}

export class VllmAdapter implements EngineAdapter {
  readonly kind = 'vllm';
  readonly device: string;
  private readonly models = new Map<string, VllmModel>();
  private servers: VllmServer[] = [];
  private readonly exitListeners: ((reason: string) => void)[] = [];
  private readonly bin: string;
  private readonly maxAdapters: number;
  private readonly startTimeoutMs: number;

  constructor(private readonly opts: VllmAdapterOptions) {
    this.device = opts.device ?? 'auto';
    this.bin = opts.bin ?? defaultBin();
    this.maxAdapters = Math.max(1, opts.maxAdapters ?? Number(process.env.TB_VLLM_MAX_ADAPTERS ?? 8));
    this.startTimeoutMs = opts.startTimeoutMs ?? Number(process.env.TB_VLLM_START_TIMEOUT_S ?? 1200) * 1000;
  }

  onExit(listener: (reason: string) => void): void {
    this.exitListeners.push(listener);
  }

  enginePids(): number[] {
    return this.servers.map((s) => s.pid).filter((p): p is number => p !== undefined);
  }

  /** (Re)starts from nothing: servers of a previous start are stopped; loadBase starts or attaches one per model. */
  async start(): Promise<void> {
    await this.stopServers();
    for (const m of this.models.values()) m.client.close();
    this.models.clear();
  }

  async stop(): Promise<void> {
    if (this.opts.urls?.length) await Promise.all([...this.models.values()].map((m) => m.unloadAll().catch(() => undefined)));
    await this.stopServers();
    for (const m of this.models.values()) m.client.close();
    this.models.clear();
  }

  private async stopServers(): Promise<void> {
    const servers = this.servers;
    this.servers = [];
    await Promise.all(servers.map((s) => s.stop()));
  }

  async loadBase(spec: BaseModelSpec): Promise<ServedModel> {
    const files = readModelFiles(spec.path);
    const index = this.models.size;
    let client: VllmClient;
    let server: VllmServer | null = null;
    const attach = this.opts.urls?.[index];
    if (this.opts.urls?.length && !attach) throw new EngineError('server', `TB_VLLM_URL names ${this.opts.urls.length} server(s), but this agent serves more models (${spec.name})`);
    if (attach) {
      client = new VllmClient(attach);
      this.opts.log.info('attaching to vLLM', { url: attach, model: spec.name });
    } else {
      const host = '127.0.0.1';
      const port = await freePort(host);
      const { args, env } = vllmServeCommand(spec, {
        device: this.opts.device,
        host,
        port,
        maxAdapters: this.maxAdapters,
        maxLoras: Math.min(4, this.maxAdapters),
        extraArgs: (process.env.TB_VLLM_EXTRA_ARGS ?? '').split(/\s+/).filter(Boolean),
      });
      server = new VllmServer(this.bin, this.opts.log.child({ model: spec.name }), (reason) => {
        for (const l of this.exitListeners) l(reason);
      });
      this.servers.push(server);
      server.start(args, env);
      client = new VllmClient(`http://${host}:${port}`);
    }
    const started = Date.now();
    await waitForHealth(client, this.startTimeoutMs, () => server?.exited ?? null);
    const models = await client.request('GET', '/v1/models', undefined, 30_000);
    if (models.status !== 200) throw vllmError(models.status, models.body, 'model listing');
    const served = findServedModel(models.body, spec, client.url);
    this.models.set(spec.name, new VllmModel(client, served.id, files.eosTokenId, this.maxAdapters, this.opts.log.child({ model: spec.name })));
    this.opts.log.info('vLLM serving', { model: spec.name, url: client.url, served_as: served.id, max_model_len: served.maxModelLen, ready_s: Math.round((Date.now() - started) / 1000) });
    return {
      name: spec.name,
      aliases: spec.aliases,
      arch: files.arch,
      vocab_size: files.vocabSize,
      max_context_length: served.maxModelLen,
      // Sampling only: the API places no training on this agent's models.
      trainable: false,
      lora_max_rank: spec.loraMaxRank,
      topk_max: spec.topkMax,
    };
  }

  /** The served model of a base (tests, diagnostics). */
  model(name: string): VllmModel | undefined {
    return this.models.get(name);
  }

  async sample(job: SampleJob): Promise<SampleResult> {
    const m = this.models.get(job.base_model);
    if (!m) throw new EngineError('server', `base model ${job.base_model} is not served by this vLLM agent`);
    return m.sample(job);
  }

  private samplingOnly(model: string): never {
    throw new EngineError('user', `model ${model} is served by vLLM for sampling only; train on an actor agent`);
  }

  async createModel(job: CreateModelJob): Promise<{ model_id: string }> {
    return this.samplingOnly(job.base_model);
  }
  async forwardBackward(job: ForwardBackwardJob): Promise<never> {
    return this.samplingOnly(job.model_id);
  }
  async optimStep(job: OptimStepJob): Promise<never> {
    return this.samplingOnly(job.model_id);
  }
  async saveSampler(job: SaveSamplerJob): Promise<never> {
    return this.samplingOnly(job.model_id);
  }
  async saveState(modelId: string, _dir: string, _optimizer: boolean): Promise<never> {
    return this.samplingOnly(modelId);
  }
  async loadState(modelId: string, _dir: string, _optimizer: boolean): Promise<never> {
    return this.samplingOnly(modelId);
  }
  async unloadModel(): Promise<void> {
    // Nothing was created here.
  }
}
