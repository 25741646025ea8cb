import type { BaseModelSpec } from '../../queues/infra/config.js';
import type { ServedModel } from '../../queues/registry/agents.js';
import type { CreateModelJob, ForwardBackwardJob, ForwardBackwardResult, OptimStepJob, SampleJob, SampleResult, SaveSamplerJob } from '../../queues/contract/schemas.js';
import type { EngineAdapter } from '../../workers/adapters/adapter.js';

/** A promise a test settles when it chooses. */
export function deferred<T = void>(): { promise: Promise<T>; resolve: (v: T) => void; reject: (e: Error) => void } {
  let resolve!: (v: T) => void;
  let reject!: (e: Error) => void;
  const promise = new Promise<T>((res, rej) => ((resolve = res), (reject = rej)));
  return { promise, resolve, reject };
}

/**
 * An engine adapter without an engine, for unit tests of the agent's parts: every call is logged
 * (`calls`, e.g. `forward_backward m1`) and answered at once, unless the test holds that op
 * (`hold`: its calls wait for the returned deferred). `kill` and `exit` report an exit as a real
 * engine's death does.
 */
export class FakeAdapter implements EngineAdapter {
  readonly device = 'cpu';
  readonly calls: string[] = [];
  starts = 0;
  kills = 0;
  private readonly exitListeners: ((reason: string) => void)[] = [];
  private readonly held = new Map<string, Promise<void>>();

  constructor(readonly kind: string) {}

  /** The next calls of `op` wait until the returned deferred resolves (or fail with its rejection). */
  hold(op: string): { resolve: () => void; reject: (e: Error) => void } {
    const d = deferred();
    this.held.set(op, d.promise);
    return d;
  }

  private async call<T>(op: string, id: string, answer: T): Promise<T> {
    this.calls.push(`${op} ${id}`);
    const h = this.held.get(op);
    if (h) await h;
    return answer;
  }

  /** The next starts that die as they start (the engine's exit reported, then the start fails). */
  dyingStarts = 0;

  async start(): Promise<void> {
    this.starts++;
    if (this.dyingStarts > 0) {
      this.dyingStarts--;
      this.exit('the engine process exited as it started (signal SIGKILL)');
      throw new Error('engine process exited while starting');
    }
  }
  async stop(): Promise<void> {}
  kill(): void {
    this.kills++;
    this.exit('killed');
  }
  /** Reports the engine's death to the agent. */
  exit(reason: string): void {
    for (const l of this.exitListeners) l(reason);
  }
  onExit(listener: (reason: string) => void): void {
    this.exitListeners.push(listener);
  }
  async loadBase(spec: BaseModelSpec): Promise<ServedModel> {
    return { name: spec.name, aliases: spec.aliases, arch: 'FakeForCausalLM', vocab_size: 32, max_context_length: 64, trainable: spec.trainable, lora_max_rank: spec.loraMaxRank, topk_max: spec.topkMax };
  }
  createModel(job: CreateModelJob): Promise<{ model_id: string }> {
    return this.call('create_model', job.model_id, { model_id: job.model_id });
  }
  forwardBackward(job: ForwardBackwardJob): Promise<ForwardBackwardResult> {
    return this.call('forward_backward', job.model_id, { loss_fn_outputs: [], metrics: { 'loss:sum': 1 } });
  }
  optimStep(job: OptimStepJob): Promise<{ metrics: Record<string, number> }> {
    return this.call('optim_step', job.model_id, { metrics: {} });
  }
  saveSampler(job: SaveSamplerJob): Promise<{ size_bytes: number }> {
    return this.call('save_sampler', job.model_id, { size_bytes: 0 });
  }
  saveState(modelId: string): Promise<{ size_bytes: number }> {
    return this.call('save_state', modelId, { size_bytes: 0 });
  }
  async loadState(modelId: string): Promise<void> {
    await this.call('load_state', modelId, undefined);
  }
  async unloadModel(modelId: string): Promise<void> {
    await this.call('unload_model', modelId, undefined);
  }
  sample(job: SampleJob): Promise<SampleResult> {
    const seq = { tokens: [1, 2], logprobs: [-0.5, -0.25], stop_reason: 'length' as const };
    return this.call('sample', job.base_model, { sequences: Array.from({ length: job.num_samples }, () => seq), prompt_logprobs: null, topk_prompt_logprobs: null });
  }
}
