import { createHash } from 'node:crypto';
import type { Redis } from 'ioredis';
import { BrokerError } from '../contract/errors.js';
import { encodeRequestId } from '../contract/futures.js';
import { jobIds, type Names } from '../contract/names.js';
import type { QueueSet } from './queues.js';
import { TrainJob } from '../contract/schemas.js';
import { scripts } from './scripts.js';
import { localTrainConsumer, type HandedJob, type HandOff } from './train-consumer.js';

/**
 * The per-model ordering gate. A model's training ops must run in the client's `seq_id`
 * order, but HTTP requests arrive out of order (the SDK sends the chunks of one batch in
 * parallel, first chunk last). Each op is *admitted* by seq_id and *released* onto the model's
 * training queue only when every lower seq_id has been released.
 *
 * All state is in Redis and every step is one Lua script (queues/runtime/lua/gate-*.lua), so any API
 * process may submit and none needs a lock:
 * - `submit` is one round trip: the script checks the seq_id (window, replay, duplicate), stores
 *   the job once (its BullMQ job hash, the JSON the API encoded, which the agent parses), and, when
 *   the op is next in order, queues it and every held op that follows it; it also records the
 *   future's owner and the model's last request. A repeated `(model_id, seq_id)` gets the same future.
 * - the job is parsed against the job schema before the script runs: a job the agent cannot parse
 *   never reaches the gate, so it can never hold a model's later ops back.
 * - when the queue's consumer runs in this process (`tinker-broker start`), the same script takes
 *   the queue's next job for it, and the consumer is handed it here, parsed (`handOff`).
 *
 * The state is bounded: seq_ids past `window` ahead of the next are refused; a digest of each
 * admitted payload is kept for `window` seq_ids back, so a replay with another payload is refused;
 * ops waiting behind a gap fail at its deadline (`gapTimeoutMs` after the gate last moved) with a
 * failed-future record naming the missing seq_ids, and the gate moves past them.
 */

export type AdmitOutcome = 'admitted' | 'duplicate';

const codes = scripts.gateSubmit.codes;

/** The model's agent is not alive: nothing was admitted (the caller fails the op's future instead). */
export class AgentGone extends Error {
  override readonly name = 'AgentGone';
}

/** The model's record is gone (expired): nothing was admitted (a submit with `checkModel`). */
export class ModelGone extends Error {
  override readonly name = 'ModelGone';
}

/** The model is lost (its weights are gone, `reason`): nothing was admitted (a submit with `checkModel`). */
export class ModelLost extends Error {
  override readonly name = 'ModelLost';
  constructor(readonly reason: string) {
    super(`model lost: ${reason}`);
  }
}

/** The model is on another agent's queue now (an agent adopted it): nothing was admitted; submit again with its record read afresh. */
export class ModelMoved extends Error {
  override readonly name = 'ModelMoved';
}

/** Bounds of the hold-back state. */
export type GateOptions = {
  /** seq_ids accepted ahead of the next one to run; also how far back a replay is recognised. @defaultValue 1024 */
  window?: number;
  /** How long ops wait behind a missing seq_id before they fail. @defaultValue 120 000 ms */
  gapTimeoutMs?: number;
  /** How long the failure records of timed-out ops are kept, in seconds. @defaultValue 86 400 */
  failedTtlS?: number;
  /** The lifetime of a model's gate (its `next` key, as the model's record), restarted by every op submitted, in seconds. @defaultValue 86 400 */
  modelTtlS?: number;
};

/** What the submit records beside the op: its future's owner, and the agent that must be alive. */
export type SubmitExtras = {
  /** The tenant the future is issued to (recorded in the same round trip); none when absent. */
  tenant?: string;
  /** How long the owner record lives, in seconds. @defaultValue 172 800 */
  ownerTtlS?: number;
  /** Refuse (AgentGone) when this agent is neither alive nor drained with this model saved for its restart. */
  agentId?: string;
  /**
   * Check the model's record in the same script (the caller built the job from a copy read earlier,
   * ModelRegistry.placed): refuse with ModelGone when it has expired, ModelLost when it is lost.
   */
  checkModel?: boolean;
};

export class OrderingGate {
  readonly window: number;
  readonly gapTimeoutMs: number;
  private readonly failedTtlS: number;
  private readonly modelTtlS: number;

  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    private readonly queues: QueueSet,
    opts: GateOptions = {},
  ) {
    this.window = opts.window ?? 1024;
    this.gapTimeoutMs = opts.gapTimeoutMs ?? 120_000;
    this.failedTtlS = opts.failedTtlS ?? 86_400;
    this.modelTtlS = opts.modelTtlS ?? 86_400;
  }

  /** The keys of a model's gate (queues/runtime/lua/gate-lib.lua). */
  private keys(modelId: string) {
    return { next: this.names.gateNext(modelId), held: this.names.gateHeld(modelId), heldIndex: this.names.gateHeldIndex(), digests: this.names.gateDigests(modelId), gaps: this.names.gateGaps() };
  }

  /** The arguments the gate's scripts share: its bounds, and where a gap's failures are written. */
  private common(modelId: string) {
    return {
      modelId,
      window: this.window,
      gapMs: this.gapTimeoutMs,
      bullPrefix: `${this.names.bull}:`,
      failedPrefix: this.names.failedFuture(''),
      failedTtlS: this.failedTtlS,
      gapS: String(this.gapTimeoutMs / 1000),
      trainJobIdPrefix: jobIds.train(modelId, 0).slice(0, -1),
    };
  }

  /** Opens a model's gate after create_model (seq 0): the next op to release is seq 1. */
  async open(modelId: string): Promise<void> {
    await this.redis.set(this.names.gateNext(modelId), '1', 'EX', this.modelTtlS, 'NX');
  }

  async isOpen(modelId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.gateNext(modelId))) === 1;
  }

  /**
   * The model of a job that is admitted but not yet released (its future is pending, not
   * unknown), or null. Callers that find one call `release(model)`, which fails it when its gap
   * has timed out.
   */
  async heldModel(jobId: string): Promise<string | null> {
    return this.redis.hget(this.names.gateHeldIndex(), jobId);
  }

  /**
   * Admits one training op and releases whatever is now in order, in one round trip. Returns
   * `duplicate` for a `(model_id, seq_id)` seen before, whose future is the one already issued.
   * The job is parsed first: an op the agent could not parse is refused here (INVALID_REQUEST).
   */
  async submit(modelId: string, seqId: number, queue: string, jobId: string, job: TrainJob, extras: SubmitExtras = {}): Promise<AdmitOutcome> {
    const parsed = TrainJob.safeParse(job);
    if (!parsed.success)
      throw new BrokerError('INVALID_REQUEST', `invalid ${job.op} request: ${parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`);
    const data = JSON.stringify(parsed.data);
    const digest = createHash('sha256').update(data).digest('base64').slice(0, 22);
    return this.admit(modelId, seqId, jobId, { queue, name: parsed.data.op, data, digest, parsed: parsed.data }, extras);
  }

  /**
   * Records that `seq_id` will never run: the request was refused (bad input, a lost model), but
   * the SDK has used up the number and sends the next one. Later ops must not wait for it.
   */
  async skip(modelId: string, seqId: number, jobId: string): Promise<AdmitOutcome> {
    return this.admit(modelId, seqId, jobId, null, {});
  }

  private async admit(
    modelId: string,
    seqId: number,
    jobId: string,
    op: { queue: string; name: string; data: string; digest: string; parsed: TrainJob } | null,
    extras: SubmitExtras,
  ): Promise<AdmitOutcome> {
    const now = Date.now();
    // The queue's agent in this process: the script takes the next job for it, handed over here
    // (queues/runtime/train-consumer.ts TrainConsumer.handOff; none while its own take is in flight).
    const handOff = op ? (localTrainConsumer(`${this.names.bull}:${op.queue}:`)?.handOff() ?? null) : null;
    let handed: HandedJob | null = null;
    let answered = false;
    let reply: Awaited<ReturnType<OrderingGate['admitScript']>>;
    try {
      reply = await this.admitScript(modelId, seqId, jobId, op, extras, now, handOff);
      answered = true;
      // Admitted, with the job the script took for this process's consumer.
      if (Array.isArray(reply) && reply[0] === codes.admitted) handed = reply.slice(1) as unknown as HandedJob;
    } finally {
      handOff?.settle(handed, { id: jobId, data: op?.parsed, at: now, tenant: extras.tenant }, !answered);
    }
    if (Array.isArray(reply) && reply[0] === codes.modelLost) throw new ModelLost(reply[1]);
    const r = Array.isArray(reply) ? reply[0] : reply;
    if (r === codes.modelGone) throw new ModelGone(`model ${modelId} has no record`);
    if (r === codes.moved) throw new ModelMoved(`model ${modelId} moved to another agent's queue`);
    if (r === codes.notOpen) throw new Error(`ordering gate of model ${modelId} is not open`);
    // A refusal is recorded only where it can be; the request is refused either way.
    if (op === null && r !== codes.admitted && r !== codes.duplicate) return 'duplicate';
    if (r === codes.agentGone) throw new AgentGone(`agent ${extras.agentId} is not alive`);
    if (r === codes.beyondWindow) {
      const { next } = await this.state(modelId);
      throw new BrokerError('INVALID_REQUEST', `seq_id ${seqId} of model ${modelId} is too far ahead: the next op to run is seq_id ${next}, and at most ${this.window} are accepted ahead of it`);
    }
    if (r === codes.otherPayload) throw new BrokerError('INVALID_REQUEST', `seq_id ${seqId} of model ${modelId} was already submitted with a different request; a seq_id names one op`);
    if (r === codes.tooOld) throw new BrokerError('INVALID_REQUEST', `seq_id ${seqId} of model ${modelId} is more than ${this.window} ops old; it cannot be submitted again`);
    return r === codes.admitted ? 'admitted' : 'duplicate';
  }

  /** queues/runtime/lua/gate-submit.lua, with a hand-off's take when there is one. */
  private async admitScript(
    modelId: string,
    seqId: number,
    jobId: string,
    op: { queue: string; name: string; data: string; digest: string } | null,
    extras: SubmitExtras,
    now: number,
    handOff: HandOff | null,
  ) {
    return scripts.gateSubmit.run(this.redis, {
      keys: {
        ...this.keys(modelId),
        agentAlive: this.names.agentAlive(extras.agentId ?? ''),
        owner: this.names.futureOwner(encodeRequestId({ queue: op?.queue ?? '-', jobId })),
        modelLast: this.names.modelLast(),
        agentDrained: this.names.agentDrained(extras.agentId ?? ''),
        model: this.names.model(modelId),
        agentRecovers: this.names.agentRecovers(extras.agentId ?? ''),
        moved: this.names.jobMoved(jobId),
      },
      args: {
        ...this.common(modelId),
        seqId,
        jobId,
        digest: op?.digest ?? 'skip',
        digestTtlMs: this.failedTtlS * 1000,
        queue: op?.queue ?? '',
        jobName: op?.name ?? '',
        jobData: op?.data ?? '',
        jobOpts: this.queues.storedJobOptions(),
        timestamp: now,
        tenant: op && extras.tenant !== undefined ? extras.tenant : '',
        ownerTtlS: extras.ownerTtlS ?? 172_800,
        nowIso: new Date(now).toISOString(),
        checkAgent: op && extras.agentId ? '1' : '0',
        modelTtlMs: this.modelTtlS * 1000,
        checkModel: op && extras.checkModel ? '1' : '0',
      },
      optional: handOff?.take,
    });
  }

  /** When the ops of `modelId` waiting behind a gap time out (ms since the epoch), or null. */
  async gapDeadline(modelId: string): Promise<number | null> {
    const s = await this.redis.zscore(this.names.gateGaps(), modelId);
    return s === null ? null : Number(s);
  }

  /** Fails the ops of every model whose gap has timed out (run periodically by the API). */
  async expireGaps(): Promise<number> {
    const due = await this.redis.zrangebyscore(this.names.gateGaps(), '-inf', Date.now(), 'LIMIT', 0, 100);
    for (const m of due) await this.release(m);
    return due.length;
  }

  /** Fails the ops held behind a timed-out gap and queues whatever is then in order. */
  async release(modelId: string): Promise<void> {
    await scripts.gateRelease.run(this.redis, { keys: this.keys(modelId), args: this.common(modelId) });
  }

  /** The seq_id the gate releases next, and how many ops wait behind a gap. */
  async state(modelId: string): Promise<{ next: number | null; held: number }> {
    const [next, held] = await Promise.all([
      this.redis.get(this.names.gateNext(modelId)),
      this.redis.hlen(this.names.gateHeld(modelId)),
    ]);
    return { next: next === null ? null : Number(next), held };
  }
}
