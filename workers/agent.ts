import { existsSync } from 'node:fs';
import { readdir, rename, rm, stat } from 'node:fs/promises';
import path from 'node:path';
import { Queue, UnrecoverableError, Worker, type Job } from 'bullmq';
import type { Redis } from 'ioredis';
import { ZodError } from 'zod';
import type { AgentConfig } from '../queues/config.js';
import { encodeJobFailure, isBrokerError, type ErrorCategory } from '../queues/errors.js';
import { logger as rootLogger, type Logger } from '../queues/logger.js';
import { publishAgentStats, recordJob, recordTokens, removeAgentStats, type JobStatus } from '../queues/metrics.js';
import { Names } from '../queues/names.js';
import { connect } from '../queues/redis.js';
import { Registry, type CheckpointRecord, type ModelRecord, type ServedModel } from '../queues/registry.js';
import { writeStabilityRecords } from '../queues/stability.js';
import { SampleJob, TrainJob, type SampleResult, type AnyJob, type SaveExternalJob, type SaveSamplerJob, type SaveStateJob } from '../queues/schemas.js';
import type { EngineAdapter } from './adapters/adapter.js';
import { TorchAdapter } from './adapters/torch.js';
import { VerlAdapter } from './adapters/verl.js';
import { VllmAdapter } from './adapters/vllm.js';
import { encryptFileInPlace } from '../queues/age.js';
import { EngineError } from './engine.js';
import { SampleGatherer } from './sample-gather.js';
import { engineMemory } from './stats.js';

/**
 * A worker agent: registers in Redis, supervises its engine, and consumes
 * - its training queue (`train-<agentId>`): the ordered ops of the models placed here, one at
 *   a time, never retried (`maxStalledCount: 0`: a crash fails the op instead of re-running it);
      const gatherer = this.gatherers.get(data.base_model);
      const result = gatherer ? await gatherer.submit(data) : await this.adapter.sample(data);
      if (data.record_stability) await writeStabilityRecords(this.redis, this.names, data.record_stability, data.prompt, result.sequences);
      return result;
 */
const HEARTBEAT_MS = 5_000;

export class Agent {
  readonly names: Names;
  readonly log: Logger;
  private redis!: Redis;
  private registry!: Registry;
  private readonly adapter: EngineAdapter;
  private served: ServedModel[] = [];
  private workers: Worker[] = [];
  private heartbeat: NodeJS.Timeout | undefined;
  private stopping = false;
  private restarting: Promise<void> | null = null;
  /** Per served base model: its sample gatherer (engines with sampleBatch) and queue handle. */
  private readonly gatherers = new Map<string, SampleGatherer>();
  private readonly sampleQueues: Queue[] = [];
  /** Models whose adapters live in the current engine process. */
  private readonly loaded = new Set<string>();

  constructor(
    readonly config: AgentConfig,
    adapter?: EngineAdapter,
  ) {
    this.names = new Names(config.prefix);
    this.log = rootLogger.child({ agentId: config.agentId });
    this.adapter = adapter ?? Agent.adapterFor(config, this.log);
  }

  /** The engine adapter of the agent's models: torch (trains and samples), vLLM (samples only) or verl (trains only). */
  static adapterFor(config: AgentConfig, log: Logger): EngineAdapter {
    const engine = config.engine ?? 'torch';
    if (engine === 'torch') return new TorchAdapter({ python: config.python, device: config.engineDevice, log });
    if (engine === 'vllm') return new VllmAdapter({ device: config.engineDevice, urls: config.vllmUrls, log });
    if (engine === 'verl') return new VerlAdapter({ python: config.python, device: config.engineDevice, log, models: config.models });
    throw new Error(`agent ${config.agentId}: engine '${String(engine)}' is not available in this version (torch, vllm and verl are)`);
  }

  get trainQueue(): string {
    return this.names.trainQueue(this.config.agentId);
  }

  async start(): Promise<void> {
    this.redis = connect(this.config.redisUrl, 'blocking');
    this.registry = new Registry(this.redis, this.names);
    this.adapter.onExit((reason) => this.onEngineExit(reason));
    await this.startEngine();
    // A new engine holds no adapters: models placed on this agent id before are gone.
    const lost = await this.registry.markModelsLost(this.config.agentId, 'its worker agent restarted; load it from a saved checkpoint');
    if (lost.length) this.log.warn('models from a previous run of this agent are unavailable', { models: lost });

    const common = { connection: this.redis, prefix: this.names.bull, maxStalledCount: 0 };
    this.workers.push(
      new Worker<AnyJob>(this.trainQueue, (job) => this.runTrain(job), { ...common, concurrency: 1 }),
      // An engine that only trains (verl) takes no sample jobs: they wait for agents that sample.
      ...(this.adapter.samples === false ? [] : this.served).map(
        (m) =>
          new Worker<AnyJob>(this.names.sampleQueue(m.name, this.adapter.kind), (job) => this.runSample(job), {
            ...common,
            concurrency: this.config.sampleConcurrency,
          }),
      ),
    );
    if (this.adapter.sampleBatch) for (const m of this.served) this.gatherers.set(m.name, this.makeGatherer(m.name));
    for (const w of this.workers) {
      w.on('error', (err) => this.log.error('worker error', { queue: w.name, error: String(err) }));
      w.on('failed', (job, err) => this.log.warn('job failed', { queue: w.name, jobId: job?.id, op: job?.name, error: err.message }));
      await w.waitUntilReady();
    }
    await this.registry.registerAgent({
      agent_id: this.config.agentId,
      train_queue: this.trainQueue,
      models: this.served,
      engine: this.adapter.kind,
      device: this.adapter.device,
      started_at: new Date().toISOString(),
    });
    this.heartbeat = setInterval(() => {
      this.registry.heartbeatAgent(this.config.agentId).catch((e) => this.log.warn('heartbeat failed', { error: String(e) }));
      void this.publishStats();
    }, HEARTBEAT_MS);
    await this.publishStats();
    this.log.info('agent ready', { trainQueue: this.trainQueue, models: this.served.map((m) => m.name), device: this.adapter.device });
  }

  /** Engine memory for /metrics and `tinker-broker agents`; a failure to read it is not an error of the agent. */
  private async publishStats(): Promise<void> {
    try {
      const mem = await engineMemory(this.adapter.enginePids?.() ?? [], this.adapter.device.startsWith('cuda'));
      await publishAgentStats(this.redis, this.names, {
        agent_id: this.config.agentId,
        engine: this.adapter.kind,
        device: this.adapter.device,
        engine_rss_bytes: mem.rss,
        gpu_memory_bytes: mem.gpu,
        updated_at: new Date().toISOString(),
      });
    } catch (e) {
      this.log.debug('engine stats not published', { error: String(e) });
    }
  }

  private async startEngine(): Promise<void> {
    await this.adapter.start();
    this.served = [];
    for (const spec of this.config.models) this.served.push(await this.adapter.loadBase(spec));
  }

  private onEngineExit(reason: string): void {
    if (this.stopping) return;
    this.log.error('engine process died', { reason });
    const models = [...this.loaded];
    this.loaded.clear();
    // Set synchronously, so a job taken from now on waits for the new engine.
    this.restarting = (async () => {
      try {
        await this.registry.markModelsLost(this.config.agentId, `${reason}; load it from a saved checkpoint`);
        if (models.length) this.log.warn('models lost with the engine', { models });
        if (!this.config.engineRestart) throw new Error('engine restart is disabled (TB_ENGINE_RESTART=false)');
        await this.startEngine();
        this.log.info('engine restarted');
      } catch (e) {
        this.log.error('engine not restarted; agent stopping', { error: String(e) });
        process.exitCode = 1;
        void this.stop();
      } finally {
        this.restarting = null;
      }
    })();
  }

  private async ensureEngine(): Promise<void> {
    if (this.restarting) await this.restarting;
  }

  private async requireLoaded(modelId: string): Promise<void> {
    if (this.loaded.has(modelId)) return;
    const rec = await this.registry.getModel(modelId);
    const why = rec?.lost_reason ?? 'it is not loaded on this agent';
    throw new EngineError('server', `model ${modelId} is unavailable: ${why}`);
  }

  private async runTrain(job: Job<AnyJob>): Promise<unknown> {
    return this.guard(job, async () => {
      await this.ensureEngine();
      const data = TrainJob.parse(job.data);
      switch (data.op) {
        case 'create_model': {
          const r = await this.adapter.createModel(data);
          this.loaded.add(data.model_id);
          return r;
        }
        case 'forward_backward':
          await this.requireLoaded(data.model_id);
          return this.adapter.forwardBackward(data);
        case 'optim_step':
          await this.requireLoaded(data.model_id);
          return this.adapter.optimStep(data);
        case 'save_weights_for_sampler':
          await this.requireLoaded(data.model_id);
          return this.saveSampler(data);
        case 'save_weights':
          await this.requireLoaded(data.model_id);
          return this.saveState(data);
        case 'load_weights': {
          await this.requireLoaded(data.model_id);
          if (!(await this.registry.getCheckpoint(data.tinker_path)))
            throw new EngineError('user', `checkpoint ${data.tinker_path} does not exist (deleted or expired)`);
          await this.adapter.loadState(data.model_id, data.dir, data.optimizer);
          return { path: data.tinker_path, model_id: data.model_id };
        }
        case 'save_weights_external':
          await this.requireLoaded(data.model_id);
          return this.saveExternal(data);
        case 'unload_model':
          if (this.loaded.has(data.model_id)) await this.adapter.unloadModel(data.model_id);
          this.loaded.delete(data.model_id);
          await this.registry.markModelLost(data.model_id, 'it was unloaded (unload_model)');
          return { model_id: data.model_id };
      }
    });
  }

  /** The model a checkpoint job saves (it exists: create_model ran before any op of the model). */
  private async modelOf(job: { model_id: string }): Promise<ModelRecord> {
    return (await this.registry.getModel(job.model_id))!;
  }

  private checkpointRecord(
    model: ModelRecord,
    job: { tinker_path: string; dir: string; ttl_seconds: number | null; user_metadata: Record<string, string> | null },
    type: CheckpointRecord['checkpoint_type'],
    extra: { size_bytes: number; has_optimizer: boolean; ephemeral: boolean },
  ): CheckpointRecord {
    const now = Date.now();
    // Unnamed sampler saves live as long as futures do.
    const ttl = job.ttl_seconds ?? (extra.ephemeral ? this.config.retentionS : null);
    return {
      tinker_path: job.tinker_path,
      model_id: model.model_id,
      checkpoint_id: job.tinker_path.split('/').slice(-2).join('/'),
      checkpoint_type: type,
      base_model: model.base_model,
      lora: model.lora,
      dir: job.dir,
      time: new Date(now).toISOString(),
      expires_at: ttl === null ? null : new Date(now + ttl * 1000).toISOString(),
      public: false,
      user_metadata: job.user_metadata,
      tenant: model.tenant,
      ...extra,
    };
  }

  private async saveSampler(job: SaveSamplerJob): Promise<{ path: string; sampling_session_id: string | null }> {
    const ephemeral = job.sampling_session_id !== null;
    // A named sampler version is immutable: a second save under its name is refused.
    if (!ephemeral && (await this.registry.getCheckpoint(job.tinker_path)))
      throw new EngineError('user', `sampler weights ${job.tinker_path} already exist; save under a new name`);
    if (existsSync(job.dir)) await rm(job.dir, { recursive: true, force: true }); // leftovers of an expired or deleted checkpoint
    const { size_bytes } = await this.adapter.saveSampler(job);
    const model = await this.modelOf(job);
    await this.registry.putCheckpoint(this.checkpointRecord(model, job, 'sampler', { size_bytes, has_optimizer: false, ephemeral }));
    const inflight = job.kind === 'inflight';
    // The target moves before the save completes: a client created from this save never sees older weights.
    if (inflight) await this.registry.setInflightTarget(model.model_id, { model_path: job.tinker_path, adapter_dir: job.dir, seq_id: job.seq_id }, this.config.retentionS);
    if (job.sampling_session_id) {
      await this.registry.putSamplingSession(
        {
          sampling_session_id: job.sampling_session_id,
          session_id: model.session_id,
          base_model: model.base_model,
          model_path: job.tinker_path,
          adapter_dir: job.dir,
          inflight_model_id: inflight ? model.model_id : null,
          tenant: model.tenant,
        },
        this.config.retentionS,
      );
      await this.registry.indexSampler(model.session_id, job.sampling_session_id);
    }
    return { path: job.tinker_path, sampling_session_id: job.sampling_session_id };
  }

  private async saveExternal(job: SaveExternalJob): Promise<{ path: string; size_bytes: number }> {
    if (await this.registry.getCheckpoint(job.tinker_path))
      throw new EngineError('user', `external weights ${job.tinker_path} already exist; save under a new name`);
    if (existsSync(job.dir)) await rm(job.dir, { recursive: true, force: true });
    await this.adapter.saveSampler({ ...job, op: 'save_weights_for_sampler', sampling_session_id: null, user_metadata: null });
    let size = 0;
    for (const f of await readdir(job.dir, { recursive: true, withFileTypes: true })) {
      if (!f.isFile()) continue;
      const p = path.join(f.parentPath, f.name);
      const out = job.age_recipients.length ? await encryptFileInPlace(p, job.age_recipients) : p;
      size += (await stat(out)).size;
    }
    await this.registry.putCheckpoint(
      this.checkpointRecord(await this.modelOf(job), { ...job, user_metadata: null }, 'external', { size_bytes: size, has_optimizer: false, ephemeral: false }),
    );
    return { path: job.tinker_path, size_bytes: size };
  }

  private async saveState(job: SaveStateJob): Promise<{ path: string }> {
    const existing = await this.registry.getCheckpoint(job.tinker_path);
    if (existing && !job.overwrite)
      throw new EngineError('user', `checkpoint ${job.tinker_path} already exists; pass overwrite=True to replace it`);
    // Overwrite keeps the old files until the new ones are complete.
    const old = `${job.dir}.old-${Date.now()}`;
    const hadDir = existsSync(job.dir);
    if (hadDir) await rename(job.dir, old);
    try {
      const { size_bytes } = await this.adapter.saveState(job.model_id, job.dir, true);
      await this.registry.putCheckpoint(this.checkpointRecord(await this.modelOf(job), job, 'training', { size_bytes, has_optimizer: true, ephemeral: false }));
    } catch (e) {
      if (hadDir) {
        await rm(job.dir, { recursive: true, force: true });
        await rename(old, job.dir);
      }
      throw e;
    }
    if (hadDir) await rm(old, { recursive: true, force: true });
    return { path: job.tinker_path };
  }

  private makeGatherer(base: string): SampleGatherer {
    const queue = new Queue(this.names.sampleQueue(base, this.adapter.kind), { connection: this.redis, prefix: this.names.bull });
    this.sampleQueues.push(queue);
    const windowMs = this.config.sampleGatherMs ?? 10;
    return new SampleGatherer({
      windowMs,
      maxWaitMs: windowMs * 5,
      tokenBudget: this.config.sampleBatchTokens ?? 131072,
      waiting: () => queue.getWaitingCount(),
      run: async (jobs) => {
        await this.ensureEngine();
        return this.adapter.sampleBatch!(jobs);
      },
    });
  }

  private async runSample(job: Job<AnyJob>): Promise<unknown> {
    return this.guard(job, async () => {
      await this.ensureEngine();
      const data = SampleJob.parse(job.data);
      const gatherer = this.gatherers.get(data.base_model);
      const result = keepLastPromptLogprobs(gatherer ? await gatherer.submit(data) : await this.adapter.sample(data), data.prompt_logprobs_last_n ?? null);
      if (data.record_stability) await writeStabilityRecords(this.redis, this.names, data.record_stability, data.prompt, result.sequences);
      return result;
    });
  }

  /** Runs one job; any failure becomes an unrecoverable job failure carrying its category. Each job is counted in the metrics. */
  private async guard<T>(job: Job<AnyJob>, fn: () => Promise<T>): Promise<T> {
    const modelId = (job.data as { model_id?: unknown }).model_id;
    const log = this.log.child({ jobId: job.id, op: job.name, queue: job.queueName, ...(typeof modelId === 'string' ? { modelId } : {}) });
    const start = Date.now();
    let status: JobStatus = 'ok';
    try {
      const r = await fn();
      log.debug('job done', { ms: Date.now() - start });
      void this.countTokens(job, r);
      return r;
    } catch (err) {
      let category: ErrorCategory = 'server';
      let message = String((err as Error)?.message ?? err);
      if (err instanceof EngineError) category = err.category;
      else if (isBrokerError(err)) category = err.category;
      else if (err instanceof ZodError) message = `invalid ${job.name} job payload: ${err.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`;
      status = category === 'user' ? 'user_error' : 'server_error';
      throw new UnrecoverableError(encodeJobFailure(category, message));
    } finally {
      // BullMQ's timestamps: enqueued (timestamp), taken (processedOn); finished is now.
      recordJob(this.redis, this.names, { op: job.name, status, enqueuedAt: job.timestamp, startedAt: job.processedOn ?? start, finishedAt: Date.now() }).catch((e) =>
        log.debug('metrics not recorded', { error: String(e) }),
      );
    }
  }

  /** Sampled tokens (generated sequences) and trained tokens (forward_backward inputs, not forward-only). */
  private async countTokens(job: Job<AnyJob>, result: unknown): Promise<void> {
    try {
      const d = job.data;
      if (d.op === 'forward_backward' && !d.forward_only) await recordTokens(this.redis, this.names, 'trained', d.data.reduce((s, x) => s + x.tokens.length, 0));
      const seqs = (result as { sequences?: { tokens: unknown[] }[] } | null)?.sequences;
      if (d.op === 'sample' && Array.isArray(seqs)) await recordTokens(this.redis, this.names, 'sampled', seqs.reduce((s, x) => s + x.tokens.length, 0));
    } catch (e) {
      this.log.debug('token counts not recorded', { error: String(e) });
    }
  }

  async stop(): Promise<void> {
    if (this.stopping) return;
    this.stopping = true;
    clearInterval(this.heartbeat);
    await Promise.all(this.workers.map((w) => w.close()));
    await Promise.all(this.sampleQueues.map((q) => q.close().catch(() => undefined)));
    await this.registry?.removeAgent(this.config.agentId).catch(() => undefined);
    if (this.redis) await removeAgentStats(this.redis, this.names, this.config.agentId).catch(() => undefined);
    await this.adapter.stop().catch(() => undefined);
    await this.redis?.quit().catch(() => undefined);
    this.log.info('agent stopped');
  }
}

/**
 * `prompt_logprobs_last_n`: only the last N prompt positions keep their logprobs (and top-K);
 * earlier entries become null, as the SDK documents. Every engine scores the whole prompt, so
 * this is the same for torch and vLLM.
 */
export function keepLastPromptLogprobs(r: SampleResult, lastN: number | null): SampleResult {
  if (lastN === null) return r;
  const cut = <T>(xs: (T | null)[] | null) => (xs === null ? null : xs.map((v, i) => (i < xs.length - lastN ? null : v)));
  return { ...r, prompt_logprobs: cut(r.prompt_logprobs), topk_prompt_logprobs: cut(r.topk_prompt_logprobs) };
}
