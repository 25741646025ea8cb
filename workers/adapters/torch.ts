import { engineSettingsEnv, type AgentConfig, type BaseModelSpec } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import type { ServedModel } from '../../queues/registry/agents.js';
import type {
  CreateModelJob,
  ForwardBackwardJob,
  ForwardBackwardResult,
  OptimStepJob,
  SampleJob,
  SampleResult,
  SaveSamplerJob,
} from '../../queues/contract/schemas.js';
import { EngineError, EngineProcess } from '../engine.js';
import { BinTensor, PROTOCOL_VERSION, type SampleRequest } from '../engine-protocol.js';
import type { EngineAdapter } from './adapter.js';
import { registerEngine } from './registry.js';

const TORCH_KIND = 'torch';

/** The per-request fields of `sample` and of each `sample_batch` request (docs/engine-protocol.md). */
function sampleRequest(job: SampleJob): SampleRequest {
  return {
    adapter_dir: job.adapter_dir,
    prompt: job.prompt,
    num_samples: job.num_samples,
    sampling_params: job.sampling_params,
    prompt_logprobs: job.prompt_logprobs,
    topk_prompt_logprobs: job.topk_prompt_logprobs,
    target_prompt_logprobs: job.target_prompt_logprobs ?? null,
    topk_sample_logprobs: job.topk_sample_logprobs ?? 0,
    prompt_alt_tokens_k: job.prompt_alt_tokens_k ?? 0,
  };
}

/**
 * The torch engine (transformers + PEFT; CPU or one GPU): the one place where Tinker jobs
 * become engine requests (docs/engine-protocol.md). Results are parsed before they leave.
 */
export type TorchAdapterOptions = {
  python: string;
  device?: string | undefined;
  log: Logger;
  /** How the engine process is started (another engine speaking the same protocol, e.g. verl under torchrun). */
  launch?: { args: string[]; env?: NodeJS.ProcessEnv } | undefined;
  /** Extra environment for the engine process (its settings, its OMP_NUM_THREADS), with any `launch`. */
  env?: NodeJS.ProcessEnv | undefined;
};

export class TorchAdapter implements EngineAdapter {
  /** The engine this adapter drives (another engine speaking the torch protocol, verl, sets its own). */
  readonly kind: string = TORCH_KIND;
  device = 'unknown';
  private engine: EngineProcess;
  private readonly exitListeners: ((reason: string) => void)[] = [];

  constructor(private readonly opts: TorchAdapterOptions) {
    this.engine = this.makeEngine();
  }

  private makeEngine(): EngineProcess {
    const e = new EngineProcess({
      python: this.opts.python,
      device: this.opts.device,
      log: this.opts.log,
      ...(this.opts.launch ? { args: this.opts.launch.args } : {}),
      env: { ...this.opts.launch?.env, ...this.opts.env },
    });
    e.on('exit', (code, signal) => {
      for (const l of this.exitListeners) l(`the engine process exited (code ${code}, signal ${signal})`);
    });
    return e;
  }

  onExit(listener: (reason: string) => void): void {
    this.exitListeners.push(listener);
  }

  enginePids(): number[] {
    return this.engine.pid ? [this.engine.pid] : [];
  }

  async start(): Promise<void> {
    this.engine = this.makeEngine();
    this.engine.start();
    const hello = await this.engine.call('hello', {});
    if (hello.protocol !== PROTOCOL_VERSION)
      throw new Error(`engine speaks protocol ${hello.protocol}; this agent speaks ${PROTOCOL_VERSION}`);
    if (hello.engine !== this.kind) throw new Error(`the ${this.kind} adapter started a '${hello.engine}' engine`);
    this.device = hello.device;
  }

  stop(): Promise<void> {
    return this.engine.stop();
  }

  kill(): void {
    this.engine.kill();
  }

  async loadBase(spec: BaseModelSpec): Promise<ServedModel> {
    const r = await this.engine.call('load_base', {
      name: spec.name,
      path: spec.path,
      ...(spec.dtype ? { dtype: spec.dtype } : {}),
    });
    return {
      name: spec.name,
      aliases: spec.aliases,
      arch: r.arch,
      vocab_size: r.vocab_size,
      max_context_length: r.max_context_length,
      trainable: spec.trainable,
      lora_max_rank: spec.loraMaxRank,
      topk_max: spec.topkMax,
    };
  }

  async createModel(job: CreateModelJob): Promise<{ model_id: string }> {
    await this.engine.call('create_model', { model_id: job.model_id, base_model: job.base_model, lora: job.lora });
    return { model_id: job.model_id };
  }

  async forwardBackward(job: ForwardBackwardJob): Promise<ForwardBackwardResult> {
    return this.engine.call('forward_backward', fbArgs(job));
  }

  /** Several models' forward_backward in one engine pass (tinker_engine/cobatch.py); a member's error comes back as its own. */
  async forwardBackwardGroup(jobs: ForwardBackwardJob[]): Promise<(ForwardBackwardResult | Error)[]> {
    // A custom loss (its graph rebuilt per op, tinker_engine/custom_loss.py) runs in its own pass, after the group.
    const grouped = jobs.filter((job) => !job.custom_loss);
    const out = new Array<ForwardBackwardResult | Error>(jobs.length);
    if (grouped.length) {
      const r = await this.engine.call('forward_backward_group', { members: grouped.map((job) => fbArgs(job)) });
      r.results.forEach((x, i) => (out[jobs.indexOf(grouped[i]!)] = 'error' in x ? new EngineError(x.error.category, x.error.message) : x));
    }
    for (const [i, job] of jobs.entries()) {
      if (!job.custom_loss) continue;
      try {
        out[i] = await this.forwardBackward(job);
      } catch (e) {
        // A member's own error is its own; the engine dying is everyone's (as for the group call).
        if (e instanceof EngineError) out[i] = e;
        else throw e;
      }
    }
    return out;
  }

  async optimStep(job: OptimStepJob): Promise<{ metrics: Record<string, number> }> {
    return this.engine.call('optim_step', { model_id: job.model_id, adam: job.adam });
  }

  async saveSampler(job: SaveSamplerJob): Promise<{ size_bytes: number }> {
    const r = await this.engine.call('save_sampler', { model_id: job.model_id, dir: job.dir });
    return { size_bytes: r.size_bytes };
  }

  async saveState(modelId: string, dir: string, optimizer: boolean, gradients = false): Promise<{ size_bytes: number }> {
    const r = await this.engine.call('save_state', { model_id: modelId, dir, optimizer, gradients });
    return { size_bytes: r.size_bytes };
  }

  async loadState(modelId: string, dir: string, optimizer: boolean, gradients = false): Promise<void> {
    await this.engine.call('load_state', { model_id: modelId, dir, optimizer, gradients });
  }

  async snapshot(modelId: string, root: string, seqId: number, keep: number): Promise<{ last_error: string | null }> {
    return this.engine.call('snapshot_state', { model_id: modelId, root, seq_id: seqId, keep });
  }

  /** A GPU turn handed over (workers/gpu-turns.ts): the allocator's cached blocks go back to the device; the models stay. */
  async releaseGpu(): Promise<void> {
    await this.engine.call('memory', { release: true });
  }

  async unloadModel(modelId: string): Promise<void> {
    await this.engine.call('unload_model', { model_id: modelId });
  }

  sample(job: SampleJob): Promise<SampleResult> {
    return this.engine.call('sample', { base_model: job.base_model, ...sampleRequest(job) });
  }

  /** One `sample_batch` call for jobs of one base model; a bad job fails alone with its own error. */
  async sampleBatch(jobs: SampleJob[]): Promise<(SampleResult | Error)[]> {
    const base = jobs[0]!.base_model;
    if (jobs.some((j) => j.base_model !== base)) throw new EngineError('server', 'a sample batch must share one base model');
    const r = await this.engine.call('sample_batch', { base_model: base, requests: jobs.map(sampleRequest) });
    if (r.results.length !== jobs.length)
      throw new EngineError('server', `the engine returned ${r.results.length} sample_batch results for ${jobs.length} requests`);
    return r.results.map((entry) => (entry.ok ? entry.result : new EngineError(entry.error.category, entry.error.message)));
  }
}

/** The torch engine process's environment: its settings, its share of the GPU (TB_GPU_MEMORY), and the configured CPU threads (TB_ENGINE_THREADS) as its OMP_NUM_THREADS. */
function torchEnv(config: AgentConfig): NodeJS.ProcessEnv {
  return {
    ...engineSettingsEnv(config.engineSettings),
    ...(config.gpuMemory === undefined ? {} : { TB_GPU_MEMORY: String(config.gpuMemory) }),
    ...(config.engineThreads === undefined ? {} : { OMP_NUM_THREADS: String(config.engineThreads) }),
  };
}

/** transformers + PEFT: trains and samples (batched), on the CPU or one GPU; the default engine. */
export const TORCH_ENGINE = registerEngine({
  kind: TORCH_KIND,
  isDefault: true,
  capabilities: {
    trains: true,
    samples: true,
    sampleLacks: [],
    sampleBatch: true,
    // One sample request at a time: an actor that shares a sample queue with rollout (vLLM) agents would set everyone's pace.
    samplePriority: 1,
    drains: true,
    gpuOnly: false,
    sharesGpu: true,
    cobatches: true,
    placement: 'runs a model on one device',
    modelOptions: [],
  },
  create: (config, log) => new TorchAdapter({ python: config.python, device: config.engineDevice, log, env: torchEnv(config) }),
});

/** A forward_backward job as the engine's request. Tensors travel as binary, not as JSON number lists. */
function fbArgs(job: ForwardBackwardJob) {
  return {
    model_id: job.model_id,
    loss_fn: job.loss_fn,
    loss_fn_config: job.loss_fn_config,
    forward_only: job.forward_only,
    ...(job.custom_loss ? { custom_loss: job.custom_loss } : {}),
    data: job.data.map((d) => ({
      tokens: BinTensor.ints([d.tokens.length], d.tokens),
      loss_fn_inputs: Object.fromEntries(Object.entries(d.loss_fn_inputs).map(([k, t]) => [k, BinTensor.from(t)])),
    })),
  };
}
