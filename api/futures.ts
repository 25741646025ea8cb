import { Job, QueueEvents } from 'bullmq';
import type { Redis } from 'ioredis';
import { decodeJobFailure, failure, outcomeUnknownMessage, recordedFailure, type Failure } from '../queues/errors.js';
import { decodeRequestId, encodeRequestId, type FutureRef } from '../queues/futures.js';
import type { OrderingGate } from '../queues/gate.js';
import { Liveness } from '../queues/liveness.js';
import { logger } from '../queues/logger.js';
import { Outcomes, type Outcome } from '../queues/outcomes.js';
import type { Names } from '../queues/names.js';
import type { QueueSet } from '../queues/queues.js';
import type { Registry } from '../queues/registry.js';
import type { AnyJob, JobOp } from '../queues/schemas.js';

/**
 * A training op's future is answered from its outcome record (queues/outcomes.ts), which the agent
 * writes once; a sample's from BullMQ's job state. A pending training op whose agent was reaped
 * (queues/liveness.ts) fails with OUTCOME_UNKNOWN. Every API process runs the reaper (`startReaper`).
 *
 * Futures are answered from BullMQ job state plus one shared completion listener
 * per queue: a `retrieve_future` reads the job; if it is pending, registers a waiter on the
 * queue's listener, reads again, and sleeps on the waiter for at most the long-poll window.
 * No polling loop. Listeners exist only for queues that hold a real pending job.
 */
export type FutureState =
  | { kind: 'done'; op: JobOp; result: unknown }
  | ({ kind: 'failed'; op: string } & Failure)
  | { kind: 'pending'; queueState: 'active'; heldModel?: string }
  | { kind: 'unknown' };

const QUEUE_NAME = /^(train|sample)-[A-Za-z0-9_.-]{1,128}$/;
/** The job ids the API issues (queues/names.ts jobIds); anything else (`events`, `meta`, `id`) names BullMQ's own keys. */
const JOB_ID = /^[ctuls]-[A-Za-z0-9-]{1,200}$/;

export class FutureResolver {
  private readonly events = new Map<string, Promise<QueueEvents>>();
  private readonly waiters = new Map<string, Set<() => void>>();
  readonly outcomes: Outcomes;
  readonly liveness: Liveness;

  constructor(
    private readonly redis: Redis,
    private readonly blockingConnection: () => Redis,
    private readonly names: Names,
    private readonly queues: QueueSet,
    private readonly gate: OrderingGate,
    private readonly registry: Registry,
    retentionS = 86_400,
    /** Seconds a finished training op's or sample's job (payload and result) stays once read. */
    private readonly ttlAfterReadS = 300,
  ) {
    this.outcomes = new Outcomes(redis, names, retentionS);
    this.liveness = new Liveness(redis, names, registry, this.outcomes);
  }

  /** Runs the liveness reaper every `everyMs`; returns its stop function. */
  startReaper(everyMs = 2_000): () => void {
    let running = false;
    const t = setInterval(() => {
      if (running) return;
      running = true;
      this.liveness.sweep(logger).finally(() => (running = false));
    }, everyMs);
    t.unref();
    return () => clearInterval(t);
  }

  private fromOutcome(o: Outcome): FutureState {
    if (o.state === 'done') return { kind: 'done', op: o.op as JobOp, result: o.result };
    return { kind: 'failed', op: o.op, ...recordedFailure(o) };
  }

  /**
   * A final outcome, read: the outcome record and the job (payload) of an ordered op then leave Redis
   * soon (create_model's stay for the retention: its job id makes it idempotent).
   */
  private async readOutcome(ref: FutureRef, o: Outcome): Promise<FutureState> {
    if (o.op !== 'create_model') {
      const ms = this.ttlAfterReadS * 1000;
      await this.redis
        .multi()
        .call('PEXPIRE', this.outcomes.key(ref.jobId), ms, 'LT')
        .call('PEXPIRE', `${this.names.bull}:${ref.queue}:${ref.jobId}`, ms, 'LT')
        .call('PEXPIRE', this.names.futureOwner(encodeRequestId(ref)), ms, 'LT')
        .exec();
    }
    return this.fromOutcome(o);
  }

  /** A pending training op whose agent was reaped fails (OUTCOME_UNKNOWN), unless its outcome is already final. */
  private async pendingTrain(ref: FutureRef, op: string): Promise<FutureState> {
    const agentId = ref.queue.slice('train-'.length);
    const why = await this.liveness.reapedWhy(agentId);
    if (why !== null) {
      return this.fromOutcome(await this.liveness.failPending(ref.jobId, op, agentId, why));
    }
    return { kind: 'pending', queueState: 'active' };
  }

  private notify(queue: string, jobId: string): void {
    const set = this.waiters.get(`${queue}/${jobId}`);
    if (set) for (const wake of set) wake();
  }

  /** The shared listener of one queue, created on first use; it reads from the stream's current end. */
  private listen(queue: string): Promise<QueueEvents> {
    let p = this.events.get(queue);
    if (!p) {
      p = (async () => {
        // Start at the last event already in the stream, not at '$': an event written between
        // "ready" and the first blocking read is then still delivered.
        const last = await this.redis.xrevrange(`${this.names.bull}:${queue}:events`, '+', '-', 'COUNT', 1);
        const qe = new QueueEvents(queue, {
          connection: this.blockingConnection(),
          prefix: this.names.bull,
          lastEventId: last[0]?.[0] ?? '0-0',
        });
        qe.on('completed', ({ jobId }) => this.notify(queue, jobId));
        qe.on('failed', ({ jobId }) => this.notify(queue, jobId));
        // Connection errors (Redis unreachable) are reported by the app's own connection watch.
        qe.on('error', () => undefined);
        await qe.waitUntilReady();
        return qe;
      })();
      this.events.set(queue, p);
      // A listener that failed to start is dropped, so the next poll tries again.
      p.catch(() => this.events.delete(queue));
    }
    return p;
  }

  async state(ref: FutureRef): Promise<FutureState> {
    if (!QUEUE_NAME.test(ref.queue) || !JOB_ID.test(ref.jobId)) return { kind: 'unknown' };
    const train = ref.queue.startsWith('train-');
    if (train) {
      const o = await this.outcomes.get(ref.jobId);
      if (o && o.state !== 'running') return this.readOutcome(ref, o);
    }
    const exists = (await this.redis.exists(`${this.names.bull}:${ref.queue}:${ref.jobId}`)) === 1;
    if (!exists) {
      const failed = await this.registry.getFailedFuture(ref.jobId);
      if (failed) return { kind: 'failed', op: failed.op, ...recordedFailure(failed) };
      const model = await this.gate.heldModel(ref.jobId);
      if (model === null) return { kind: 'unknown' };
      await this.gate.release(model);
      // The release may have failed it (a gap past its deadline).
      const failedNow = await this.registry.getFailedFuture(ref.jobId);
      if (failedNow) return { kind: 'failed', op: failedNow.op, ...recordedFailure(failedNow) };
      if (train) {
        const st = await this.pendingTrain(ref, 'training op');
        return st.kind === 'pending' ? { ...st, heldModel: model } : st;
      }
      return { kind: 'pending', queueState: 'active', heldModel: model };
    }
    const job = (await Job.fromId(this.queues.get(ref.queue), ref.jobId)) as Job<AnyJob> | undefined;
    if (!job) return { kind: 'unknown' };
    const op = job.data.op;
    if (job.finishedOn) {
      // Payloads and results of ordered training ops and samples are not kept long once read (a
      // repeat of their seq_id is recognised by the gate, not by the job). Others (create_model)
      // stay for the retention, as their job id is what makes them idempotent.
      const seq = (job.data as { seq_id?: number }).seq_id ?? 0;
      if (op === 'sample' || seq >= 1) {
        const ms = this.ttlAfterReadS * 1000;
        await this.redis
          .multi()
          .call('PEXPIRE', `${this.names.bull}:${ref.queue}:${ref.jobId}`, ms, 'LT')
          .call('PEXPIRE', this.names.futureOwner(encodeRequestId(ref)), ms, 'LT')
          .exec();
      }
      if (job.failedReason) {
        const { verdict, ...f } = decodeJobFailure(job.failedReason);
        // A training job that failed without the agent's verdict (a stall, a crash) may have run.
        if (train && !verdict) return { kind: 'failed', op, ...failure('OUTCOME_UNKNOWN', outcomeUnknownMessage(op, f.message)) };
        return { kind: 'failed', op, ...f };
      }
      // A training op's result lives in its outcome record (read again: it may have finished since the
      // first read); without one it has expired.
      if (train && job.returnvalue === null) {
        const o = await this.outcomes.get(ref.jobId);
        return o && o.state !== 'running' ? this.readOutcome(ref, o) : { kind: 'unknown' };
      }
      return { kind: 'done', op, result: job.returnvalue };
    }
    return train ? this.pendingTrain(ref, op) : { kind: 'pending', queueState: 'active' };
  }

  /** The future's state, waiting up to `timeoutMs` for it to finish; `signal` ends the wait early. */
  async retrieve(requestId: string, timeoutMs: number, signal?: AbortSignal): Promise<FutureState> {
    const ref = decodeRequestId(requestId);
    if (!ref) return { kind: 'unknown' };
    const first = await this.state(ref);
    if (first.kind !== 'pending') return first;
    await this.listen(ref.queue);
    const key = `${ref.queue}/${ref.jobId}`;
    let wake!: () => void;
    const woken = new Promise<void>((resolve) => (wake = resolve));
    const set = this.waiters.get(key) ?? new Set();
    set.add(wake);
    this.waiters.set(key, set);
    let timer: NodeJS.Timeout | undefined;
    try {
      const second = await this.state(ref);
      if (second.kind !== 'pending') return second;
      // An op held behind a gap wakes at the gap's deadline, when it may have failed.
      let wait = timeoutMs;
      if (second.heldModel) {
        const deadline = await this.gate.gapDeadline(second.heldModel);
        if (deadline !== null) wait = Math.max(10, Math.min(timeoutMs, deadline - Date.now() + 50));
      }
      const timeout = new Promise<void>((resolve) => (timer = setTimeout(resolve, wait)));
      const aborted = new Promise<void>((resolve) => signal?.addEventListener('abort', () => resolve(), { once: true }));
      await Promise.race([woken, timeout, aborted]);
      return await this.state(ref);
    } finally {
      clearTimeout(timer);
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
