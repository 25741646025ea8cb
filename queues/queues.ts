import { Queue, type JobsOptions } from 'bullmq';
import type { Redis } from 'ioredis';
import type { AnyJob } from './schemas.js';
import type { Names } from './names.js';

/**
 * Producer-side queues, created on first use and shared by one process. Jobs are never
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

  /** Adds a job under a deterministic id; a repeated id is ignored by BullMQ (idempotent). */
  async add(queue: string, jobId: string, job: AnyJob): Promise<void> {
    await this.get(queue).add(job.op, job, { jobId });
  }

  async close(): Promise<void> {
    await Promise.all([...this.queues.values()].map((q) => q.close()));
    this.queues.clear();
  }
}
