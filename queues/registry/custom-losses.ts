import { z } from 'zod';
import { CustomLossSpec, CUSTOM_LOSS_OPS } from '../contract/custom-loss.js';
import { resourceIds } from '../contract/names.js';
import { RedisRegistry } from './store.js';

/**
 * The custom losses each session created (create_custom_loss), one hash per session
 * (`names.sessionCustomLosses`), field = the SDK's `custom_loss_seq_id`. A record carries its tenant:
 * another tenant's lookup finds nothing. At most `max_losses_per_session` per session
 * (queues/contract/custom-loss.json), so a client cannot fill Redis.
 */

export const CustomLossRecord = z.object({
  loss_id: z.string(),
  tenant: z.string(),
  session_id: z.string(),
  spec: CustomLossSpec,
  created_at: z.string(),
});
export type CustomLossRecord = z.infer<typeof CustomLossRecord>;

/** What `put` did: stored it, found the same loss stored under that seq_id, or a different one. */
export type PutOutcome = 'stored' | 'same' | 'conflict' | 'full';

const LOSS_ID = /^(.+):loss:(\d{1,9})$/;

export class CustomLossRegistry extends RedisRegistry {
  /** Stores `rec` under its session and seq_id unless one is there; the session keeps at most `max_losses_per_session`. */
  async put(rec: CustomLossRecord, seqId: number, ttlS: number): Promise<PutOutcome> {
    const key = this.names.sessionCustomLosses(rec.session_id);
    const json = JSON.stringify(rec);
    const existing = await this.redis.hget(key, String(seqId));
    if (existing !== null) {
      const prev = CustomLossRecord.parse(JSON.parse(existing));
      return prev.tenant === rec.tenant && JSON.stringify(prev.spec) === JSON.stringify(rec.spec) ? 'same' : 'conflict';
    }
    if ((await this.redis.hlen(key)) >= CUSTOM_LOSS_OPS.max_losses_per_session) return 'full';
    const [[, set]] = (await this.redis.multi().hsetnx(key, String(seqId), json).expire(key, ttlS).exec()) as [[Error | null, number]];
    return set === 1 ? 'stored' : this.put(rec, seqId, ttlS);
  }

  /** The loss `lossId` if `tenant` created it, else null (another tenant's reads as unknown); its session's losses live on. */
  async get(lossId: string, tenant: string, ttlS: number): Promise<CustomLossRecord | null> {
    const m = LOSS_ID.exec(lossId);
    if (!m) return null;
    const key = this.names.sessionCustomLosses(m[1]!);
    const [[, raw]] = (await this.redis.multi().hget(key, m[2]!).expire(key, ttlS).exec()) as [[Error | null, string | null]];
    if (raw === null) return null;
    const rec = CustomLossRecord.parse(JSON.parse(raw));
    return rec.tenant === tenant && rec.loss_id === lossId ? rec : null;
  }
}

/** The loss id the API hands out for a session's custom loss (deterministic: a resent create names the same loss). */
export const customLossId = resourceIds.customLoss;
