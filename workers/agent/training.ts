import { performance } from 'node:perf_hooks';
import type { Redis } from 'ioredis';
import type { AgentConfig } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import { encodeJobFailure, failure, outcomeUnknownMessage, recordedFailure } from '../../queues/contract/errors.js';
import type { Names } from '../../queues/contract/names.js';
import { TrainJob } from '../../queues/contract/schemas.js';
import type { Liveness } from '../../queues/runtime/liveness.js';
import type { JobRecorder, JobStatus } from '../../queues/runtime/metrics.js';
import type { Outcome, Outcomes } from '../../queues/runtime/outcomes.js';
import { TrainConsumer, type TakenTrainJob, type TrainVerdict } from '../../queues/runtime/train-consumer.js';
import type { Registry } from '../../queues/registry/index.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import type { CheckpointJobs } from '../checkpoint-jobs.js';
import { OpTimeout, type EngineSupervisor } from './engine.js';
import { opFailure, tokensOf } from './ops.js';
import type { AgentSnapshots } from '../snapshots.js';
import { trainOp } from './train-ops.js';

/**
 * The ordered training pipeline of one agent: the ops of its training queue, one at a time on the
 * engine, in the queue's order, each outcome recorded exactly once (queues/runtime/outcomes.ts), never
 * retried. It owns the engine's turn (`turn`, `ahead`): the consumer holds one op ahead, parsed and
 * waiting, and hands the engine over to it the moment the current op's engine call returns.
 */

export type TrainingPipelineOptions = {
  config: Pick<AgentConfig, 'agentId'>;
  log: Logger;
  adapter: EngineAdapter;
  engine: EngineSupervisor;
  outcomes: Pick<Outcomes, 'claim' | 'release' | 'finish'>;
  liveness: Pick<Liveness, 'failPending'>;
  registry: Pick<Registry, 'models' | 'checkpoints'>;
  checkpoints: CheckpointJobs;
  /** Continuous snapshots after optim_steps (workers/snapshots.ts); absent: none. */
  snapshots?: AgentSnapshots | undefined;
  metrics: Pick<JobRecorder, 'add'>;
  /** The agent's training queue (for the logs). */
  queue: string;
  /** Whether the agent drains or stops: ops taken ahead then go back to the queue unstarted. */
  halted: () => boolean;
  /**
   * Before an op is claimed: resolves once the agent knows it still holds its models (after a pause
   * past its liveness timeout it beats first, Registration.ensureFresh). Absent: nothing to wait for.
   */
  fresh?: () => Promise<void> | undefined;
  /**
   * Co-batching: at most this many forward_backward ops of different models on one base run as one
   * engine pass (TB_COBATCH_MAX; 1 or an engine without `forwardBackwardGroup`: one at a time).
   */
  cobatchMax?: number;
  /**
   * Co-batching's gather window (TB_COBATCH_WAIT_MS): how long, at most, a forward_backward whose turn
   * came waits for the models that trained here lately to queue theirs. 0 or absent: no wait.
   */
  cobatchWaitMs?: number;
};

/**
 * A model whose forward_backward ran here within this many ms is one the gather window waits for: a
 * loop that trains here now (one that missed a window is dropped at once, see `gather`).
 */
const RECENT_MS = 10_000;

/** A job taken and waiting for its turn; a co-batch takes it along (`ride`: its recorded outcome once the group has run). */
type Waiting = { job: TakenTrainJob; data: TrainJob | undefined; ride?: Promise<Outcome> };

export class TrainingPipeline {
  /**
   * The engine's turn of the last training op taken (see run): `done` resolves when the engine is
   * free for the next one; `nextStarted` is set by the op waiting on it and resolves once that op
   * has its engine call under way, or ended without one.
   */
  private turn: { done: Promise<void>; nextStarted?: Promise<void> } = { done: Promise.resolve() };
  /** Training ops taken and not yet past the engine: none means the next one taken starts at once. */
  private ahead = 0;
  /** Jobs taken whose turn has not come, in the queue's order (co-batching picks partners among them). */
  private readonly waiting: Waiting[] = [];
  /** Models whose forward_backward ran here lately (co-batching): their base model and when. */
  private readonly recent = new Map<string, { base: string; at: number }>();
  /** Wakes the gather window when a job joins `waiting`. */
  private arrived: (() => void) | undefined;

  constructor(private readonly o: TrainingPipelineOptions) {}

  /** Whether the next op taken would start at once: the take itself then claims its outcome. */
  claimAtTake(): boolean {
    return this.ahead === 0 && !this.o.halted();
  }

  /**
   * The consumer of the agent's training queue, feeding this pipeline. Two at a time: the next op
   * waits parsed here while the current one runs (run); an op taken while the engine is free is
   * claimed by the take itself. No stalled check: outcomes are recorded apart, the reaper handles dead agents.
   */
  consumer(redis: Redis, names: Names, outcomes: Outcomes, opts: { lockMs: number; tokenPrefix: string }): TrainConsumer {
    return new TrainConsumer(redis, names, outcomes, this.o.queue, {
      // With co-batching, as many taken ahead as a group can take along, each member's model with
      // its optim_step queued behind its forward_backward (the SDK submits both before awaiting).
      concurrency: this.cobatchMax > 1 ? 2 * this.cobatchMax : 2,
      lockMs: opts.lockMs,
      agentId: this.o.config.agentId,
      tokenPrefix: opts.tokenPrefix,
      claimAtTake: () => this.claimAtTake(),
      process: (job) => this.run(job),
      // A short op starts once the client has its submit's answer (its turnaround is most of its
      // round trip); a longer one first, then the answer: its engine time is.
      startsAfterAnswer: (op) => op === 'optim_step',
      log: this.o.log,
    });
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
  async run(job: TakenTrainJob): Promise<TrainVerdict> {
    const verdict = await this.verdict(job);
    if (verdict.state === 'failed') {
      const d = job.data as { model_id?: string | null } | undefined;
      this.o.log.warn('job failed', { queue: this.o.queue, jobId: job.id, op: job.op, modelId: d?.model_id ?? undefined, error: verdict.reason });
    }
    return verdict;
  }

  /** The most forward_backward ops one engine pass takes (1: no co-batching). */
  private get cobatchMax(): number {
    return this.o.adapter.forwardBackwardGroup ? Math.max(1, this.o.cobatchMax ?? 1) : 1;
  }

  private async verdict(job: TakenTrainJob): Promise<TrainVerdict> {
    const { outcomes, engine, config, log } = this.o;
    const jobId = job.id;
    const op = job.op;
    // A job the gate in this process parsed and handed over is not parsed again.
    const parsed = job.parsed ? { success: true as const, data: job.data as TrainJob } : TrainJob.safeParse(job.data);
    const waiting: Waiting = { job, data: parsed.success ? parsed.data : undefined };
    this.waiting.push(waiting);
    this.arrived?.();
    const before = this.turn;
    let started!: () => void;
    before.nextStarted = new Promise<void>((r) => (started = r));
    let endTurn!: () => void;
    this.ahead++;
    let turnEnded = false;
    const turn = new Promise<void>((resolve) => (endTurn = () => {
      if (!turnEnded) {
        turnEnded = true;
        this.ahead--;
      }
      resolve();
    }));
    const mine: { done: Promise<void>; nextStarted?: Promise<void> } = { done: turn };
    this.turn = mine;
    // The engine is free: an op waiting on this one goes first (its claim's round trip, then its
    // engine call), then this one's outcome is answered and recorded, which would otherwise hold up
    // that round trip's reply in this process and keep the engine idle.
    const handOn = async () => {
      endTurn();
      if (mine.nextStarted) await mine.nextStarted;
    };
    try {
      await before.done;
      this.waiting.splice(this.waiting.indexOf(waiting), 1);
      // Taken along by an earlier op's co-batch: its outcome is recorded already.
      if (waiting.ride) return await this.standing(jobId, op, await waiting.ride);
      // Awaited only when there is something to wait for: an await here would let the API write a
      // submit's answer before this op's engine call (the fast path, docs/architecture.md).
      const fresh = this.o.fresh?.();
      if (fresh) await fresh;
      const token = job.token;
      if (this.o.halted()) {
        // Taken ahead but not started: back to the head of the queue, for whoever runs the model next.
        if (job.claim && job.claim.prev === null) await outcomes.release(jobId, token);
        return { state: 'requeue' };
      }
      const prev = job.claim ? job.claim.prev : await outcomes.claim(jobId, op, config.agentId, token);
      if (prev) return await this.standing(jobId, op, prev);
      const start = Date.now();
      let epoch = -1;
      let cobatched = 0;
      let result: unknown;
      let engineSpan: [number, number];
      try {
        // An engine restarting takes seconds: the op before this one does not wait for it.
        if (engine.restarting) started();
        await engine.ensure();
        epoch = engine.epoch;
        if (!parsed.success) throw parsed.error;
        const d = parsed.data;
        const partners = d.op === 'forward_backward' && this.mayCobatch(d.model_id) ? await this.partners(d, started) : [];
        if (partners.length) cobatched = partners.length + 1;
        // An engine that died during the gather window: the op runs on its successor (and fails
        // there as an op of a model it lost), not as one whose engine died under it.
        if (engine.epoch !== epoch) {
          try {
            await engine.ensure();
          } catch (e) {
            // The partners claimed here go back to their own turns, unclaimed (one claimed by its take keeps its claim).
            for (const p of partners) if (!p.job.claim) await outcomes.release(p.job.id, p.job.token).catch(() => false);
            throw e;
          }
          epoch = engine.epoch;
        }
        // After the gather window: the span is the engine's.
        const t0 = performance.timeOrigin + performance.now();
        const call = d.op === 'forward_backward' && partners.length ? this.cobatch(d, partners, epoch) : trainOp(d, this.o);
        // Once the promise jobs that carry the call to the engine have run.
        process.nextTick(started);
        result = await engine.timed(op, call);
        engineSpan = [t0, performance.timeOrigin + performance.now()];
      } catch (err) {
        await handOn();
        let f = opFailure(op, err);
        if (err instanceof OpTimeout || (epoch >= 0 && epoch !== engine.epoch))
          f = failure('OUTCOME_UNKNOWN', outcomeUnknownMessage(op, err instanceof OpTimeout ? err.message : `the engine process died while running it: ${f.message}`));
        const stood = await outcomes.finish(jobId, token, { state: 'failed', op, agent_id: config.agentId, ...f }, true);
        this.meter(job, parsed.data, start, f.category === 'user' ? 'user_error' : 'server_error');
        return await this.standing(jobId, op, stood);
      }
      await handOn();
      // Early: an API in this process answers the op's future from this result, then it is recorded,
      // and its job ended in its queue, in one script (queues/runtime/outcomes.ts).
      const stood = await outcomes.finish(jobId, token, { state: 'done', op, agent_id: config.agentId, result, engine: engineSpan, ...(cobatched ? { cobatch: cobatched } : {}) }, true, job.end);
      // An op finished after the reaper gave up on this agent keeps the reaper's verdict in Redis (the 'job failed' line says so).
      if (stood.state === 'done') log.debug('job done', { queue: this.o.queue, jobId, op, modelId: parsed.data?.model_id, ms: Date.now() - start });
      this.meter(job, parsed.data, start, stood.state === 'done' ? 'ok' : 'server_error', result);
      return await this.standing(jobId, op, stood);
    } finally {
      endTurn();
      started();
    }
  }

  /**
   * Whether a forward_backward of `lead` may find partners: with a gather window, always (the window
   * may bring them); without, only when another model's forward_backward is already waiting. Decided
   * without awaiting anything, so that a lone loop's forward_backward reaches the engine as directly
   * as without co-batching (before its client's answer is written: docs/architecture.md, fast path).
   */
  private mayCobatch(lead: string): boolean {
    if (this.cobatchMax <= 1) return false;
    if ((this.o.cobatchWaitMs ?? 0) > 0) return true;
    return this.waiting.some((w) => w.data?.op === 'forward_backward' && 'model_id' in w.data && !!w.data.model_id && w.data.model_id !== lead);
  }

  /**
   * The forward_backward ops that can run in one engine pass with `lead` (co-batching): among the
   * jobs taken and waiting, each model's first one, when it is a forward_backward of another model
   * on the same base model, loaded here and not claimed by anyone else (claimed by its own take here
   * is ours); at most `cobatchMax - 1`. Ops already
   * taken are looked at, after the gather window (`gather`) where one is set. Each is claimed here
   * (an op whose outcome another process recorded first is left to its own turn). `started`: the
   * op before the lead is told the engine is taken, before any wait.
   */
  private async partners(lead: Extract<TrainJob, { op: 'forward_backward' }>, started: () => void): Promise<(Waiting & { data: Extract<TrainJob, { op: 'forward_backward' }> })[]> {
    const max = this.cobatchMax;
    const base = await this.baseOf(lead.model_id);
    if (max <= 1 || !base) return [];
    for (const [m, r] of this.recent) if (Date.now() - r.at > RECENT_MS || !this.o.engine.loaded.has(m)) this.recent.delete(m);
    await this.gather(lead.model_id, base, started);
    const now = Date.now();
    this.recent.set(lead.model_id, { base, at: now });
    if (this.waiting.length === 0) return [];
    const { engine, outcomes, config } = this.o;
    const seen = new Set([lead.model_id]);
    const out: (Waiting & { data: Extract<TrainJob, { op: 'forward_backward' }> })[] = [];
    for (const w of [...this.waiting]) {
      if (out.length >= max - 1) break;
      const d = w.data;
      if (!d || !('model_id' in d) || !d.model_id) continue;
      // A model's later ops wait for its first: only the first waiting op of each model can come along.
      if (seen.has(d.model_id)) continue;
      seen.add(d.model_id);
      // One claimed by its take (this process's claim: the engine was idle when it came) comes along as is.
      if (d.op !== 'forward_backward' || w.ride || (w.job.claim && w.job.claim.prev !== null) || !engine.loaded.has(d.model_id)) continue;
      try {
        if ((await this.baseOf(d.model_id)) !== base) continue;
        if (!w.job.claim && (await outcomes.claim(w.job.id, d.op, config.agentId, w.job.token)) !== null) continue;
      } catch {
        // Redis unreachable: the partners claimed so far come along; the others run in their turn.
        break;
      }
      out.push(w as Waiting & { data: typeof d });
      this.recent.set(d.model_id, { base, at: now });
    }
    return out;
  }

  /** A model's base model (from its placement; remembered while it trains here), or null when unknown. */
  private async baseOf(modelId: string): Promise<string | null> {
    const known = this.recent.get(modelId)?.base;
    if (known) return known;
    return (await this.o.registry.models.placed(modelId).catch(() => null))?.base_model ?? null;
  }

  /**
   * The gather window (TB_COBATCH_WAIT_MS): the lead waits, at most that long, until every other model
   * on its base whose forward_backward ran here within RECENT_MS (a loop training here now, loaded
   * here) has an op waiting, or the pass is full. A model whose first waiting op is not a
   * forward_backward is not waited for further (it cannot come along); one that did not come within
   * the window is not waited for again until its next forward_backward here. Loops that run in step
   * then meet in one pass rather than drifting into a pass of most and a pass of the one that was a
   * round trip late. The wait is bounded by the window; a halting agent does not wait.
   */
  private async gather(lead: string, base: string, started: () => void): Promise<void> {
    const windowMs = this.o.cobatchWaitMs ?? 0;
    if (windowMs <= 0) return;
    const expected = [...this.recent].filter(([m, r]) => m !== lead && r.base === base).map(([m]) => m);
    if (expected.length === 0) return;
    // The op before this one answers its client now (its next op may be what we wait for).
    started();
    const deadline = Date.now() + windowMs;
    for (;;) {
      const first = new Map<string, string>();
      for (const w of this.waiting) {
        const m = w.data && 'model_id' in w.data ? w.data.model_id : undefined;
        if (m && !first.has(m)) first.set(m, w.data!.op);
      }
      const ready = expected.filter((m) => first.get(m) === 'forward_backward').length;
      if (ready >= this.cobatchMax - 1 || expected.every((m) => first.has(m)) || this.o.halted()) return;
      const left = deadline - Date.now();
      if (left <= 0) {
        // Not waited for again until it trains here again: a loop busy elsewhere (sampling, say)
        // costs the others one window, not one per pass.
        for (const m of expected) if (!first.has(m)) this.recent.delete(m);
        return;
      }
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        this.arrived = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.arrived = undefined;
    }
  }

  /**
   * `lead` and its partners in one engine pass: the partners' outcomes are recorded here (each as
   * its own op's would be), their jobs end when their turns come; the lead's result is returned as
   * its own op's, or its error thrown.
   */
  private async cobatch(
    lead: Extract<TrainJob, { op: 'forward_backward' }>,
    partners: (Waiting & { data: Extract<TrainJob, { op: 'forward_backward' }> })[],
    epoch: number,
  ): Promise<unknown> {
    const { adapter, engine, outcomes, config, log } = this.o;
    const settle = new Map<Waiting, (o: Outcome) => void>();
    for (const p of partners) p.ride = new Promise<Outcome>((r) => settle.set(p, r));
    // A partner's outcome, recorded once; its turn ends its job as the record says.
    const record = async (p: Waiting, final: Parameters<Outcomes['finish']>[2]) => {
      const resolve = settle.get(p);
      if (!resolve) return;
      settle.delete(p);
      try {
        resolve(await outcomes.finish(p.job.id, p.job.token, final, true));
      } catch (e) {
        // Not recorded (Redis unreachable): the op's outcome is unknown to everyone but this process.
        log.warn('co-batched outcome not recorded', { jobId: p.job.id, error: String(e) });
        resolve({ ...final, token: p.job.token, at: new Date().toISOString() } as Outcome);
      }
    };
    const start = Date.now();
    let results: (unknown | Error)[];
    try {
      await engine.requireLoaded(lead.model_id);
      const t0 = performance.timeOrigin + performance.now();
      results = await adapter.forwardBackwardGroup!([lead, ...partners.map((p) => p.data)]);
      const span: [number, number] = [t0, performance.timeOrigin + performance.now()];
      for (const [i, p] of partners.entries()) {
        const r = results[i + 1];
        if (r instanceof Error) {
          const f = opFailure('forward_backward', r);
          await record(p, { state: 'failed', op: 'forward_backward', agent_id: config.agentId, ...f });
          this.meter(p.job, p.data, start, f.category === 'user' ? 'user_error' : 'server_error');
        } else {
          await record(p, { state: 'done', op: 'forward_backward', agent_id: config.agentId, result: r, engine: span, cobatch: results.length });
          this.meter(p.job, p.data, start, 'ok', r);
        }
      }
    } catch (err) {
      let f = opFailure('forward_backward', err);
      if (err instanceof OpTimeout || engine.epoch !== epoch)
        f = failure('OUTCOME_UNKNOWN', outcomeUnknownMessage('forward_backward', err instanceof OpTimeout ? err.message : `the engine process died while running it: ${f.message}`));
      for (const p of partners) await record(p, { state: 'failed', op: 'forward_backward', agent_id: config.agentId, ...f });
      throw err;
    }
    log.debug('co-batched', { lead: lead.model_id, partners: partners.map((p) => p.data.model_id) });
    const mine = results[0];
    if (mine instanceof Error) throw mine;
    return mine;
  }

  /** Ends the BullMQ job as the recorded outcome says (which may be another's: the reaper's, an earlier run's). */
  private async standing(jobId: string, op: string, o: Outcome): Promise<TrainVerdict> {
    if (o.state === 'done') return { state: 'done' };
    if (o.state === 'running') {
      // Claimed by an earlier incarnation of this agent that died before finishing it.
      const why = `the agent process that was running it (${o.token.split('/')[0]}) ended before recording its outcome`;
      o = await this.o.liveness.failPending(jobId, op, this.o.config.agentId, why);
      if (o.state === 'done') return { state: 'done' };
    }
    return { state: 'failed', reason: encodeJobFailure(recordedFailure(o)) };
  }

  /** Counts one finished training op in the metrics (and its tokens when it succeeded), written with the others of its 100 ms. */
  private meter(job: TakenTrainJob, data: TrainJob | undefined, start: number, status: JobStatus, result?: unknown): void {
    const tokens = status === 'ok' && data ? tokensOf(data, result) : undefined;
    this.o.metrics.add({ op: job.op, status, enqueuedAt: job.timestamp, startedAt: start, finishedAt: Date.now(), ...(tokens ? { tokens } : {}) });
  }
}
