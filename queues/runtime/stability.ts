import type { RecordStability } from '../contract/schemas.js';
import type { Redis } from 'ioredis';
import { z } from 'zod';
import type { Names } from '../contract/names.js';

/**
 * Stability records for `stable_reinforce` (SDK 0.38 `record_stability_info`).
 *
 * A sampling request with `record_stability_info: true` makes the agent that ran it record, per
 * sampled sequence and keyed by its `sequence_id` (`<request_id>#<i>`, what `asample` answers in
 * `sample_sequence_ids`), what the loss needs: the request's prompt, the sampled tokens and the
 * sampler's logprob of each. A training request names those sequences through the datum's
 * provenance spans; the API checks the datum's tokens against the record and passes the recorded
 * logprobs to the engine. Records belong to the session that sampled them and live for one day
 * after sampling; each training request that uses one restarts that day (Tinker's StableReinforce
 * docs). They are small (two int lists and a float list per sequence) and live in Redis, so any
 * API process and any agent see them.
 */

export const STABILITY_TTL_S = 86_400;

export const StabilityRecord = z.object({
  /** The session that sampled the sequence; null for a sample without a sampling session. */
  session_id: z.string().nullable(),
  prompt: z.array(z.number().int()),
  tokens: z.array(z.number().int()),
  logprobs: z.array(z.number()),
});
export type StabilityRecord = z.infer<typeof StabilityRecord>;

export const sequenceId = (requestId: string, i: number) => `${requestId}#${i}`;

export async function writeStabilityRecords(
  redis: Redis,
  names: Names,
  rec: RecordStability,
  prompt: number[],
  sequences: { tokens: number[]; logprobs: number[] }[],
): Promise<void> {
  const multi = redis.multi();
  sequences.forEach((s, i) => {
    const value: StabilityRecord = { session_id: rec.session_id, prompt, tokens: s.tokens, logprobs: s.logprobs };
    multi.set(names.stability(sequenceId(rec.request_id, i)), JSON.stringify(value), 'EX', STABILITY_TTL_S);
  });
  await multi.exec();
}

/** The records of `ids` (null where none), each one's day restarted. */
export async function useStabilityRecords(redis: Redis, names: Names, ids: string[]): Promise<Map<string, StabilityRecord | null>> {
  const out = new Map<string, StabilityRecord | null>();
  if (ids.length === 0) return out;
  const keys = ids.map((id) => names.stability(id));
  const values = await redis.mget(...keys);
  const multi = redis.multi();
  ids.forEach((id, i) => {
    const v = values[i];
    out.set(id, v ? StabilityRecord.parse(JSON.parse(v)) : null);
    if (v) multi.expire(keys[i]!, STABILITY_TTL_S);
  });
  await multi.exec();
  return out;
}
