import type { Redis } from 'ioredis';
import { Completions } from '../queues/completions.js';
import { decodeJobFailure, outcomeUnknownMessage, type ErrorCategory } from '../queues/errors.js';
import { decodeRequestId, encodeRequestId, type FutureRef } from '../queues/futures.js';
import type { OrderingGate } from '../queues/gate.js';
import { Liveness } from '../queues/liveness.js';
import { logger } from '../queues/logger.js';
import { Outcomes, type Outcome } from '../queues/outcomes.js';
import type { Names } from '../queues/names.js';
import type { QueueSet } from '../queues/queues.js';
import type { Registry } from '../queues/registry.js';
import type { JobOp } from '../queues/schemas.js';

/**
 * A training op's future is answered from its outcome record (queues/outcomes.ts), which the agent
 * writes once; a sample's from BullMQ's job state (queues/queues.ts `view`). A pending training op
 * whose agent was reaped (queues/liveness.ts) fails with OUTCOME_UNKNOWN. Every API process runs the
 * reaper (`startReaper`).
 *
 * A `retrieve_future` reads the state; if it is pending, registers a waiter for the op's completion
 * signal (queues/completions.ts), reads again, and sleeps on the waiter for at most the long-poll
 * window. No polling loop.
 */
export type FutureState =
  | { kind: 'done'; op: JobOp; result: unknown }
  | { kind: 'failed'; op: string; category: ErrorCategory; message: string; code?: string | undefined }
  | { kind: 'pending'; queueState: 'active'; heldModel?: string }
  | { kind: 'unknown' };

const QUEUE_NAME = /^(train|sample)-[A-Za-z0-9_.-]{1,128}$/;
/** The job ids the API issues (queues/names.ts jobIds); anything else names no future. */
const JOB_ID = /^[ctuls]-[A-Za-z0-9-]{1,200}$/;

export class FutureResolver {
  private readonly completions: Completions;
  readonly outcomes: Outcomes;
  readonly liveness: Liveness;

  constructor(
    private readonly redis: Redis,
    blockingConnection: () => Redis,
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
    this.completions = new Completions(redis, blockingConnection, names);
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
    return { kind: 'failed', op: o.op, category: o.category ?? 'server', message: o.message ?? 'failed', code: o.code };
  }

  /**
   * The outcome record of a training op, read as its future: a final one, and the op's job (its
   * payload), then leave Redis soon (create_model's stay for the retention: its job id makes it idempotent).
   */
  private readOutcome(ref: FutureRef): Promise<Outcome | null> {
    return this.outcomes.read(
      ref.jobId,
      this.queues.jobKey(ref.queue, ref.jobId),
      this.names.futureOwner(encodeRequestId(ref)),
      this.ttlAfterReadS * 1000,
      ref.jobId.startsWith('c-'),
    );
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

  async state(ref: FutureRef): Promise<FutureState> {
    if (!QUEUE_NAME.test(ref.queue) || !JOB_ID.test(ref.jobId)) return { kind: 'unknown' };
    const train = ref.queue.startsWith('train-');
    if (train) {
      const o = await this.readOutcome(ref);
      if (o && o.state !== 'running') return this.fromOutcome(o);
    }
    const failed = await this.registry.getFailedFuture(ref.jobId);
    if (failed) return { kind: 'failed', ...failed };
    const model = await this.gate.heldModel(ref.jobId);
    if (model !== null) {
      // Held behind a gap: the release fails it once the gap has timed out.
      await this.gate.release(model);
      const failedNow = await this.registry.getFailedFuture(ref.jobId);
      if (failedNow) return { kind: 'failed', ...failedNow };
      if (train) {
        const st = await this.pendingTrain(ref, 'training op');
        return st.kind === 'pending' ? { ...st, heldModel: model } : st;
      }
      return { kind: 'pending', queueState: 'active', heldModel: model };
    }
    const job = await this.queues.view(ref.queue, ref.jobId);
    if (!job) return { kind: 'unknown' };
    const op = job.op as JobOp;
    if (job.finished) {
      // Payloads and results of ordered training ops and samples are not kept long once read (a
      // repeat of their seq_id is recognised by the gate, not by the job). Others (create_model)
      // stay for the retention, as their job id is what makes them idempotent.
      if (op === 'sample' || job.seqId >= 1) {
        const ms = this.ttlAfterReadS * 1000;
        await this.redis
          .multi()
          .call('PEXPIRE', this.queues.jobKey(ref.queue, ref.jobId), ms, 'LT')
          .call('PEXPIRE', this.names.futureOwner(encodeRequestId(ref)), ms, 'LT')
          .exec();
      }
      if (job.failedReason) {
        const f = decodeJobFailure(job.failedReason);
        // A training job that failed without the agent's verdict (a stall, a crash) may have run.
        if (train && !/^\[(user|server|unknown)\] /.test(job.failedReason))
          return { kind: 'failed', op, category: 'unknown', code: 'OUTCOME_UNKNOWN', message: outcomeUnknownMessage(op, f.message) };
        return { kind: 'failed', op, ...f };
      }
      // A training op's result lives in its outcome record (read again: it may have finished since the
      // first read); without one it has expired.
      if (train) {
        const o = await this.readOutcome(ref);
        return o && o.state !== 'running' ? this.fromOutcome(o) : { kind: 'unknown' };
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
    const { woken, cancel } = await this.completions.watch(ref);
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
      cancel();
    }
  }

  close(): Promise<void> {
    return this.completions.close();
  }
}
