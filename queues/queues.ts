import { Job, Queue, type JobsOptions } from 'bullmq';
import type { Redis } from 'ioredis';
import type { AnyJob } from './schemas.js';
import type { Names } from './names.js';

/** A job as a future sees it: its op, and its end once it has one. */
export type JobView = {
  op: string;
  seqId: number;
  finished: boolean;
  failedReason: string | null;
  returnvalue: unknown;
};

/**
 * Producer-side queues, created on first use and shared by one process. This file and the Lua
 * library queues/lua/bullmq-job.lua are the only places that know BullMQ's own job layout. Jobs are never
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

  /** Adds a job under a deterministic id; a repeated id is ignored by BullMQ (idempotent). */
  async add(queue: string, jobId: string, job: AnyJob): Promise<void> {
    await this.get(queue).add(job.op, job, { jobId });
  }

  async close(): Promise<void> {
    await Promise.all([...this.queues.values()].map((q) => q.close()));
    this.queues.clear();
  }
}
