import { createHash, randomUUID } from 'node:crypto';
import type { Redis } from 'ioredis';
import { BrokerError } from './errors.js';
import { jobIds, type Names } from './names.js';
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
 *
 * The state is bounded: seq_ids past `window` ahead of the next are refused; a digest of each
 * admitted payload is kept for `window` seq_ids back, so a replay with another payload is refused;
 * ops waiting behind a gap fail at its deadline (`gapTimeoutMs` after the gate last moved) with a
 * failed-future record naming the missing seq_ids, and the gate moves past them.
 */

// Admission. KEYS: next, held, held-index, digests, gap deadlines.
// ARGV: seq, held json, job id, model id, payload digest, window, gap timeout ms, digest ttl ms.
// Returns 1 admitted, 0 duplicate (same payload), -1 gate not open, -2 beyond the window,
// -3 the seq_id was used with another payload, -4 too old to recognise.
const ADMIT = `
local nxt = redis.call('GET', KEYS[1])
if not nxt then return -1 end
nxt = tonumber(nxt)
local seq = tonumber(ARGV[1])
local window = tonumber(ARGV[6])
if seq >= nxt + window then return -2 end
local prev = redis.call('HGET', KEYS[4], ARGV[1])
if prev then
  if prev ~= ARGV[5] then return -3 end
  return 0
end
if seq < nxt then
  if seq < nxt - window then return -4 end
  return 0
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[5])
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[8]))
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
if seq > nxt then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[5], 'NX', now + tonumber(ARGV[7]), ARGV[4])
end
return 1
`;

// One released op. KEYS: next, held, held-index, digests, gap deadlines.
// ARGV: seq, job id, model id, window, gap timeout ms.
const ADVANCE = `
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local seq = tonumber(ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('SET', KEYS[1], tostring(seq + 1))
redis.call('HDEL', KEYS[4], tostring(seq - tonumber(ARGV[4])))
redis.call('ZREM', KEYS[5], ARGV[3])
if redis.call('HLEN', KEYS[2]) > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[5]), ARGV[3])
end
return 1
`;

// A gap past its deadline: every op held behind it fails (a failed-future record with the reason),
// every missing seq_id up to the last held one gets the same record (a late arrival finds it), and
// the gate moves on past them. KEYS: next, held, held-index, gap deadlines.
// ARGV: model id, job id prefix, failed-future key prefix, failed ttl s, timeout s.
const EXPIRE_GAP = `
local dl = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not dl then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(dl) > now then return 0 end
redis.call('ZREM', KEYS[4], ARGV[1])
local nxt = tonumber(redis.call('GET', KEYS[1]))
if not nxt then return 0 end
local last = nxt - 1
for _, s in ipairs(redis.call('HKEYS', KEYS[2])) do
  if tonumber(s) > last then last = tonumber(s) end
end
if last < nxt then return 0 end
local missing = {}
for s = nxt, last do
  if redis.call('HEXISTS', KEYS[2], tostring(s)) == 0 then table.insert(missing, s) end
end
local gap = table.concat(missing, ', ')
local n = 0
for s = nxt, last do
  local jobId = ARGV[2] .. s
  local raw = redis.call('HGET', KEYS[2], tostring(s))
  local op = 'forward_backward'
  if raw then
    local h = cjson.decode(raw)
    if h.job then op = h.job.op end
    redis.call('HDEL', KEYS[2], tostring(s))
    redis.call('HDEL', KEYS[3], jobId)
    n = n + 1
  end
  local msg
  if raw then
    msg = 'not run: seq_id ' .. gap .. ' of model ' .. ARGV[1] .. ' never reached the server within ' .. ARGV[5] .. ' s, so this op (seq_id ' .. s .. ') and the others waiting behind the gap (up to seq_id ' .. last .. ') were failed without running; the model is as it was before them'
  else
    msg = 'not run: this op (seq_id ' .. s .. ' of model ' .. ARGV[1] .. ') did not reach the server within ' .. ARGV[5] .. ' s while later ops waited; it and the ops behind it (up to seq_id ' .. last .. ') were failed without running'
  end
  redis.call('SET', ARGV[3] .. jobId, cjson.encode({op = op, category = 'user', message = msg}), 'EX', tonumber(ARGV[4]), 'NX')
end
redis.call('SET', KEYS[1], tostring(last + 1))
return n
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

/** Bounds of the hold-back state. */
export type GateOptions = {
  /** seq_ids accepted ahead of the next one to run; also how far back a replay is recognised. @defaultValue 1024 */
  window?: number;
  /** How long ops wait behind a missing seq_id before they fail. @defaultValue 120 000 ms */
  gapTimeoutMs?: number;
  /** How long the failure records of timed-out ops are kept, in seconds. @defaultValue 86 400 */
  failedTtlS?: number;
};

export class OrderingGate {
  readonly window: number;
  readonly gapTimeoutMs: number;
  private readonly failedTtlS: number;

  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    private readonly queues: QueueSet,
    opts: GateOptions = {},
  ) {
    this.window = opts.window ?? 1024;
    this.gapTimeoutMs = opts.gapTimeoutMs ?? 120_000;
    this.failedTtlS = opts.failedTtlS ?? 86_400;
  }

  private heldIndex(): string {
    return `${this.names.prefix}:gate:held-index`;
  }
  private digests(modelId: string): string {
    return `${this.names.prefix}:gate:${modelId}:digests`;
  }
  /** Models with ops waiting behind a gap, scored by when the wait times out. */
  private gaps(): string {
    return `${this.names.prefix}:gate:gaps`;
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
    const payload = JSON.stringify(held);
    // The digest identifies the request; a refusal (skip) is its own kind of payload.
    const digest = 'skip' in held ? 'skip' : createHash('sha256').update(JSON.stringify(held.job)).digest('base64').slice(0, 22);
    const r = (await this.redis.eval(
      ADMIT,
      5,
      this.names.gateNext(modelId),
      this.names.gateHeld(modelId),
      this.heldIndex(),
      this.digests(modelId),
      this.gaps(),
      String(seqId),
      payload,
      held.jobId,
      modelId,
      digest,
      String(this.window),
      String(this.gapTimeoutMs),
      String(this.failedTtlS * 1000),
    )) as number;
    if (r === -1) throw new Error(`ordering gate of model ${modelId} is not open`);
    // A refusal is recorded only where it can be; the request is refused either way.
    if ('skip' in held && r < 0) return 'duplicate';
    if (r === -2) {
      const { next } = await this.state(modelId);
      throw new BrokerError('INVALID_REQUEST', `seq_id ${seqId} of model ${modelId} is too far ahead: the next op to run is seq_id ${next}, and at most ${this.window} are accepted ahead of it`);
    }
    if (r === -3) throw new BrokerError('INVALID_REQUEST', `seq_id ${seqId} of model ${modelId} was already submitted with a different request; a seq_id names one op`);
    if (r === -4) throw new BrokerError('INVALID_REQUEST', `seq_id ${seqId} of model ${modelId} is more than ${this.window} ops old; it cannot be submitted again`);
    await this.release(modelId);
    return r === 1 ? 'admitted' : 'duplicate';
  }

  /** When the ops of `modelId` waiting behind a gap time out (ms since the epoch), or null. */
  async gapDeadline(modelId: string): Promise<number | null> {
    const s = await this.redis.zscore(this.gaps(), modelId);
    return s === null ? null : Number(s);
  }

  /** Fails the ops of every model whose gap has timed out (run periodically by the API). */
  async expireGaps(): Promise<number> {
    const due = await this.redis.zrangebyscore(this.gaps(), '-inf', Date.now(), 'LIMIT', 0, 100);
    for (const m of due) await this.release(m);
    return due.length;
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
        await this.redis.eval(
          EXPIRE_GAP,
          4,
          nextKey,
          heldKey,
          this.heldIndex(),
          this.gaps(),
          modelId,
          jobIds.train(modelId, 0).slice(0, -1),
          `${this.names.prefix}:failed-future:`,
          String(this.failedTtlS),
          String(this.gapTimeoutMs / 1000),
        );
        for (;;) {
          const next = await this.redis.get(nextKey);
          if (next === null) return;
          const raw = await this.redis.hget(heldKey, next);
          if (raw === null) break;
          const h = JSON.parse(raw) as Held;
          if (!('skip' in h)) await this.queues.add(h.queue, h.jobId, TrainJob.parse(h.job));
          await this.redis.eval(
            ADVANCE,
            5,
            nextKey,
            heldKey,
            this.heldIndex(),
            this.digests(modelId),
            this.gaps(),
            next,
            h.jobId,
            modelId,
            String(this.window),
            String(this.gapTimeoutMs),
          );
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
