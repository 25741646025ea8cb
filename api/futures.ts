import type { Redis } from 'ioredis';
import { Completions, expectedSampleTenant, expectSampleEnd, forgetExpectedSample, handOverExpected, takeKept, takeKeptSample, type ReadOnceExpiry, type Wake } from '../queues/runtime/completions.js';
import { decodeJobFailure, failure, outcomeUnknownMessage, recordedFailure, type Failure } from '../queues/contract/errors.js';
import { decodeRequestId, encodeRequestId, type FutureRef } from '../queues/contract/futures.js';
import type { OrderingGate } from '../queues/runtime/gate.js';
import { Liveness } from '../queues/runtime/liveness.js';
import { logger } from '../queues/infra/logger.js';
import { Outcome, Outcomes } from '../queues/runtime/outcomes.js';
import type { Names } from '../queues/contract/names.js';
import type { QueueSet } from '../queues/runtime/queues.js';
import { FailedFuture } from '../queues/registry/futures.js';
import type { Registry } from '../queues/registry/index.js';
import { scripts } from '../queues/runtime/scripts.js';
import {
  readSessionFutures,
  reconcileSessionFutures,
  SESSION_RECONCILE_EVERY_MS,
  sessionKeys,
  sessionSignalKey,
  type SessionEnd,
  type SessionFutures,
  type SessionKeys,
} from '../queues/runtime/session-futures.js';
import type { JobOp } from '../queues/contract/schemas.js';

/**
 * A training op's future is answered from its outcome record (queues/runtime/outcomes.ts), which the agent
 * writes once; a sample's from its job's state (queues/runtime/queues.ts `sampleFuture`). A pending training op
 * whose agent was reaped (queues/runtime/liveness.ts) fails with OUTCOME_UNKNOWN. Every API process runs the
 * reaper (`startReaper`).
 *
 * A `retrieve_future` registers a waiter for the op's completion signal (queues/runtime/completions.ts),
 * reads the state (one script), and if it is pending sleeps on the waiter for at most the long-poll
 * window. No polling loop. A signal carries the final record when it is small (a training op's
 * outcome, a sample's result or failure): the waiter answers from it and leaves the read-once
 * expiry for after the answer (no read back).
 *
 * Every read is for the asking tenant: a future issued to another tenant (or to none) is unknown
 * (the route answers 404 as for a future that never existed); for a training op the owner is
 * checked inside the script that reads its state, in the same round trip.
 *
 * `retrieve_futures` (the SDK's session poller, `sessionFutures`) reads the log of a sampling
 * session's client (queues/runtime/session-futures.ts) the same way: a waiter for the signals of
 * that client's samples first, then the read, then a sleep on the waiter, for at most the
 * long-poll window. Its route checks that the session is the tenant's before anything is read.
 * A read with nothing to report first reconciles the client (at most every
 * SESSION_RECONCILE_EVERY_MS, also while the poll waits): its pending samples whose futures read
 * as ended (`sampleState`, as retrieve_future answers them) get the entries nobody wrote.
 */
export type FutureState =
  | { kind: 'done'; op: JobOp; result: unknown }
  | ({ kind: 'failed'; op: string } & Failure)
  | { kind: 'pending'; queueState: 'active'; heldModel?: string }
  | { kind: 'unknown' };

/** Clients whose reconcile scan position one process keeps (FutureResolver.reconcile); the oldest is forgotten first. */
const RECONCILE_CURSORS_MAX = 10_000;

/**
 * How long a retrieve_future of a sample submitted through this process waits for its end's signal
 * before it reads the sample's state (api/futures.ts retrieve): a job that ends without a signal (its
 * agent died) is answered this late at most.
 */
export const EXPECTED_SAMPLE_READ_MS = 2_000;

/** How long a read-once expiry given without a read of Redis waits for others to go with it (FutureResolver.expireLater). */
export const EXPIRY_BATCH_MS = 20;

const QUEUE_NAME = /^(train|sample)-[A-Za-z0-9_.-]{1,128}$/;
/** The job ids the API issues (queues/contract/names.ts jobIds); anything else names no future. */
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
    private readonly retentionS = 86_400,
    /** Seconds a finished training op's or sample's job (payload and result) stays once read. */
    private readonly ttlAfterReadS = 300,
  ) {
    this.outcomes = new Outcomes(redis, names, retentionS);
    this.liveness = new Liveness(redis, names, registry.models, this.outcomes);
    this.completions = new Completions(blockingConnection, names);
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
   * The outcome record of a training op, read as its future: a final one, and the op's job (its
   * payload), then leave Redis soon (create_model's stay for the retention: its job id makes it idempotent).
   */
  private readOutcome(ref: FutureRef): Promise<Outcome | null> {
    return this.outcomes.read(
      ref.jobId,
      this.queues.jobKey(ref.queue, ref.jobId),
      this.names.futureOwner(encodeRequestId(ref)),
      this.ttlAfterReadS * 1000,
      this.keepsOutcome(ref),
    );
  }

  /** create_model's outcome stays for the retention once read (its job id makes it idempotent). */
  private keepsOutcome(ref: FutureRef): boolean {
    return ref.jobId.startsWith('c-');
  }

  /** The future's state as `tenant` may see it: unknown unless it was issued to that tenant. */
  async state(ref: FutureRef, tenant: string): Promise<FutureState> {
    if (!QUEUE_NAME.test(ref.queue) || !JOB_ID.test(ref.jobId)) return { kind: 'unknown' };
    if (ref.queue.startsWith('train-')) return this.trainState(ref, tenant);
    return this.sampleState(ref, tenant);
  }

  /**
   * The state of a training op handed over a moment ago by this process's agent with no one waiting
   * here then, or of a sample submitted here whose end was signalled (expectSample), as `tenant`
   * sees it: its answer from the record kept here (taken: a second read goes to Redis), or undefined.
   */
  kept(requestId: string, tenant: string): FutureState | undefined {
    const ref = decodeRequestId(requestId);
    return ref ? this.keptState(ref, tenant) : undefined;
  }

  private keptState(ref: FutureRef, tenant: string): FutureState | undefined {
    if (!QUEUE_NAME.test(ref.queue) || !JOB_ID.test(ref.jobId)) return undefined;
    if (ref.queue.startsWith('sample-')) {
      const record = takeKeptSample(this.names.outcomesChannel(), ref.jobId, tenant);
      return record === undefined ? undefined : this.answered(ref, Outcome.parse(JSON.parse(record)), Promise.resolve());
    }
    const kept = takeKept(this.names.outcomesChannel(), ref.jobId, tenant);
    return kept && this.answered(ref, kept.record, kept.written);
  }

  /**
   * A sample about to be submitted through this process for `tenant` (before its submit, so its end
   * cannot come first). Its end's signal reaches this process (while the subscription is live:
   * queues/runtime/completions.ts expectSampleEnd), so until then a retrieve_future of it here
   * need not read its state first (`retrieve`); and when the client fetches its result only after
   * its end (the session poller, retrieve_futures), the end's record, when the signal carries it,
   * is kept here for that fetch. Either answers without reading Redis. Without a live
   * subscription nothing is expected (it is made now for the next ones).
   */
  expectSample(ref: FutureRef, tenant: string): void {
    if (this.completions.live) expectSampleEnd(this.names.outcomesChannel(), ref.jobId, tenant);
    else this.completions.listen().catch((e) => logger.debug('completion subscription failed', { error: String(e) }));
  }

  /** The sample's submit did not queue a new job (a replay, a full queue, a conflict): no end of it is expected here. */
  unexpectSample(ref: FutureRef): void {
    forgetExpectedSample(this.names.outcomesChannel(), ref.jobId);
  }

  /** A sample submitted here by `tenant` whose end has not been signalled here yet. */
  private expectingSample(ref: FutureRef, tenant: string): boolean {
    return ref.queue.startsWith('sample-') && expectedSampleTenant(this.names.outcomesChannel(), ref.jobId) === tenant;
  }

  /** A training op's future: its owner, its outcome, else what keeps it pending or failed, read in one round trip. */
  private async trainState(ref: FutureRef, tenant: string): Promise<FutureState> {
    // Running in this process's agent, submitted by this tenant: it is handed over here when it ends.
    if (handOverExpected(this.names.outcomesChannel(), ref.jobId) === tenant) return { kind: 'pending', queueState: 'active' };
    const kept = this.keptState(ref, tenant);
    if (kept) return kept;
    const agentId = ref.queue.slice('train-'.length);
    const read = await scripts.futureTrain.run(this.redis, {
      keys: {
        outcome: this.outcomes.key(ref.jobId),
        job: this.queues.jobKey(ref.queue, ref.jobId),
        owner: this.names.futureOwner(encodeRequestId(ref)),
        failed: this.names.failedFuture(ref.jobId),
        heldIndex: this.names.gateHeldIndex(),
        reaped: this.names.agentReaped(agentId),
        moved: this.names.jobMoved(ref.jobId),
      },
      args: { jobId: ref.jobId, readTtlMs: this.ttlAfterReadS * 1000, keep: this.keepsOutcome(ref) ? '1' : '0', tenant, bullPrefix: `${this.names.bull}:` },
    });
    if (read === scripts.futureTrain.codes.notOwner) return { kind: 'unknown' };
    const [o, failed, held, name, finishedOn, failedReason, reaped] = read;
    const outcome = o ? Outcome.parse(JSON.parse(o)) : null;
    if (outcome && outcome.state !== 'running') return this.fromOutcome(outcome);
    if (failed) {
      const f = FailedFuture.parse(JSON.parse(failed));
      return { kind: 'failed', op: f.op, ...recordedFailure(f) };
    }
    const op = outcome?.op ?? name ?? 'training op';
    const pending = async (heldModel?: string): Promise<FutureState> => {
      // A pending op whose agent was reaped fails (OUTCOME_UNKNOWN), unless its outcome is already final.
      if (reaped) return this.fromOutcome(await this.liveness.failPending(ref.jobId, op, agentId, reaped.slice(reaped.indexOf(' ') + 1)));
      return { kind: 'pending', queueState: 'active', ...(heldModel ? { heldModel } : {}) };
    };
    if (held) {
      // Held behind a gap: the release fails it once the gap has timed out.
      await this.gate.release(held);
      const failedNow = await this.registry.futures.getFailed(ref.jobId);
      if (failedNow) return { kind: 'failed', op: failedNow.op, ...recordedFailure(failedNow) };
      return pending(held);
    }
    if (!name) return { kind: 'unknown' };
    if (!finishedOn) return pending();
    // The job ended without an outcome record: ordered ops' jobs leave soon once read.
    if (ref.jobId.startsWith('t-')) await this.expireOnceRead(ref);
    if (failedReason) {
      const { verdict, ...f } = decodeJobFailure(failedReason);
      // A training job that failed without the agent's verdict (a stall, a crash) may have run.
      if (!verdict) return { kind: 'failed', op, ...failure('OUTCOME_UNKNOWN', outcomeUnknownMessage(op, f.message)) };
      return { kind: 'failed', op, ...f };
    }
    // Its outcome may have been recorded since the read; without one it has expired.
    const again = await this.readOutcome(ref);
    return again && again.state !== 'running' ? this.fromOutcome(again) : { kind: 'unknown' };
  }

  /**
   * A sample's future: its owner, its job's state, else its failed-future record, read in one round
   * trip; a finished job (payload and result) leaves Redis `readTtlMs` after this read (soon), with
   * the owner record.
   */
  private async sampleState(ref: FutureRef, tenant: string, readTtlMs = this.ttlAfterReadS * 1000): Promise<FutureState> {
    const job = await this.queues.sampleFuture(
      ref.queue,
      ref.jobId,
      this.names.futureOwner(encodeRequestId(ref)),
      this.names.failedFuture(ref.jobId),
      tenant,
      readTtlMs,
    );
    // Records older than tenants (owner '') belong to no tenant.
    if (job.kind === 'not-owner') return { kind: 'unknown' };
    if (job.kind === 'no-job') {
      const failed = job.failedFuture === null ? null : FailedFuture.parse(JSON.parse(job.failedFuture));
      return failed ? { kind: 'failed', op: failed.op, ...recordedFailure(failed) } : { kind: 'unknown' };
    }
    if (!job.finished) return { kind: 'pending', queueState: 'active' };
    const op = job.op as JobOp;
    if (job.failedReason) {
      const { verdict: _verdict, ...f } = decodeJobFailure(job.failedReason);
      return { kind: 'failed', op, ...f };
    }
    return { kind: 'done', op, result: job.returnvalue };
  }

  /** The job and the owner record (and, with `outcome`, the outcome record) leave Redis `ttlAfterReadS` after this read. */
  private async expireOnceRead(ref: FutureRef, outcome = false): Promise<void> {
    const m = this.redis.multi();
    for (const k of this.readOnceKeys(ref, outcome)) m.call('PEXPIRE', k, this.ttlAfterReadS * 1000, 'LT');
    await m.exec();
  }

  private readOnceKeys(ref: FutureRef, outcome: boolean): string[] {
    const keys = [this.queues.jobKey(ref.queue, ref.jobId), this.names.futureOwner(encodeRequestId(ref))];
    return outcome ? [...keys, this.outcomes.key(ref.jobId)] : keys;
  }

  /**
   * The answer a completion signal carried (a training op's final outcome record, or a finished
   * sample's in the same shape), or null. The read-once expiry that the state scripts apply runs
   * once this turn of the event loop is over, after the answer is on its way, unless the signal's
   * sender applies it with the record (`expiryTaken`: an agent in this process, queues/runtime/completions.ts).
   */
  private signalled(ref: FutureRef, wake: Wake | undefined): FutureState | null {
    if (wake?.record === undefined) return null;
    const o = typeof wake.record === 'string' ? Outcome.parse(JSON.parse(wake.record)) : wake.record;
    if (o.state === 'running') return null;
    return this.answered(ref, o, wake.expiryTaken ? null : Promise.resolve());
  }

  /**
   * The answer from a final record this process was given (a signal, or a record kept here). Its
   * read-once expiry is applied once this turn of the event loop is over, after `written` (the
   * record's own write, which would otherwise set its full lifetime over the expiry), unless the
   * record's sender applies it (`written` null).
   */
  private answered(ref: FutureRef, o: Outcome, written: Promise<void> | null): FutureState {
    if (!this.keepsOutcome(ref) && written) {
      const keys = this.readOnceKeys(ref, ref.queue.startsWith('train-'));
      void written.then(() => this.expireLater(keys));
    }
    return this.fromOutcome(o);
  }

  /**
   * Read-once expiries of answers given without a read of Redis, sent together: the first one waits
   * EXPIRY_BATCH_MS for others, then all go in one pipeline (one write and one round trip for the
   * reads of many ops, after their answers are out). By key; a process that stops first sends them
   * on close, or, killed, leaves those keys their full lifetime.
   */
  private expiries = new Set<string>();
  private expiryTimer: NodeJS.Timeout | null = null;

  private expireLater(keys: string[]): void {
    for (const k of keys) this.expiries.add(k);
    this.expiryTimer ??= setTimeout(() => void this.sendExpiries(), EXPIRY_BATCH_MS);
  }

  private async sendExpiries(): Promise<void> {
    const keys = [...this.expiries];
    this.expiries.clear();
    if (this.expiryTimer) clearTimeout(this.expiryTimer);
    this.expiryTimer = null;
    if (keys.length === 0) return;
    const p = this.redis.pipeline();
    for (const k of keys) p.call('PEXPIRE', k, this.ttlAfterReadS * 1000, 'LT');
    await p.exec().catch((e) => logger.debug('read-once expiries not set', { keys: keys.length, error: String(e) }));
  }

  /** What `expireOnceRead` does for a future, for a signal's sender to apply (none for a record kept). */
  private onceRead(ref: FutureRef): ReadOnceExpiry | undefined {
    if (this.keepsOutcome(ref)) return undefined;
    return { keys: this.readOnceKeys(ref, ref.queue.startsWith('train-')), ms: this.ttlAfterReadS * 1000 };
  }

  /**
   * The future's state as `tenant` sees it (unknown unless issued to that tenant), waiting up to
   * `timeoutMs` for it to finish; `signal` ends the wait early.
   */
  async retrieve(requestId: string, tenant: string, timeoutMs: number, signal?: AbortSignal): Promise<FutureState> {
    const ref = decodeRequestId(requestId);
    if (!ref) return { kind: 'unknown' };
    // A record this process's agent handed over with no one waiting is final: answered at once.
    const kept = this.keptState(ref, tenant);
    if (kept) return kept;
    // The waiter first, then the read: a completion signalled in between is not missed. Every
    // future's signal comes on one subscription, made once per process.
    const { woken, owns, cancel } = await this.completions.watch(ref, tenant);
    let timer: NodeJS.Timeout | undefined;
    const aborted = new Promise<undefined>((resolve) => signal?.addEventListener('abort', () => resolve(undefined), { once: true }));
    let waited = 0;
    try {
      // A sample this tenant submitted here that has not ended (its end is signalled here): its
      // signal answers, with no read first. A job that ends with no signal (its agent died) is read
      // after EXPECTED_SAMPLE_READ_MS.
      if (this.expectingSample(ref, tenant)) {
        waited = Math.min(timeoutMs, EXPECTED_SAMPLE_READ_MS);
        const first = await Promise.race([woken, new Promise<undefined>((resolve) => (timer = setTimeout(() => resolve(undefined), waited))), aborted]);
        clearTimeout(timer);
        if (first) return this.signalled(ref, first) ?? (await this.state(ref, tenant));
        if (waited >= timeoutMs || signal?.aborted) return await this.state(ref, tenant);
      }
      const second = await this.state(ref, tenant);
      if (second.kind !== 'pending') return second;
      // Pending for this tenant: its future. A hand-over from now on applies the read-once expiry
      // with the record (one woken before this answers from the signal and applies it itself).
      owns(this.onceRead(ref));
      // An op held behind a gap wakes at the gap's deadline, when it may have failed.
      let wait = timeoutMs - waited;
      if (second.heldModel) {
        const deadline = await this.gate.gapDeadline(second.heldModel);
        if (deadline !== null) wait = Math.max(10, Math.min(timeoutMs, deadline - Date.now() + 50));
      }
      const timeout = new Promise<undefined>((resolve) => (timer = setTimeout(() => resolve(undefined), wait)));
      const wake = await Promise.race([woken, timeout, aborted]);
      return this.signalled(ref, wake) ?? (await this.state(ref, tenant));
    } finally {
      clearTimeout(timer);
      cancel();
    }
  }

  /**
   * retrieve_futures: the samples of a sampling session's client (`clone`) that ended after
   * `prevCursor`, those at or before it acknowledged (they leave the log). When there are none,
   * waits up to `timeoutMs` for one (0: answers at once); `signal` ends the wait early. The
   * caller has checked that the session is `tenant`'s.
   */
  async sessionFutures(
    samplingSessionId: string,
    clone: number,
    prevCursor: number,
    timeoutMs: number,
    tenant: string,
    signal?: AbortSignal,
  ): Promise<SessionFutures> {
    const keys = sessionKeys(this.names, samplingSessionId, clone);
    // Nothing to report: the client's samples that ended without their entry get theirs, and are read.
    const read = async () => {
      const got = await readSessionFutures(this.redis, keys, prevCursor, this.retentionS);
      if (got.completions.length > 0 || !(await this.reconcile(keys, tenant))) return got;
      return readSessionFutures(this.redis, keys, prevCursor, this.retentionS);
    };
    if (timeoutMs <= 0) return read();
    // The waiter first, then each read: an entry added after a read comes with a signal that wakes it.
    const { next, cancel } = await this.completions.watchSession(sessionSignalKey(samplingSessionId, clone));
    let timer: NodeJS.Timeout | undefined;
    let tick: NodeJS.Timeout | undefined;
    let over = false;
    const ended = new Promise<void>((resolve) => {
      timer = setTimeout(resolve, timeoutMs);
      signal?.addEventListener('abort', () => resolve(), { once: true });
    }).then(() => void (over = true));
    try {
      for (;;) {
        const woken = next();
        const got = await read();
        // At the window's end, the last read answers (it finds an entry whose signal this process missed).
        if (got.completions.length > 0 || over || signal?.aborted) return got;
        // Woken by a signal, at the window's end, or for the next reconcile.
        const reconcileDue = new Promise<void>((resolve) => (tick = setTimeout(resolve, SESSION_RECONCILE_EVERY_MS)));
        await Promise.race([woken, ended, reconcileDue]);
        clearTimeout(tick);
      }
    } finally {
      clearTimeout(timer);
      clearTimeout(tick);
      cancel();
    }
  }

  /** Per client (its pending set), where its next reconcile in this process goes on scanning; bounded. */
  private readonly reconcileFrom = new Map<string, string>();

  /**
   * One reconcile of a client's pending samples (queues/runtime/session-futures.ts), unless another
   * poll had its turn within SESSION_RECONCILE_EVERY_MS; resolves to whether it added entries. A
   * failure is logged and counts as none: the poll goes on, and the next turn tries again.
   */
  private async reconcile(keys: SessionKeys, tenant: string): Promise<boolean> {
    try {
      if ((await this.redis.set(keys.turn, '1', 'PX', SESSION_RECONCILE_EVERY_MS, 'NX')) === null) return false;
      const from = this.reconcileFrom.get(keys.pending) ?? '0';
      const { added, next } = await reconcileSessionFutures(this.redis, this.names, keys, (id) => this.pendingSampleEnd(id, tenant), this.retentionS, from);
      this.reconcileFrom.delete(keys.pending);
      if (next !== '0') {
        if (this.reconcileFrom.size >= RECONCILE_CURSORS_MAX) this.reconcileFrom.delete(this.reconcileFrom.keys().next().value!);
        this.reconcileFrom.set(keys.pending, next);
      }
      if (added > 0) logger.info('retrieve_futures: samples that ended without their entry reported', { pending: keys.pending, added });
      return added > 0;
    } catch (e) {
      logger.warn('retrieve_futures: reconcile failed', { pending: keys.pending, error: String(e) });
      return false;
    }
  }

  /**
   * The end of a pending sample as its future reads for `tenant` (null while it has none): done,
   * failed as retrieve_future answers it, or, when nothing of it is left (its job removed or
   * expired), failed as the unknown future retrieve_future answers NOT_FOUND for. The read is not
   * the client's, so it applies no read-once expiry (that is the client's retrieve_future's).
   */
  private async pendingSampleEnd(requestId: string, tenant: string): Promise<SessionEnd | null> {
    const ref = decodeRequestId(requestId);
    const known = ref !== null && ref.queue.startsWith('sample-') && QUEUE_NAME.test(ref.queue) && JOB_ID.test(ref.jobId);
    // The read's PEXPIRE … LT with the owner record's lifetime (retention × 2) keeps every shorter
    // one; a finished job's hash, which has none, gets it (BullMQ removes it at the retention anyway).
    const st: FutureState = known ? await this.sampleState(ref, tenant, this.retentionS * 2 * 1000) : { kind: 'unknown' };
    switch (st.kind) {
      case 'pending':
        return null;
      case 'done':
        return { state: 'done' };
      case 'failed':
        return { state: 'failed', category: st.category, code: st.code, message: st.message };
      case 'unknown':
        return { state: 'failed', ...failure('NOT_FOUND', `unknown or expired future '${requestId}'`) };
    }
  }

  async close(): Promise<void> {
    await this.sendExpiries();
    return this.completions.close();
  }
}
