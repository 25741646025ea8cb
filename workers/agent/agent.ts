import { randomUUID } from 'node:crypto';
import os from 'node:os';
import type { Redis } from 'ioredis';
import type { AgentConfig } from '../../queues/infra/config.js';
import { logger as rootLogger, type Logger } from '../../queues/infra/logger.js';
import { Names } from '../../queues/contract/names.js';
import { connect } from '../../queues/infra/redis.js';
import { Liveness } from '../../queues/runtime/liveness.js';
import { JobRecorder } from '../../queues/runtime/metrics.js';
import { Outcomes } from '../../queues/runtime/outcomes.js';
import type { TrainConsumer } from '../../queues/runtime/train-consumer.js';
import { Registry } from '../../queues/registry/index.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import { createAdapter, engineOf, recordCapabilities, type EngineCapabilities } from '../adapters/index.js';
import { CheckpointJobs } from '../checkpoint-jobs.js';
import { rebuildCheckpoints } from '../rebuild.js';
import { AgentSnapshots } from '../snapshots.js';
import { Adoption } from './adoption.js';
import { restoreDrained, saveDrained, type DrainStateOptions } from './drain.js';
import { GpuTurns, takingTurns } from '../gpu-turns.js';
import { EngineSupervisor } from './engine.js';
import { Registration } from './registration.js';
import { SampleWorkers } from './samples.js';
import { TrainingPipeline } from './training.js';

/**
 * A worker agent: registers in Redis, supervises its engine, and consumes
 * - its training queue (`train-<agentId>`, taken by queues/runtime/train-consumer.ts): the ordered ops of
 *   the models placed here, one at a time, never retried. Each op's outcome is recorded apart from
 *   BullMQ's job state (queues/runtime/outcomes.ts): claimed before it runs, finished once; no stalled-job
 *   check runs on this queue, so a lost job lock (a long Redis outage) never turns a completed op
 *   into a failure;
 * - the sample queue of each base model it serves on its engine kind (the API routes each job), concurrently.
 * docs/reliability.md has the guarantees. This class wires the parts, each in its own file:
 * registration.ts (record, heartbeat, id claim), engine.ts (engine start, restart, op time limits),
 * training.ts and train-ops.ts (the ordered training pipeline), samples.ts (sample workers), drain.ts
 * (drain and restore), adoption.ts (the models of dead agents taken in), and ../gpu-turns.ts (the
 * engine's GPU work run in turns with the other agents on its GPU, when the preset says take_turns).
 */
export class Agent {
  readonly names: Names;
  readonly log: Logger;
  /** This process start; the liveness key and outcome claims carry it. */
  readonly incarnation = randomUUID();
  private readonly adapter: EngineAdapter;
  /** GPU turns with the other agents on its GPU (config.gpuTurns, workers/gpu-turns.ts); the adapter runs its GPU work inside them. */
  private readonly turns: GpuTurns | undefined;
  /** What the adapter's engine does (its registration, workers/adapters/registry.ts). */
  private readonly capabilities: EngineCapabilities;
  private redis!: Redis;
  private engine!: EngineSupervisor;
  private registration: Registration | undefined;
  private training: TrainingPipeline | undefined;
  private train: TrainConsumer | null = null;
  private samples: SampleWorkers | undefined;
  private adoption: Adoption | undefined;
  /** Whether the agent snapshots its models (workers/snapshots.ts AgentSnapshots.enabled). */
  private snapshotsOn = false;
  private drainState!: DrainStateOptions;
  /** The training ops' metrics, written every 100 ms (queues/runtime/metrics.ts). */
  private jobMetrics!: JobRecorder;
  private stopping = false;
  private draining: Promise<void> | null = null;
  /** Redis is unreachable: its errors are logged once per outage (redisError). */
  private redisDown = false;
  private resolveStopped!: () => void;
  /** Resolves when the agent has stopped (a drain asked through Redis ends the process's agent too). */
  readonly stopped = new Promise<void>((r) => (this.resolveStopped = r));

  constructor(
    readonly config: AgentConfig,
    adapter?: EngineAdapter,
  ) {
    this.names = new Names(config.prefix);
    this.log = rootLogger.child({ agentId: config.agentId });
    const own = adapter ?? Agent.adapterFor(config, this.log);
    if (config.gpuTurns) {
      this.turns = new GpuTurns({ names: this.names, gpu: config.gpuTurns.gpu, agentId: config.agentId, log: this.log, maxTurnMs: config.gpuTurns.maxTurnMs });
      this.adapter = takingTurns(own, this.turns);
    } else this.adapter = own;
    this.capabilities = engineOf(this.adapter.kind).capabilities;
    if (this.capabilities.sampleBatch && !this.adapter.sampleBatch) throw new Error(`engine '${this.adapter.kind}' registers sampleBatch, but its adapter has no sampleBatch method`);
  }

  /** The engine adapter of the agent's models, built by the registration of its engine (`config.engine`, else the default). */
  static adapterFor(config: AgentConfig, log: Logger): EngineAdapter {
    return createAdapter(config, log);
  }

  get trainQueue(): string {
    return this.names.trainQueue(this.config.agentId);
  }

  get timeoutS(): number {
    return this.config.agentTimeoutS ?? 30;
  }

  async start(): Promise<void> {
    const { config, adapter, capabilities, log } = this;
    // Reconnect within a second of Redis coming back, well inside the reaper's grace.
    const redis = (this.redis = connect(config.redisUrl, 'blocking', { retryStrategy: (n) => Math.min(n * 50, 1_000) }));
    redis.on('error', (err) => this.redisError('agent', err));
    this.turns?.attach(redis);
    redis.on('ready', () => {
      if (!this.redisDown) return;
      this.redisDown = false;
      log.info('redis reachable again');
    });
    const registry = new Registry(redis, this.names);
    const checkpoints = new CheckpointJobs(registry, adapter, config.retentionS);
    const outcomes = new Outcomes(redis, this.names, config.retentionS);
    this.jobMetrics = new JobRecorder(redis, this.names, (e) => log.debug('metrics not recorded', { error: String(e) }));
    const liveness = new Liveness(redis, this.names, registry.models, outcomes);
    const stop = () => void this.stop();
    const snapshots = new AgentSnapshots({ policy: config.snapshots, storageDir: config.storageDir, adapter, redis, names: this.names, outcomes, models: registry.models, log });
    this.snapshotsOn = snapshots.enabled;
    const recover = (ids: string[], why: string) => snapshots.bringBack(ids, why);
    const engine = (this.engine = new EngineSupervisor({ config, log, adapter, capabilities, models: registry.models, stopping: () => this.stopping, stop, recover }));
    const published = recordCapabilities(capabilities, adapter.sampleLacks);
    const base = { config, log, names: this.names, redis, registry, adapter, engine, incarnation: this.incarnation };
    const registration = (this.registration = new Registration({
      ...base,
      liveness,
      timeoutS: this.timeoutS,
      stopping: () => this.stopping,
      drain: () => void this.drain(),
      stop,
      afterBeat: () => this.afterBeat(),
      record: {
        agent_id: config.agentId,
        train_queue: this.trainQueue,
        models: [],
        engine: adapter.kind,
        device: adapter.device,
        started_at: new Date().toISOString(),
        incarnation: this.incarnation,
        timeout_s: this.timeoutS,
        host: os.hostname(),
        pid: process.pid,
        ...published,
      },
    }));
    this.drainState = { ...base, capabilities };
    // The id first: a second process with this id stops here, before it touches the first one's models or jobs.
    await registration.claim();
    await this.markRecovers();
    await engine.start();
    // A new engine holds no adapters: models placed on this agent id before come back from a drain's
    // save or from their snapshots (ops after the snapshot re-run); the others are lost.
    const restored = await restoreDrained(this.drainState);
    const earlier = (await registry.models.onAgent(config.agentId)).filter((m) => !restored.has(m.model_id)).map((m) => m.model_id);
    const recovered = await recover(earlier, 'its worker agent restarted');
    for (const m of recovered) engine.loaded.add(m);
    const lost = await registry.models.markLostOnAgent(config.agentId, 'its worker agent restarted; load it from a saved checkpoint', new Set([...restored, ...recovered]));
    if (lost.length) log.warn('models from a previous run of this agent are unavailable', { models: lost });
    await rebuildCheckpoints(registry, config.storageDir, log, config.retentionS).catch((e) => log.error('rebuilding checkpoint records failed', { error: String(e) }));

    const common = { connection: redis, prefix: this.names.bull, maxStalledCount: 0, lockDuration: config.jobLockMs ?? 30_000 };
    const halted = () => !!this.draining || this.stopping;
    this.training = new TrainingPipeline({ ...base, outcomes, liveness, checkpoints, snapshots, metrics: this.jobMetrics, queue: this.trainQueue, halted, fresh: () => registration.ensureFresh(), cobatchMax: config.cobatchMax, cobatchWaitMs: config.cobatchWaitMs });
    this.train = this.training.consumer(redis, this.names, outcomes, { lockMs: common.lockDuration, tokenPrefix: `${this.incarnation}/` });
    this.adoption = new Adoption({
      agentId: config.agentId,
      queue: this.trainQueue,
      redis,
      names: this.names,
      models: registry.models,
      outcomes,
      snapshots,
      engine,
      adapter,
      trains: capabilities.trains,
      halted,
      log,
    });
    this.samples = new SampleWorkers({ ...base, capabilities, lacks: published.sample_lacks });
    await this.samples.start(engine.served, common, (source, err) => this.redisError(source, err));
    await this.train.start();
    registration.serve(engine.served, adapter.device);
    if ((await registration.beat()) !== 'ok') throw new Error(`agent ${config.agentId} lost its registration while starting`);
    await registration.publishStats();
    log.info('agent ready', { trainQueue: this.trainQueue, models: engine.served.map((m) => m.name), device: adapter.device });
    void this.adoption.sweep();
  }

  /**
   * Whether this agent's models come back when it dies (it snapshots them): the recovers marker tells
   * the reaper to leave them for adoption, and the gate to admit their ops meanwhile (7 days, renewed every beat).
   */
  private async markRecovers(): Promise<void> {
    const key = this.names.agentRecovers(this.config.agentId);
    if (this.snapshotsOn) await this.redis.set(key, '1', 'EX', 7 * 86_400);
    else await this.redis.del(key);
  }

  /** After each heartbeat: the recovers marker renewed, and a look at the orphans to adopt. */
  private async afterBeat(): Promise<void> {
    try {
      await this.markRecovers();
    } catch (e) {
      this.log.debug('recovers marker not renewed', { error: String(e) });
    }
    await this.adoption?.sweep();
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

  /**
   * The graceful stop (SIGTERM, `tinker-broker drain`): takes no new work, lets the ops in flight
   * finish (however long: the operator's stop grace bounds it), saves every model with its AdamW
   * state and accumulated gradients, records them for the next start of this agent id, and stops.
   * Ops still queued stay queued: the restarted agent runs them on the reloaded models, and the
   * reaper leaves the agent's futures pending while the drain record lasts (TB_DRAIN_KEEP_S).
   */
  drain(): Promise<void> {
    this.draining ??= (async () => {
      if (this.stopping || !this.registration?.registered) return this.stop();
      const t0 = Date.now();
      this.log.info('draining: finishing the ops in flight');
      await Promise.all([this.train?.close(), this.samples?.close()]);
      await this.engine.ensure();
      const saved = await saveDrained(this.drainState);
      this.log.info('drained', { models: saved, ms: Date.now() - t0 });
      await this.stop();
    })();
    return this.draining;
  }

  async stop(): Promise<void> {
    if (this.stopping) return;
    this.stopping = true;
    this.registration?.stopBeating();
    await Promise.all([this.train?.close(), this.samples?.close()]);
    await this.jobMetrics?.flush();
    await this.samples?.closeQueues();
    await this.registration?.release();
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
