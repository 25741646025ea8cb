import { randomUUID } from 'node:crypto';
import type { Redis } from 'ioredis';
import type { Names } from './names.js';
import type { QueueSet } from './queues.js';
import { TrainJob } from './schemas.js';

/**
 * The per-model ordering gate. A model's training ops must run in the client's `seq_id`
 * order, but HTTP requests arrive out of order (the SDK sends the chunks of one batch in
 * parallel, first chunk last). Each op is *admitted* into a Redis hash keyed by seq_id and
 * *released* onto the model's training queue only when every lower seq_id has been released.
 *
 * All state is in Redis, so any API process may admit and any may release:
 * - admission is one Lua script (duplicate check + store), so a repeated `(model_id, seq_id)`
 *   is recognised atomically and gets the same future;
 * - release is done under a short per-model lock, so two processes never push the ops of one
 *   model onto the queue out of order; a released op is deleted from the hash only after
 *   BullMQ holds it (a crash in between re-adds it under the same job id, which BullMQ ignores).
 */

const ADMIT = `
local nxt = redis.call('GET', KEYS[1])
if not nxt then return -1 end
if tonumber(ARGV[1]) < tonumber(nxt) then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return 1
`;

const ADVANCE = `
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('SET', KEYS[1], tostring(tonumber(ARGV[1]) + 1))
return 1
`;

const UNLOCK = `
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`;

/** An admitted op, or a skipped seq_id (a request refused at the door still used up its seq_id). */
/** A releaser that died leaves its lock this long; then any poll of a held future resumes the release. */
const LOCK_MS = 10_000;

type Held = { queue: string; jobId: string; job: TrainJob } | { skip: true; jobId: string };

export type AdmitOutcome = 'admitted' | 'duplicate';

export class OrderingGate {
  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    private readonly queues: QueueSet,
  ) {}

  private heldIndex(): string {
    return `${this.names.prefix}:gate:held-index`;
  }

  /** Opens a model's gate after create_model (seq 0): the next op to release is seq 1. */
  async open(modelId: string): Promise<void> {
    await this.redis.set(this.names.gateNext(modelId), '1', 'NX');
  }

  async isOpen(modelId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.gateNext(modelId))) === 1;
  }

  /**
   * The model of a job that is admitted but not yet released (its future is pending, not
   * unknown), or null. Callers that find one call `release(model)`: if the process that was
   * releasing died, whoever polls the future next finishes the release.
   */
  async heldModel(jobId: string): Promise<string | null> {
    return this.redis.hget(this.heldIndex(), jobId);
  }

  /**
   * Admits one training op and releases whatever is now in order. Returns `duplicate` for a
   * `(model_id, seq_id)` seen before, whose future is the one already issued.
   */
  async submit(modelId: string, seqId: number, queue: string, jobId: string, job: TrainJob): Promise<AdmitOutcome> {
    return this.admit(modelId, seqId, { queue, jobId, job });
  }

  /**
   * Records that `seq_id` will never run: the request was refused (bad input, a lost model), but
   * the SDK has used up the number and sends the next one. Later ops must not wait for it.
   */
  async skip(modelId: string, seqId: number, jobId: string): Promise<AdmitOutcome> {
    return this.admit(modelId, seqId, { skip: true, jobId });
  }

  private async admit(modelId: string, seqId: number, held: Held): Promise<AdmitOutcome> {
    const r = (await this.redis.eval(
      ADMIT,
      3,
      this.names.gateNext(modelId),
      this.names.gateHeld(modelId),
      this.heldIndex(),
      String(seqId),
      JSON.stringify(held),
      held.jobId,
      modelId,
    )) as number;
    if (r === -1) throw new Error(`ordering gate of model ${modelId} is not open`);
    await this.release(modelId);
    return r === 1 ? 'admitted' : 'duplicate';
  }

  /** Pushes the model's in-order prefix of admitted ops onto its queue. */
  async release(modelId: string): Promise<void> {
    const nextKey = this.names.gateNext(modelId);
    const heldKey = this.names.gateHeld(modelId);
    const lockKey = this.names.gateLock(modelId);
    for (;;) {
      const token = randomUUID();
      const got = await this.redis.set(lockKey, token, 'PX', LOCK_MS, 'NX');
      // Another process is releasing; it re-checks after unlocking, so nothing is stranded.
      if (got !== 'OK') return;
      try {
        for (;;) {
          const next = await this.redis.get(nextKey);
          if (next === null) return;
          const raw = await this.redis.hget(heldKey, next);
          if (raw === null) break;
          const h = JSON.parse(raw) as Held;
          if (!('skip' in h)) await this.queues.add(h.queue, h.jobId, TrainJob.parse(h.job));
          await this.redis.eval(ADVANCE, 3, nextKey, heldKey, this.heldIndex(), next, h.jobId);
        }
      } finally {
        await this.redis.eval(UNLOCK, 1, lockKey, token);
      }
      const next = await this.redis.get(nextKey);
      if (next === null || (await this.redis.hexists(heldKey, next)) === 0) return;
    }
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
