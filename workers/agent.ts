import { randomUUID } from 'node:crypto';
import os from 'node:os';
import { performance } from 'node:perf_hooks';
import { rm } from 'node:fs/promises';
import path from 'node:path';
import { Queue, UnrecoverableError, Worker, type Job } from 'bullmq';
import type { Redis } from 'ioredis';
import { ZodError } from 'zod';
import { DEFAULT_OP_TIMEOUTS_S, type AgentConfig } from '../queues/infra/config.js';
import { requireCheckpointRecord } from '../queues/runtime/checkpoints.js';
import { sampleEndSignal, signalLocally, type SampleEnd } from '../queues/runtime/completions.js';
import { BrokerError, decodeJobFailure, encodeJobFailure, failure, failureOf, modelUnavailable, outcomeUnknownMessage, recordedFailure, type Failure } from '../queues/contract/errors.js';
import { heartbeatMs, Liveness } from '../queues/runtime/liveness.js';
import { logger as rootLogger, type Logger } from '../queues/infra/logger.js';
import { addJobs, JobRecorder, publishAgentStats, removeAgentStats, type JobStatus, type TokenKind } from '../queues/runtime/metrics.js';
import { Names } from '../queues/contract/names.js';
import { Outcomes, type Outcome } from '../queues/runtime/outcomes.js';
import { connect } from '../queues/infra/redis.js';
import type { AgentRecord, ServedModel } from '../queues/registry/agents.js';
import { Registry } from '../queues/registry/index.js';
import { writeStabilityRecords } from '../queues/runtime/stability.js';
import { SampleJob, TrainJob, type SampleResult, type AnyJob } from '../queues/contract/schemas.js';
import { TrainConsumer, type TakenTrainJob, type TrainVerdict } from '../queues/runtime/train-consumer.js';
import type { EngineAdapter } from './adapters/adapter.js';
import { TorchAdapter } from './adapters/torch.js';
import { VerlAdapter } from './adapters/verl.js';
import { VllmAdapter } from './adapters/vllm.js';
import { rebuildCheckpoints } from './rebuild.js';
import { CheckpointJobs } from './checkpoint-jobs.js';
import { SampleGatherer } from './sample-gather.js';
import { engineMemory } from './stats.js';

/**
 * A worker agent: registers in Redis, supervises its engine, and consumes
 * - its training queue (`train-<agentId>`, taken by queues/runtime/train-consumer.ts): the ordered ops of
 *   the models placed here, one at a time, never retried. Each op's outcome is recorded apart from
 *   BullMQ's job state (queues/runtime/outcomes.ts): claimed before it runs, finished once; no stalled-job
 *   check runs on this queue, so a lost job lock (a long Redis outage) never turns a completed op
 *   into a failure;
 * - the sample queue of each base model it serves on its engine kind (the API routes each job), concurrently.
 * It heartbeats (queues/runtime/liveness.ts), holds its agent id against a second process, and kills an
 * engine that runs an op past its limit (`TB_OP_TIMEOUTS`). docs/reliability.md has the guarantees.
 */

class OpTimeout extends Error {
  override readonly name = 'OpTimeout';
}

export class Agent {
  readonly names: Names;
  readonly log: Logger;
  private redis!: Redis;
  private registry!: Registry;
  private checkpoints!: CheckpointJobs;
  private readonly adapter: EngineAdapter;
  private served: ServedModel[] = [];
  private workers: Worker[] = [];
  private train: TrainConsumer | null = null;
  /** The training ops' metrics, written every 100 ms (queues/runtime/metrics.ts). */
  private jobMetrics!: JobRecorder;
  private heartbeat: NodeJS.Timeout | undefined;
  private stopping = false;
  private restarting: Promise<void> | null = null;
  /** This process start; the liveness key and outcome claims carry it. */
  readonly incarnation = randomUUID();
  private outcomes!: Outcomes;
  private liveness!: Liveness;
  private record!: AgentRecord;
  /** Incremented when the engine dies: an op that saw it change does not know its outcome. */
  private engineEpoch = 0;
  /** Why the agent killed its engine (an op past its time limit), for the models' lost reason. */
  private killReason: string | null = null;
  /** Redis is unreachable: its errors are logged once per outage (redisError). */
  private redisDown = false;
  /** Set once the agent id is this process's: heartbeats start then. */
  private registered = false;
  private draining: Promise<void> | null = null;
  /** Per served base model: its sample gatherer (engines with sampleBatch: the jobs held are sent as one batch) and queue handle. */
  private readonly gatherers = new Map<string, SampleGatherer>();
  private readonly sampleQueues: Queue[] = [];
  private resolveStopped!: () => void;
  /** Resolves when the agent has stopped (a drain asked through Redis ends the process's agent too). */
  readonly stopped = new Promise<void>((r) => (this.resolveStopped = r));
  /**
   * The engine's turn of the last training op taken (see runTrain): `done` resolves when the engine
   * is free for the next one; `nextStarted` is set by the op waiting on it and resolves once that op
   * has its engine call under way, or ended without one.
   */
  private trainTurn: { done: Promise<void>; nextStarted?: Promise<void> } = { done: Promise.resolve() };
  /** Training ops taken and not yet past the engine: none means the next one taken starts at once. */
  private trainAhead = 0;
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
    if (engine === 'torch') return new TorchAdapter({ python: config.python, device: config.engineDevice, log, ...torchEnv(config) });
    if (engine === 'vllm') return new VllmAdapter({ device: config.engineDevice, urls: config.vllmUrls, log, ...config.vllm });
    if (engine === 'verl') return new VerlAdapter({ python: config.python, device: config.engineDevice, log, models: config.models });
    throw new Error(`agent ${config.agentId}: engine '${String(engine)}' is not available in this version (torch, vllm and verl are)`);
  }

  get trainQueue(): string {
    return this.names.trainQueue(this.config.agentId);
  }

  get timeoutS(): number {
    return this.config.agentTimeoutS ?? 30;
  }

  async start(): Promise<void> {
    // Reconnect within a second of Redis coming back, well inside the reaper's grace.
    this.redis = connect(this.config.redisUrl, 'blocking', { retryStrategy: (n) => Math.min(n * 50, 1_000) });
    this.redis.on('error', (err) => this.redisError('agent', err));
    this.redis.on('ready', () => {
      if (!this.redisDown) return;
      this.redisDown = false;
      this.log.info('redis reachable again');
    });
    this.registry = new Registry(this.redis, this.names);
    this.checkpoints = new CheckpointJobs(this.registry, this.adapter, this.config.retentionS);
    this.outcomes = new Outcomes(this.redis, this.names, this.config.retentionS);
    this.jobMetrics = new JobRecorder(this.redis, this.names, (e) => this.log.debug('metrics not recorded', { error: String(e) }));
    this.liveness = new Liveness(this.redis, this.names, this.registry.models, this.outcomes);
    this.record = {
      agent_id: this.config.agentId,
      train_queue: this.trainQueue,
      models: [],
      engine: this.adapter.kind,
      device: this.adapter.device,
      started_at: new Date().toISOString(),
      incarnation: this.incarnation,
      timeout_s: this.timeoutS,
      host: os.hostname(),
      pid: process.pid,
      sample_lacks: [...(this.adapter.sampleLacks ?? [])],
    };
    // The id first: a second process with this id stops here, before it touches the first one's models or jobs.
    await this.liveness.claimId(this.record, this.incarnation);
    this.registered = true;
    this.heartbeat = setInterval(() => {
      void this.beat();
      void this.publishStats();
    }, heartbeatMs(this.timeoutS));
    // Redis came back (restarted, failed over): say so at once, re-registering if it lost the record.
    this.redis.on('ready', () => void this.beat());
    this.adapter.onExit((reason) => this.onEngineExit(reason));
    await this.startEngine();
    // A new engine holds no adapters: models placed on this agent id before are gone, except those a drain saved.
    const restored = await this.restoreDrained();
    const lost = await this.registry.models.markLostOnAgent(this.config.agentId, 'its worker agent restarted; load it from a saved checkpoint', restored);
    if (lost.length) this.log.warn('models from a previous run of this agent are unavailable', { models: lost });
    await rebuildCheckpoints(this.registry, this.config.storageDir, this.log, this.config.retentionS).catch((e) => this.log.error('rebuilding checkpoint records failed', { error: String(e) }));

    const common = { connection: this.redis, prefix: this.names.bull, maxStalledCount: 0, lockDuration: this.config.jobLockMs ?? 30_000 };
    // No stalled check on the training queue: outcomes are recorded apart, the reaper handles dead agents.
    // Two at a time: the next op waits parsed in the agent while the current one runs (runTrain); an op
    // taken while the engine is free is claimed by the take itself.
    this.train = new TrainConsumer(this.redis, this.names, this.outcomes, this.trainQueue, {
      concurrency: 2,
      lockMs: common.lockDuration,
      agentId: this.config.agentId,
      tokenPrefix: `${this.incarnation}/`,
      claimAtTake: () => this.trainAhead === 0 && !this.draining && !this.stopping,
      process: (job) => this.runTrain(job),
      // A short op starts once the client has its submit's answer (its turnaround is most of its
      // round trip); a longer one first, then the answer: its engine time is.
      startsAfterAnswer: (op) => op === 'optim_step',
      log: this.log,
    });
    this.workers.push(
      // An engine that only trains (verl) takes no sample jobs: they wait for agents that sample.
      ...(this.adapter.samples === false ? [] : this.served).map((m) => {
        const w = new Worker<SampleJob, SampleResult>(this.names.sampleQueue(m.name, this.adapter.kind), (job) => this.runSample(job), {
          ...common,
          concurrency: this.config.sampleConcurrency,
        });
        // Once BullMQ has recorded the job's end: its metrics and its completion signal.
        w.on('completed', (job, result) => this.sampleEnded(job, { state: 'done', result }));
        w.on('failed', (job, err) => {
          if (!job) return;
          const { verdict: _verdict, ...f } = decodeJobFailure(err.message);
          this.sampleEnded(job, { state: 'failed', ...f });
        });
        return w;
      }),
    );
    if (this.adapter.sampleBatch) for (const m of this.served) this.gatherers.set(m.name, this.makeGatherer(m.name));
    for (const w of this.workers) {
      w.on('error', (err) => this.redisError(w.name, err));
      w.on('failed', (job, err) => {
        const d = job?.data as { model_id?: string | null; sampling_session_id?: string | null } | undefined;
        this.log.warn('job failed', { queue: w.name, jobId: job?.id, op: job?.name, modelId: d?.model_id ?? undefined, samplingSession: d?.sampling_session_id ?? undefined, error: err.message });
      });
      await w.waitUntilReady();
    }
    await this.train.start();
    this.record = { ...this.record, models: this.served, device: this.adapter.device };
    if ((await this.beat()) !== 'ok') throw new Error(`agent ${this.config.agentId} lost its registration while starting`);
    await this.publishStats();
    this.log.info('agent ready', { trainQueue: this.trainQueue, models: this.served.map((m) => m.name), device: this.adapter.device });
  }

  /**
   * Reloads the models the previous incarnation saved when it drained (weights, AdamW state and
   * accumulated gradients), so their clients go on as if nothing happened; returns their ids.
   */
  private async restoreDrained(): Promise<Set<string>> {
    const restored = new Set<string>();
    const key = this.names.agentDrained(this.config.agentId);
    const raw = await this.redis.get(key);
    if (raw === null) return restored;
    const drained = JSON.parse(raw) as { models: { model_id: string; dir: string }[] };
    for (const d of drained.models) {
      const rec = await this.registry.models.get(d.model_id);
      if (!rec || rec.agent_id !== this.config.agentId || rec.lost_reason !== null) continue;
      try {
        await this.adapter.createModel({ op: 'create_model', model_id: rec.model_id, base_model: rec.base_model, lora: rec.lora });
        await this.adapter.loadState(rec.model_id, d.dir, true, true);
        this.loaded.add(rec.model_id);
        restored.add(rec.model_id);
      } catch (e) {
        this.log.error('a drained model could not be reloaded; it is unavailable', { model: d.model_id, error: String(e) });
      }
      await rm(d.dir, { recursive: true, force: true }).catch(() => undefined);
    }
    await this.redis.del(key);
    this.log.info('models reloaded after a drain', { models: [...restored] });
    return restored;
  }

  /**
   * An error of the agent's Redis connection or of a queue's worker. A lost connection is logged once
   * per outage (every connection retries several times a second, each retry an error), and its end
   * once, when the agent's connection is ready again; any other error is logged as it comes.
   */
  private redisError(source: string, err: Error): void {
    if (!isConnectionError(err)) {
      this.log.error('worker error', { queue: source, error: String(err) });
      return;
    }
    if (this.redisDown) return;
    this.redisDown = true;
    this.log.warn('redis unreachable: the agent waits for it (logged once per outage)', { source, error: err.message });
  }

  /** Engine memory for /metrics and `tinker-broker agents`; a failure to read it is not an error of the agent. */
  private async publishStats(): Promise<void> {
    if (!this.registered || this.stopping) return;
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

  /** Counts one finished training op in the metrics (and its tokens when it succeeded), written with the others of its 100 ms. */
  private meter(job: TakenTrainJob, data: TrainJob | undefined, start: number, status: JobStatus, result?: unknown): void {
    const tokens = status === 'ok' && data ? tokensOf(data, result) : undefined;
    this.jobMetrics.add({ op: job.op, status, enqueuedAt: job.timestamp, startedAt: start, finishedAt: Date.now(), ...(tokens ? { tokens } : {}) });
  }

  private async startEngine(): Promise<void> {
    await this.adapter.start();
    this.served = [];
    for (const spec of this.config.models) this.served.push(await this.adapter.loadBase(spec));
  }

  /**
   * One heartbeat: refreshes the liveness key and the record. A reaped agent (it was silent past
   * its timeout) drops its models, which were reported unavailable, and registers again; an agent
   * whose id another process holds now stops.
   */
  private async beat(): Promise<'ok' | 'reaped' | 'taken' | 'error'> {
    if (this.stopping || !this.registered) return 'error';
    try {
      const r = await this.liveness.beat(this.record, this.incarnation);
      if (r === 'reaped') {
        const models = [...this.loaded];
        this.loaded.clear();
        this.log.warn('this agent was reaped (silent past its timeout): its models were reported unavailable and are dropped', { models });
        for (const m of models) await this.adapter.unloadModel(m).catch(() => undefined);
        await this.liveness.clearReaped(this.config.agentId, this.incarnation);
        return await this.liveness.beat(this.record, this.incarnation);
      }
      // The models loaded here are in use: their records never expire while this agent lives (queues/contract/names.ts),
      // at least five heartbeats ahead however short the retention.
      if (r === 'ok') await this.registry.models.keep(this.loaded, Math.max(this.config.retentionS, this.timeoutS));
      if (r === 'ok' && (await this.redis.getdel(this.names.agentDrainRequest(this.config.agentId))) !== null) {
        this.log.info('drain requested (tinker-broker drain)');
        void this.drain();
      }
      if (r === 'taken') {
        this.log.error('another process registered this agent id; stopping', { agentId: this.config.agentId });
        process.exitCode = 1;
        void this.stop();
      }
      return r;
    } catch (e) {
      this.log.warn('heartbeat failed', { error: String(e) });
      return 'error';
    }
  }

  private onEngineExit(exitReason: string): void {
    if (this.stopping) return;
    this.engineEpoch++;
    const reason = this.killReason ?? exitReason;
    this.killReason = null;
    this.log.error('engine process died', { reason });
    const models = [...this.loaded];
    this.loaded.clear();
    // Set synchronously, so a job taken from now on waits for the new engine.
    this.restarting = (async () => {
      try {
        await this.registry.models.markLostOnAgent(this.config.agentId, `${reason}; load it from a saved checkpoint`);
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
    const rec = await this.registry.models.get(modelId);
    const why = rec?.lost_reason ?? 'it is not loaded on this agent';
    throw new BrokerError('UNAVAILABLE', modelUnavailable(modelId, why));
  }

  /**
   * One training op, its outcome recorded exactly once (queues/runtime/outcomes.ts). The result lives in the
   * outcome record; BullMQ's job only says the op finished.
   *
   * The training queue's consumer holds one job ahead (concurrency 2): the next op is taken and
   * parsed while the current one runs, and waits here for the engine's turn, so the engine starts it
   * the moment the current op returns. It is claimed only when its turn comes (an op the reaper
   * failed before then is not run); one taken while the engine is free is claimed by the take
   * itself. Ops run in the order the queue gives them (the gate's seq_id order). One taken ahead
   * when the agent drains or stops goes back to the head of the queue, unstarted.
   */
  private async runTrain(job: TakenTrainJob): Promise<TrainVerdict> {
    const verdict = await this.trainVerdict(job);
    if (verdict.state === 'failed') {
      const d = job.data as { model_id?: string | null } | undefined;
      this.log.warn('job failed', { queue: this.trainQueue, jobId: job.id, op: job.op, modelId: d?.model_id ?? undefined, error: verdict.reason });
    }
    return verdict;
  }

  private async trainVerdict(job: TakenTrainJob): Promise<TrainVerdict> {
    const jobId = job.id;
    const op = job.op;
    // A job the gate in this process parsed and handed over is not parsed again.
    const parsed = job.parsed ? { success: true as const, data: job.data as TrainJob } : TrainJob.safeParse(job.data);
    const before = this.trainTurn;
    let started!: () => void;
    before.nextStarted = new Promise<void>((r) => (started = r));
    let endTurn!: () => void;
    this.trainAhead++;
    let turnEnded = false;
    const turn = new Promise<void>((resolve) => (endTurn = () => {
      if (!turnEnded) {
        turnEnded = true;
        this.trainAhead--;
      }
      resolve();
    }));
    const mine: { done: Promise<void>; nextStarted?: Promise<void> } = { done: turn };
    this.trainTurn = mine;
    // The engine is free: an op waiting on this one goes first (its claim's round trip, then its
    // engine call), then this one's outcome is answered and recorded, which would otherwise hold up
    // that round trip's reply in this process and keep the engine idle.
    const handOn = async () => {
      endTurn();
      if (mine.nextStarted) await mine.nextStarted;
    };
    try {
      await before.done;
      const token = job.token;
      if (this.draining || this.stopping) {
        // Taken ahead but not started: back to the head of the queue, for whoever runs the model next.
        if (job.claim && job.claim.prev === null) await this.outcomes.release(jobId, token);
        return { state: 'requeue' };
      }
      const prev = job.claim ? job.claim.prev : await this.outcomes.claim(jobId, op, this.config.agentId, token);
      if (prev) return await this.standing(jobId, op, prev);
      const start = Date.now();
      let epoch = -1;
      let result: unknown;
      let engine: [number, number];
      try {
        // An engine restarting takes seconds: the op before this one does not wait for it.
        if (this.restarting) started();
        await this.ensureEngine();
        epoch = this.engineEpoch;
        if (!parsed.success) throw parsed.error;
        const t0 = performance.timeOrigin + performance.now();
        const call = this.trainOp(parsed.data);
        // Once the promise jobs that carry the call to the engine have run.
        process.nextTick(started);
        result = await this.timed(op, call);
        engine = [t0, performance.timeOrigin + performance.now()];
      } catch (err) {
        await handOn();
        let f = this.failure(op, err);
        if (err instanceof OpTimeout || (epoch >= 0 && epoch !== this.engineEpoch))
          f = failure('OUTCOME_UNKNOWN', outcomeUnknownMessage(op, err instanceof OpTimeout ? err.message : `the engine process died while running it: ${f.message}`));
        const stood = await this.outcomes.finish(jobId, token, { state: 'failed', op, agent_id: this.config.agentId, ...f }, true);
        this.meter(job, parsed.data, start, f.category === 'user' ? 'user_error' : 'server_error');
        return await this.standing(jobId, op, stood);
      }
      await handOn();
      // Early: an API in this process answers the op's future from this result, then it is recorded,
      // and its job ended in its queue, in one script (queues/runtime/outcomes.ts).
      const stood = await this.outcomes.finish(jobId, token, { state: 'done', op, agent_id: this.config.agentId, result, engine }, true, job.end);
      // An op finished after the reaper gave up on this agent keeps the reaper's verdict in Redis (the 'job failed' line says so).
      if (stood.state === 'done') this.log.debug('job done', { queue: this.trainQueue, jobId, op, modelId: parsed.data?.model_id, ms: Date.now() - start });
      this.meter(job, parsed.data, start, stood.state === 'done' ? 'ok' : 'server_error', result);
      return await this.standing(jobId, op, stood);
    } finally {
      endTurn();
      started();
    }
  }

  /** Ends the BullMQ job as the recorded outcome says (which may be another's: the reaper's, an earlier run's). */
  private async standing(jobId: string, op: string, o: Outcome): Promise<TrainVerdict> {
    if (o.state === 'done') return { state: 'done' };
    if (o.state === 'running') {
      // Claimed by an earlier incarnation of this agent that died before finishing it.
      const why = `the agent process that was running it (${o.token.split('/')[0]}) ended before recording its outcome`;
      o = await this.liveness.failPending(jobId, op, this.config.agentId, why);
      if (o.state === 'done') return { state: 'done' };
    }
    return { state: 'failed', reason: encodeJobFailure(recordedFailure(o)) };
  }

  /** Rejects with OpTimeout and kills the engine (a hung engine) when the op runs past its limit. */
  private timed<T>(op: string, p: Promise<T>): Promise<T> {
    const limitS = this.config.opTimeoutsS?.[op] ?? DEFAULT_OP_TIMEOUTS_S[op] ?? 1800;
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        const why = `${op} ran past its time limit of ${limitS} s (TB_OP_TIMEOUTS); the agent killed its engine as hung`;
        this.log.error('op timed out; killing the engine', { op, limitS });
        this.killReason = why;
        this.adapter.kill?.();
        reject(new OpTimeout(why));
      }, limitS * 1000);
    });
    return Promise.race([p, timeout]).finally(() => clearTimeout(timer));
  }

  private async trainOp(data: TrainJob): Promise<unknown> {
    {
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
          return this.checkpoints.saveSampler(data);
        case 'save_weights':
          await this.requireLoaded(data.model_id);
          return this.checkpoints.saveState(data);
        case 'load_weights': {
          await this.requireLoaded(data.model_id);
          await requireCheckpointRecord(this.registry.checkpoints, data.tinker_path);
          await this.adapter.loadState(data.model_id, data.dir, data.optimizer);
          return { path: data.tinker_path, model_id: data.model_id };
        }
        case 'save_weights_external':
          await this.requireLoaded(data.model_id);
          return this.checkpoints.saveExternal(data);
        case 'unload_model':
          if (this.loaded.has(data.model_id)) await this.adapter.unloadModel(data.model_id);
          this.loaded.delete(data.model_id);
          await this.registry.models.markLost(data.model_id, 'it was unloaded (unload_model)');
          return { model_id: data.model_id };
      }
    }
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
        return this.timed('sample', this.adapter.sampleBatch!(jobs));
      },
    });
  }

  /**
   * A sample job's end, once BullMQ recorded it: its metrics and its completion signal (with the
   * result or failure when small, so the waiting retrieve_future answers without reading it) in one
   * transaction, one round trip.
   */
  private sampleEnded(job: Job<SampleJob, SampleResult>, end: SampleEnd): void {
    const status: JobStatus = end.state === 'done' ? 'ok' : end.category === 'user' ? 'user_error' : 'server_error';
    const tokens = end.state === 'done' ? tokensOf(job.data, end.result) : undefined;
    const finishedAt = job.finishedOn ?? Date.now();
    const m = this.redis.multi();
    addJobs(m, this.names, [{ op: job.name, status, enqueuedAt: job.timestamp, startedAt: job.processedOn ?? finishedAt, finishedAt, ...(tokens ? { tokens } : {}) }]);
    const [channel, message] = sampleEndSignal(this.names, job.id!, this.config.agentId, end);
    m.publish(channel, message);
    m.exec().catch((e) => this.log.debug('sample end not signalled', { jobId: job.id, error: String(e) }));
    // BullMQ has recorded the end: waiters in this process (an API beside the agent) answer now.
    signalLocally(channel, message);
  }

  /** A sample has no effect on any model: a failure (a timeout included) is a plain server error the client may retry. */
  private async runSample(job: Job<SampleJob, SampleResult>): Promise<SampleResult> {
    const start = Date.now();
    try {
      await this.ensureEngine();
      const data = SampleJob.parse(job.data);
      const gatherer = this.gatherers.get(data.base_model);
      const r = keepLastPromptLogprobs(gatherer ? await gatherer.submit(data) : await this.timed('sample', this.adapter.sample(data)), data.prompt_logprobs_last_n ?? null);
      if (data.record_stability) await writeStabilityRecords(this.redis, this.names, data.record_stability, data.prompt, r.sequences);
      this.log.debug('job done', { queue: job.queueName, jobId: job.id, op: job.name, samplingSession: data.sampling_session_id, baseModel: data.base_model, ms: Date.now() - start });
      return r;
    } catch (err) {
      throw new UnrecoverableError(encodeJobFailure(this.failure(job.name, err)));
    }
  }

  /** What a failed op reports: a broker (or engine) error's code, else INTERNAL. */
  private failure(op: string, err: unknown): Failure {
    if (err instanceof ZodError) return failure('INTERNAL', `invalid ${op} job payload: ${err.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`);
    return failureOf(err);
  }

  /**
   * The graceful stop (SIGTERM, `tinker-broker drain`): takes no new work, lets the ops in flight
   * finish (however long: the operator's stop grace bounds it), saves every model with its AdamW
   * state and accumulated gradients, records them for the next start of this agent id, and stops.
   * Ops still queued stay queued: the restarted agent runs them on the reloaded models, and the
   * reaper leaves the agent's futures pending while the drain record lasts (TB_DRAIN_KEEP_S).
   */
  drain(): Promise<void> {
    this.draining ??= (async () => {
      if (this.stopping || !this.registered) return this.stop();
      const t0 = Date.now();
      this.log.info('draining: finishing the ops in flight');
      await Promise.all([this.train?.close(), ...this.workers.map((w) => w.close())]);
      await this.ensureEngine();
      const saved: { model_id: string; dir: string }[] = [];
      if (this.adapter.kind === 'torch') {
        for (const m of this.loaded) {
          const dir = path.join(this.config.storageDir, 'drain', this.config.agentId, `${m}-${Date.now()}`);
          try {
            await this.adapter.saveState(m, dir, true, true);
            saved.push({ model_id: m, dir });
          } catch (e) {
            this.log.error('could not save a model while draining; it will be unavailable', { model: m, error: String(e) });
          }
        }
      }
      const keepS = this.config.drainKeepS ?? 3_600;
      // No heartbeat keeps the saved models' records while the agent is away: they outlast the drain record.
      await this.registry.models.keep(saved.map((s) => s.model_id), keepS + this.config.retentionS);
      await this.redis.set(this.names.agentDrained(this.config.agentId), JSON.stringify({ models: saved, at: new Date().toISOString(), incarnation: this.incarnation }), 'EX', keepS);
      this.log.info('drained', { models: saved.map((s) => s.model_id), ms: Date.now() - t0 });
      await this.stop();
    })();
    return this.draining;
  }

  async stop(): Promise<void> {
    if (this.stopping) return;
    this.stopping = true;
    clearInterval(this.heartbeat);
    await Promise.all([this.train?.close(), ...this.workers.map((w) => w.close())]);
    await this.jobMetrics?.flush();
    await Promise.all(this.sampleQueues.map((q) => q.close().catch(() => undefined)));
    await this.liveness?.release(this.config.agentId, this.incarnation).catch(() => undefined);
    if (this.redis) await removeAgentStats(this.redis, this.names, this.config.agentId).catch(() => undefined);
    await this.adapter.stop().catch(() => undefined);
    await this.redis?.quit().catch(() => undefined);
    this.log.info('agent stopped');
    this.resolveStopped();
  }
}

/** An error that says the Redis connection is down (refused, reset, closed, timed out), not a fault of a command. */
function isConnectionError(err: Error): boolean {
  const code = (err as NodeJS.ErrnoException).code ?? '';
  return ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH', 'EAI_AGAIN'].includes(code) || /Connection is closed|connect ECONNREFUSED|Socket closed unexpectedly|getaddrinfo/.test(err.message);
}

/** The torch engine process's environment: the configured CPU threads (TB_ENGINE_THREADS) as its OMP_NUM_THREADS. */
function torchEnv(config: AgentConfig): { env?: NodeJS.ProcessEnv } {
  return config.engineThreads === undefined ? {} : { env: { OMP_NUM_THREADS: String(config.engineThreads) } };
}

/** Sampled tokens (generated sequences) and trained tokens (forward_backward inputs, not forward-only) of a job that succeeded. */
function tokensOf(d: AnyJob, result: unknown): { kind: TokenKind; n: number } | undefined {
  if (d.op === 'forward_backward' && !d.forward_only) return { kind: 'trained', n: d.data.reduce((s, x) => s + x.tokens.length, 0) };
  const seqs = (result as { sequences?: { tokens: unknown[] }[] } | null)?.sequences;
  if (d.op === 'sample' && Array.isArray(seqs)) return { kind: 'sampled', n: seqs.reduce((s, x) => s + x.tokens.length, 0) };
  return undefined;
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
