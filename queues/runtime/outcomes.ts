import type { Redis } from 'ioredis';
import { z } from 'zod';
import type { Names } from '../contract/names.js';
import { dropKept, handOverLocally, keepHandedOver, signalLocally, signalMessage, SIGNALLED_RECORD_MAX_BYTES } from './completions.js';
import { scripts } from './scripts.js';

/**
 * The outcome of each training op, recorded by the agent in a key of its own (not in BullMQ's job
 * state, which a lost job lock can turn into "job stalled" after the op took effect). The record
 * goes through one state change only, each a Lua compare-and-set:
 *
 *   (absent) --claim by the agent--> running --finish by the same claim--> done | failed
 *   (absent) | running --reaper (dead or hung agent)--> failed with OUTCOME_UNKNOWN
 *
 * The first final state wins: an agent that finishes after the reaper gave up on it does not turn
 * a reported failure into a success, and an op the reaper failed before it started is never run
 * (the agent's claim finds the record and skips it). So no op is run twice and no future reports
 * an outcome other than the one that happened (or says it cannot know). A waiter in the agent's own
 * process is answered from the agent's result as its record is sent (`finish` with `early`): what
 * ran, even in the rare case that the reaper's OUTCOME_UNKNOWN stands in Redis.
 */
export const Outcome = z.object({
  state: z.enum(['running', 'done', 'failed']),
  op: z.string(),
  agent_id: z.string(),
  /** The claim: one agent incarnation and job. */
  token: z.string(),
  at: z.string(),
  result: z.unknown().optional(),
  category: z.enum(['user', 'server', 'unknown']).optional(),
  code: z.string().optional(),
  message: z.string().optional(),
  /** When the engine ran the op: [start, end], ms since the epoch (sub-ms precision). */
  engine: z.tuple([z.number(), z.number()]).optional(),
  /** A forward_backward run in one engine pass with others (co-batching, workers/agent/training.ts): how many ops that pass ran. */
  cobatch: z.number().int().optional(),
});
export type Outcome = z.infer<typeof Outcome>;

export { SIGNALLED_RECORD_MAX_BYTES };

/**
 * A taken training job to end as completed in its queue by the script that records its outcome as
 * done (queues/runtime/lua/outcome-finish.lua with bullmq-job.lua's bullCompleteJob), in place of BullMQ's
 * own moveToFinished after it: one round trip at the op's end instead of two. Made by the job's
 * consumer (queues/runtime/train-consumer.ts); `ended` is what the script did: 1 ended, 0 left for BullMQ (a
 * job of another shape), negative not ended (BullMQ's codes: the lock lost, the job not active);
 * undefined when no such script ran (the record was another's, or the op failed).
 */
export type CompletedEnd = { queuePrefix: string; lockToken: string; ended?: number };

export class Outcomes {
  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    /** How long a record is kept (the retention); a claim made at take (queues/runtime/train-consumer.ts) uses it too. */
    readonly ttlS: number,
  ) {}

  key(jobId: string): string {
    return this.names.outcome(jobId);
  }

  /**
   * The outcome as its future reads it: a final one then leaves Redis within `ttlAfterReadMs`, with
   * the job (`jobKey`) and the owner record (`ownerKey`), unless `keep` (one round trip).
   */
  async read(jobId: string, jobKey: string, ownerKey: string, ttlAfterReadMs: number, keep: boolean): Promise<Outcome | null> {
    const raw = await scripts.outcomeRead.run(this.redis, {
      keys: { outcome: this.key(jobId), job: jobKey, owner: ownerKey },
      args: { readTtlMs: ttlAfterReadMs, keep: keep ? '1' : '0' },
    });
    return raw === null ? null : Outcome.parse(JSON.parse(raw));
  }

  async get(jobId: string): Promise<Outcome | null> {
    const raw = await this.redis.get(this.key(jobId));
    return raw === null ? null : Outcome.parse(JSON.parse(raw));
  }

  /** Claims the op for running; returns null when claimed, else the record that was there first (do not run). */
  async claim(jobId: string, op: string, agentId: string, token: string): Promise<Outcome | null> {
    const rec: Outcome = { state: 'running', op, agent_id: agentId, token, at: new Date().toISOString() };
    const prev = await scripts.outcomeClaim.run(this.redis, { keys: { outcome: this.key(jobId) }, args: { record: JSON.stringify(rec), ttlS: this.ttlS } });
    return prev === null ? null : Outcome.parse(JSON.parse(prev));
  }

  /** Gives back a claim whose op never started (it goes back to its queue); true when it was still this claim's. */
  async release(jobId: string, token: string): Promise<boolean> {
    return (await scripts.outcomeRelease.run(this.redis, { keys: { outcome: this.key(jobId) }, args: { token } })) === scripts.outcomeRelease.codes.released;
  }

  /**
   * Records the final outcome unless another one is already final; returns the record that stands.
   * `early` (the agent, with the op's result in hand): this process's waiters are handed the record
   * first and answer; it is sent once their answers are written, the script applies the read-once
   * expiries they registered and publishes no message when this process's subscriptions are the
   * channel's only ones (queues/runtime/completions.ts). With no waiter here to hand it to, it is kept here
   * for the first read of its future (keepHandedOver), when a submit here gave the op to this agent.
   * This process's waiters not handed it (none without `early`) are signalled once it is recorded. `end` (a done record): the op's job is ended as
   * completed in the same script when the record is written (CompletedEnd).
   */
  async finish(
    jobId: string,
    token: string | '',
    final: Omit<Outcome, 'token' | 'at'> & { state: 'done' | 'failed' },
    early = false,
    end?: CompletedEnd,
  ): Promise<Outcome> {
    // `state` first: queues/runtime/lua/outcome-read.lua tells a running record by its first bytes.
    const { state, ...rest } = final;
    const rec: Outcome = { state, ...rest, token: token || 'reaper', at: new Date().toISOString() };
    const channel = this.names.outcomesChannel();
    const json = JSON.stringify(rec);
    const message = signalMessage(jobId, json);
    const { woken, ownerWoken, expiries, subscriptions, tenant } = early
      ? handOverLocally(channel, jobId, rec)
      : { woken: 0, ownerWoken: false, expiries: [], subscriptions: 0, tenant: undefined };
    // No one here waited for it as its owner (another tenant's retrieve reads the future as unknown,
    // and answers no record): a record small enough for a message is kept for the first read of its
    // future here, from now on (queues/runtime/completions.ts keepHandedOver).
    let written = (): void => undefined;
    if (!ownerWoken && tenant !== undefined && message !== jobId) keepHandedOver(channel, jobId, tenant, rec, new Promise<void>((r) => (written = r)));
    let prev: string | number | null;
    try {
      // After the waiters' answers: they are written in the promise jobs that handing over queued
      // (the HTTP answer is a synchronous socket write), and a tick runs once those have run.
      if (woken) await new Promise((r) => process.nextTick(r));
      prev = await scripts.outcomeFinish.run(this.redis, {
        keys: { outcome: this.key(jobId), readOnce: [...new Set(expiries.flatMap((e) => e.keys))] },
        args: {
          record: json,
          ttlS: this.ttlS,
          token,
          channel,
          jobId,
          signalMaxBytes: SIGNALLED_RECORD_MAX_BYTES,
          readOnceMs: Math.min(...expiries.map((e) => e.ms), 0x7fffffff),
          handed: subscriptions,
        },
        // A done record ends the op's job in the same script.
        optional: end && state === 'done' ? { endQueuePrefix: end.queuePrefix, lockToken: end.lockToken, finishedOn: Date.now() } : undefined,
      });
    } finally {
      written();
    }
    if (typeof prev === 'string') {
      dropKept(channel, jobId);
      return Outcome.parse(JSON.parse(prev));
    }
    if (typeof prev === 'number') end!.ended = prev;
    // Recorded (and published, unless only this process listens): this process's waiters answer now,
    // after a hand-over those that came since (they found the record running, and no message comes).
    signalLocally(channel, message);
    return rec;
  }

  async failUnknown(jobId: string, op: string, agentId: string, message: string): Promise<Outcome> {
    return this.finish(jobId, '', { state: 'failed', op, agent_id: agentId, category: 'unknown', code: 'OUTCOME_UNKNOWN', message });
  }
}
