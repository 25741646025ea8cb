import { Job, QueueEvents } from 'bullmq';
import type { Redis } from 'ioredis';
import { decodeJobFailure, type ErrorCategory } from '../queues/errors.js';
import { decodeRequestId, type FutureRef } from '../queues/futures.js';
import type { OrderingGate } from '../queues/gate.js';
import type { Names } from '../queues/names.js';
import type { QueueSet } from '../queues/queues.js';
import type { AnyJob, JobOp } from '../queues/schemas.js';

/**
 * Futures are answered from BullMQ job state (the truth) plus one shared completion listener
 * per queue: a `retrieve_future` first registers a waiter, then checks the job, then sleeps
 * on the waiter for at most the long-poll window. No polling loop.
 */
export type FutureState =
  | { kind: 'done'; op: JobOp; result: unknown }
  | { kind: 'failed'; op: JobOp; category: ErrorCategory; message: string }
  | { kind: 'pending'; queueState: 'active' }
  | { kind: 'unknown' };

export class FutureResolver {
  private readonly events = new Map<string, Promise<QueueEvents>>();
  private readonly waiters = new Map<string, Set<() => void>>();

  constructor(
    private readonly blockingConnection: () => Redis,
    private readonly names: Names,
    private readonly queues: QueueSet,
    private readonly gate: OrderingGate,
  ) {}

  private key(ref: FutureRef): string {
    return `${ref.queue}/${ref.jobId}`;
  }

  private notify(queue: string, jobId: string): void {
    const set = this.waiters.get(`${queue}/${jobId}`);
    if (set) for (const wake of set) wake();
  }

  /** The shared listener of one queue, created on first use. */
  private listen(queue: string): Promise<QueueEvents> {
    let p = this.events.get(queue);
    if (!p) {
      p = (async () => {
        const qe = new QueueEvents(queue, { connection: this.blockingConnection(), prefix: this.names.bull });
        qe.on('completed', ({ jobId }) => this.notify(queue, jobId));
        qe.on('failed', ({ jobId }) => this.notify(queue, jobId));
        await qe.waitUntilReady();
        return qe;
      })();
      this.events.set(queue, p);
    }
    return p;
  }

  async state(ref: FutureRef): Promise<FutureState> {
    const job = (await Job.fromId(this.queues.get(ref.queue), ref.jobId)) as Job<AnyJob> | undefined;
    if (!job) return (await this.gate.isHeld(ref.jobId)) ? { kind: 'pending', queueState: 'active' } : { kind: 'unknown' };
    const op = job.data.op;
    if (job.finishedOn) {
      if (job.failedReason !== undefined && job.failedReason !== null && job.returnvalue === null) {
        const f = decodeJobFailure(job.failedReason);
        return { kind: 'failed', op, ...f };
      }
      return { kind: 'done', op, result: job.returnvalue };
    }
    // A job whose lock expired with maxStalledCount 0 carries a deferred failure until a worker touches it.
    if (job.deferredFailure) return { kind: 'failed', op, category: 'server', message: job.deferredFailure };
    return { kind: 'pending', queueState: 'active' };
  }

  /** The future's state, waiting up to `timeoutMs` for it to finish; `signal` ends the wait early. */
  async retrieve(requestId: string, timeoutMs: number, signal?: AbortSignal): Promise<FutureState> {
    const ref = decodeRequestId(requestId);
    if (!ref) return { kind: 'unknown' };
    await this.listen(ref.queue);
    const key = this.key(ref);
    let wake!: () => void;
    const woken = new Promise<void>((resolve) => (wake = resolve));
    const set = this.waiters.get(key) ?? new Set();
    set.add(wake);
    this.waiters.set(key, set);
    try {
      const first = await this.state(ref);
      if (first.kind !== 'pending') return first;
      let timer: NodeJS.Timeout | undefined;
      const timeout = new Promise<void>((resolve) => (timer = setTimeout(resolve, timeoutMs)));
      const aborted = new Promise<void>((resolve) => signal?.addEventListener('abort', () => resolve(), { once: true }));
      await Promise.race([woken, timeout, aborted]);
      clearTimeout(timer);
      return await this.state(ref);
    } finally {
      set.delete(wake);
      if (set.size === 0) this.waiters.delete(key);
    }
  }

  async close(): Promise<void> {
    const all = await Promise.allSettled([...this.events.values()]);
    await Promise.all(all.map((r) => (r.status === 'fulfilled' ? r.value.close() : undefined)));
    this.events.clear();
  }
}
