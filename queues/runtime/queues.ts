import { Job, Queue, type JobsOptions } from 'bullmq';
import type { Redis } from 'ioredis';
import type { AnyJob, SampleJob, SampleResult, TrainJob } from '../contract/schemas.js';
import type { Names } from '../contract/names.js';
import { scripts } from './scripts.js';

/** A job as a future sees it: its op, and its end once it has one. */
export type JobView = {
  op: string;
  seqId: number;
  finished: boolean;
  failedReason: string | null;
  returnvalue: unknown;
};

/** How a sample request was admitted (QueueSet.submitSample). */
export type SampleAdmission = 'queued' | 'replay' | 'full' | 'conflict';

/** A sample's future as its owner reads it (QueueSet.sampleFuture). */
export type SampleFutureView = { kind: 'not-owner' } | { kind: 'no-job'; failedFuture: string | null } | ({ kind: 'job' } & Omit<JobView, 'seqId'>);

/**
 * The two queue families, typed at both ends (producers here, the agent's workers): a training
 * queue (`train-<agentId>`) carries TrainJobs and its jobs return nothing (an op's result is its
 * outcome record, queues/runtime/outcomes.ts); a sample queue carries SampleJobs and returns SampleResults.
 */
export type TrainQueue = Queue<TrainJob, null>;
export type SampleQueue = Queue<SampleJob, SampleResult>;

/**
 * Producer-side queues, created on first use and shared by one process. This file, the training
 * queue's consumer (queues/runtime/train-consumer.ts) and the Lua scripts they and the gate run
 * (queues/runtime/lua/bullmq-job.lua, sample-submit.lua, future-sample.lua, future-train.lua,
 * train-take.lua) are the only places that know BullMQ's own job layout. Jobs are never
 * retried automatically (`attempts: 1`): a training op run twice doubles a gradient.
 * Finished jobs are kept for the future retention, since their state *is* the future.
 */
export class QueueSet {
  private readonly queues = new Map<string, Queue<AnyJob>>();

  constructor(
    private readonly connection: Redis,
    private readonly names: Names,
    private readonly retentionS: number,
  ) {}

  get(name: string): Queue<AnyJob> {
    let q = this.queues.get(name);
    if (!q) {
      q = new Queue<AnyJob>(name, {
        connection: this.connection,
        prefix: this.names.bull,
        defaultJobOptions: this.jobOptions(),
      });
      // Connection errors surface on the commands that fail; the process's connection logs them.
      q.on('error', () => undefined);
      this.queues.set(name, q);
    }
    return q;
  }

  jobOptions(): JobsOptions {
    return {
      attempts: 1,
      removeOnComplete: { age: this.retentionS },
      removeOnFail: { age: this.retentionS },
    };
  }

  /** The job options as BullMQ stores them in a job hash (for jobs the gate's script writes). */
  storedJobOptions(): string {
    return (this.storedOpts ??= JSON.stringify(this.jobOptions()));
  }
  private storedOpts: string | undefined;

  /** The job's state, or null when Redis holds no such job. */
  async view(queue: string, jobId: string): Promise<JobView | null> {
    const job = (await Job.fromId(this.get(queue), jobId)) as Job<AnyJob> | undefined;
    if (!job) return null;
    return {
      op: job.data.op,
      seqId: (job.data as { seq_id?: number }).seq_id ?? 0,
      finished: !!job.finishedOn,
      failedReason: job.failedReason || null,
      returnvalue: job.returnvalue ?? null,
    };
  }

  /** Whether Redis holds the job (held, queued, running or finished). */
  async exists(queue: string, jobId: string): Promise<boolean> {
    return (await this.connection.exists(this.jobKey(queue, jobId))) === 1;
  }

  /** The job's key (its payload and state), for scripts that expire it with the records beside it. */
  jobKey(queue: string, jobId: string): string {
    return `${this.names.bull}:${queue}:${jobId}`;
  }

  /** Adds a training job under a deterministic id; a repeated id is ignored by BullMQ (idempotent). */
  async addTrain(queue: string, jobId: string, job: TrainJob): Promise<void> {
    await (this.get(queue) as unknown as TrainQueue).add(job.op, job, { jobId });
  }

  /**
   * Admits a sample request in one round trip (queues/runtime/lua/sample-submit.lua): queues its job under
   * `jobId` unless `maxWaiting` jobs wait already ('full'), records the future's owner and restarts
   * the sampling session's lifetime. A job of that id with the same payload is the same request
   * ('replay': the same future); with another payload it is refused ('conflict'). Nothing is
   * written for 'full' or 'conflict'.
   */
  async submitSample(
    queue: string,
    jobId: string,
    job: SampleJob,
    o: { maxWaiting: number; ownerKey: string; tenant: string; ownerTtlS: number; session: { key: string; ttlS: number } | null },
  ): Promise<SampleAdmission> {
    const q = `${this.names.bull}:${queue}:`;
    const r = await scripts.sampleSubmit.run(this.connection, {
      keys: { job: this.jobKey(queue, jobId), wait: `${q}wait`, owner: o.ownerKey, session: o.session?.key ?? o.ownerKey },
      args: {
        queuePrefix: q,
        jobId,
        jobName: job.op,
        jobData: JSON.stringify(job),
        jobOpts: this.storedJobOptions(),
        timestamp: Date.now(),
        maxWaiting: o.maxWaiting,
        tenant: o.tenant,
        sessionTtlS: o.session ? o.session.ttlS : '',
        ownerTtlS: o.ownerTtlS,
      },
    });
    const codes = scripts.sampleSubmit.codes;
    return r === codes.queued ? 'queued' : r === codes.replay ? 'replay' : r === codes.full ? 'full' : 'conflict';
  }

  /**
   * A sample's future for `tenant`, in one round trip (queues/runtime/lua/future-sample.lua): another
   * tenant's reads as 'not-owner'; a finished job, once read, leaves Redis `ttlAfterReadMs` later
   * with its owner record (`ownerKey`).
   */
  async sampleFuture(queue: string, jobId: string, ownerKey: string, failedKey: string, tenant: string, ttlAfterReadMs: number): Promise<SampleFutureView> {
    const r = await scripts.futureSample.run(this.connection, {
      keys: { owner: ownerKey, job: this.jobKey(queue, jobId), failed: failedKey },
      args: { tenant, readTtlMs: ttlAfterReadMs },
    });
    if (r === scripts.futureSample.codes.notOwner) return { kind: 'not-owner' };
    const [name, finishedOn, failedReason, returnvalue, failed] = r;
    if (!name) return { kind: 'no-job', failedFuture: failed ?? null };
    return { kind: 'job', op: name, finished: !!finishedOn, failedReason: failedReason || null, returnvalue: returnvalue ? JSON.parse(returnvalue) : null };
  }

  async close(): Promise<void> {
    await Promise.all([...this.queues.values()].map((q) => q.close()));
    this.queues.clear();
  }
}
