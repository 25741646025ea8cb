import { Queue, UnrecoverableError, Worker, type Job } from 'bullmq';
import type { Redis } from 'ioredis';
import { SAMPLE_GATHER_DEFAULTS, type AgentConfig, type SampleFeature } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import { decodeJobFailure, encodeJobFailure } from '../../queues/contract/errors.js';
import type { Names } from '../../queues/contract/names.js';
import { SampleJob, type SampleResult } from '../../queues/contract/schemas.js';
import { sampleEndSignal, signalLocally, type SampleEnd } from '../../queues/runtime/completions.js';
import { addSampleEnd } from '../../queues/runtime/session-futures.js';
import { addJobs, type JobStatus } from '../../queues/runtime/metrics.js';
import { writeStabilityRecords } from '../../queues/runtime/stability.js';
import type { ServedModel } from '../../queues/registry/agents.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import type { EngineCapabilities } from '../adapters/registry.js';
import { EngineError } from '../engine.js';
import { SampleGatherer } from '../sample-gather.js';
import type { EngineSupervisor } from './engine.js';
import { opFailure, tokensOf } from './ops.js';
import { SampleShare } from './sample-share.js';

/**
 * The sample workers of one agent: a BullMQ Worker per base model it serves, on that model's sample
 * queue of its engine kind (the API routes each job), running jobs concurrently; with an engine that
 * samples in batches, a gatherer per model that sends the jobs held as one batch. Agents serving the
 * same queue share its jobs by load (sample-share.ts): each takes at most its fair share of the work,
 * and each worker is named by its agent id (BullMQ records it on every job it takes, `processedBy`).
 * A sample has no effect on any model: a failure is a plain error the client may retry.
 */

export type SampleWorkersOptions = {
  config: Pick<AgentConfig, 'agentId' | 'sampleConcurrency' | 'sampleGatherMs' | 'sampleHoldMs' | 'sampleBatchTokens' | 'retentionS'>;
  log: Logger;
  names: Names;
  redis: Redis;
  adapter: EngineAdapter;
  capabilities: Pick<EngineCapabilities, 'samples' | 'sampleBatch'>;
  /** Every sample-request feature the agent's engine cannot answer (its engine's and its device's). */
  lacks: readonly SampleFeature[];
  engine: EngineSupervisor;
};

export class SampleWorkers {
  readonly workers: Worker[] = [];
  /** Per served base model: its sample gatherer (engines that sample in batches: the jobs held are sent as one batch). */
  private readonly gatherers = new Map<string, SampleGatherer>();
  private readonly queues: Queue[] = [];
  /** Per sample queue: this agent's share of its jobs (sample-share.ts). */
  private readonly shares = new Map<string, SampleShare>();

  constructor(private readonly o: SampleWorkersOptions) {}

  /**
   * Starts a worker per served model (none for an engine that does not sample: its jobs wait for
   * agents that do) and its gatherer; resolves when every worker is ready. `common`: the workers'
   * connection and lock settings; `onError`: their errors.
   */
  async start(served: ServedModel[], common: { connection: Redis; prefix: string; maxStalledCount: number; lockDuration: number }, onError: (source: string, err: Error) => void): Promise<void> {
    const { names, adapter, capabilities, config, log } = this.o;
    this.workers.push(
      ...(capabilities.samples ? served : []).map((m) => {
        const w = new Worker<SampleJob, SampleResult>(names.sampleQueue(m.name, adapter.kind), (job) => this.run(job), {
          ...common,
          name: config.agentId,
          concurrency: config.sampleConcurrency,
        });
        this.shares.set(w.name, new SampleShare({ redis: this.o.redis, key: names.sampleShare(w.name), agentId: config.agentId, concurrency: config.sampleConcurrency, worker: w, log }));
        // Once BullMQ has recorded the job's end: its metrics and its completion signal.
        w.on('completed', (job, result) => this.ended(job, { state: 'done', result }));
        w.on('failed', (job, err) => {
          if (!job) return;
          const { verdict: _verdict, ...f } = decodeJobFailure(err.message);
          this.ended(job, { state: 'failed', ...f });
        });
        return w;
      }),
    );
    if (capabilities.samples && capabilities.sampleBatch) for (const m of served) this.gatherers.set(m.name, this.gatherer(m.name));
    for (const w of this.workers) {
      w.on('error', (err) => onError(w.name, err));
      w.on('failed', (job, err) => {
        const d = job?.data as { model_id?: string | null; sampling_session_id?: string | null } | undefined;
        log.warn('job failed', { queue: w.name, jobId: job?.id, op: job?.name, modelId: d?.model_id ?? undefined, samplingSession: d?.sampling_session_id ?? undefined, error: err.message });
      });
      await w.waitUntilReady();
    }
    await Promise.all([...this.shares.values()].map((s) => s.start()));
  }

  /** Takes no more jobs; those running finish. */
  async close(): Promise<void> {
    // The other agents take the waiting jobs from now on.
    await Promise.all([...this.shares.values()].map((s) => s.close()));
    await Promise.all(this.workers.map((w) => w.close()));
    // The ends recorded last go now, before the agent closes its connection.
    if (this.endsToSend.length) this.sendEnds();
  }

  /** Closes the gatherers' queue handles (after close). */
  async closeQueues(): Promise<void> {
    await Promise.all(this.queues.map((q) => q.close().catch(() => undefined)));
  }

  private gatherer(base: string): SampleGatherer {
    const { names, adapter, redis, config, engine } = this.o;
    const queue = new Queue(names.sampleQueue(base, adapter.kind), { connection: redis, prefix: names.bull });
    this.queues.push(queue);
    const share = this.shares.get(queue.name);
    const windowMs = config.sampleGatherMs ?? SAMPLE_GATHER_DEFAULTS.gatherMs;
    return new SampleGatherer({
      windowMs,
      maxWaitMs: windowMs * 5,
      holdMs: config.sampleHoldMs ?? SAMPLE_GATHER_DEFAULTS.holdMs,
      tokenBudget: config.sampleBatchTokens ?? SAMPLE_GATHER_DEFAULTS.batchTokens,
      // Only the waiting jobs this agent may still take under its share.
      waiting: async () => Math.min(await queue.getWaitingCount(), share ? share.room() : Infinity),
      run: async (jobs) => {
        await engine.ensure();
        return engine.timed('sample', adapter.sampleBatch!(jobs));
      },
    });
  }

  /** Sample ends recorded by BullMQ in this turn of the event loop, sent together (`ended`). */
  private endsToSend: { job: Job<SampleJob, SampleResult>; end: SampleEnd; channel: string; message: string }[] = [];

  /**
   * A sample job's end, once BullMQ recorded it: its metrics, its entry in its sampling session's
   * log (queues/runtime/session-futures.ts, for the SDK's retrieve_futures poller) and its completion
   * signal (with the result or failure when small, so the waiting retrieve_future answers without
   * reading it). The ends of one engine batch are recorded by BullMQ together; those that come in
   * one turn of the event loop go in one transaction, one round trip (`sendEnds`).
   */
  private ended(job: Job<SampleJob, SampleResult>, end: SampleEnd): void {
    const [channel, message] = sampleEndSignal(this.o.names, job.id!, this.o.config.agentId, end);
    if (this.endsToSend.push({ job, end, channel, message }) === 1) setImmediate(() => this.sendEnds());
    // BullMQ has recorded the end: waiters in this process (an API beside the agent) answer now.
    signalLocally(channel, message);
  }

  private sendEnds(): void {
    const { redis, names, config, log } = this.o;
    const ends = this.endsToSend;
    if (!ends.length) return;
    this.endsToSend = [];
    const m = redis.multi();
    addJobs(
      m,
      names,
      ends.map(({ job, end }) => {
        const tokens = end.state === 'done' ? tokensOf(job.data, end.result) : undefined;
        const finishedAt = job.finishedOn ?? Date.now();
        const status: JobStatus = end.state === 'done' ? 'ok' : end.category === 'user' ? 'user_error' : 'server_error';
        return { op: job.name, status, enqueuedAt: job.timestamp, startedAt: job.processedOn ?? finishedAt, finishedAt, ...(tokens ? { tokens } : {}) };
      }),
    );
    for (const { job, end, channel, message } of ends) {
      addSampleEnd(m, names, { id: job.id!, queue: job.queueName, sampling_session_id: job.data.sampling_session_id, seq_id: job.data.seq_id }, end, config.retentionS);
      m.publish(channel, message);
    }
    m.exec().catch((e) => log.debug('sample ends not signalled', { jobIds: ends.map((e) => e.job.id), error: String(e) }));
  }

  /** A sample has no effect on any model: a failure (a timeout included) is a plain server error the client may retry. */
  private async run(job: Job<SampleJob, SampleResult>): Promise<SampleResult> {
    const { engine, adapter, redis, names, log } = this.o;
    const start = Date.now();
    const share = this.shares.get(job.queueName);
    share?.started();
    try {
      await engine.ensure();
      const data = SampleJob.parse(job.data);
      this.refuseLacking(data);
      const gatherer = this.gatherers.get(data.base_model);
      const r = keepLastPromptLogprobs(gatherer ? await gatherer.submit(data) : await engine.timed('sample', adapter.sample(data)), data.prompt_logprobs_last_n ?? null);
      if (data.record_stability) await writeStabilityRecords(redis, names, data.record_stability, data.prompt, r.sequences);
      log.debug('job done', { queue: job.queueName, jobId: job.id, op: job.name, samplingSession: data.sampling_session_id, baseModel: data.base_model, ms: Date.now() - start });
      return r;
    } catch (err) {
      throw new UnrecoverableError(encodeJobFailure(opFailure(job.name, err)));
    } finally {
      share?.ended();
    }
  }

  /**
   * A job using a feature this engine lacks came here because no agent that answers it serves the
   * model (queues/registry/agents.ts sampleEngine): a user error that says so.
   */
  private refuseLacking(job: SampleJob): void {
    const f = jobFeatures(job).find((x) => this.o.lacks.includes(x));
    if (f)
      throw new EngineError('user', `${f} is not supported by the ${this.o.adapter.kind} engine, and no agent whose engine supports it serves ${job.base_model} with this sampler version; start one to use it`);
  }
}

/** The sample-request features a job uses that its fields show (lm_head_prompt_logprobs depends on the sampler version's files: the engine checks it). */
export function jobFeatures(job: SampleJob): SampleFeature[] {
  const out: SampleFeature[] = [];
  if (job.prompt_alt_tokens_k) out.push('prompt_alt_tokens_k');
  if (job.target_prompt_logprobs) out.push('target_prompt_logprobs');
  return out;
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
